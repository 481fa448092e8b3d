"""Cost of SpanletSpanProcessor to an instrumented app, with the processor and
without it side by side in one run: µs per span edge and per task switch, on
asyncio's loop and on uvloop (each task step wrapped and followed).

"Without" runs with the client's process-wide context hooks removed, so it is
the SDK as it is without spanlet; "with" has them installed, as any process
with an active processor has.

No kernel uprobe is attached here (no root needed); the agent's uprobe on
spanlet_mark adds its own cost per mark, measured separately. A spanlet agent
running on the machine attaches to every process that maps a file named
libspanlet_marker*, this one included: pass --lib with a build under another
name (tests/support/marker_build.py makes one) to keep its traps out.

Run: .venv/bin/python bench/client_bench.py [--spans N] [--repeat R] [--lib PATH]
(the marker extension that the package build made, unless --lib names another build)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import uvloop

from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

from spanlet import SpanletSpanProcessor, client

# The benchmark thread's CPU time: other work on the machine (a 2-core VM
# here) preempts the run but does not count.
clock = time.thread_time_ns


def tracer_with(processor: SpanProcessor | None):
    provider = TracerProvider()
    if processor is not None:
        provider.add_span_processor(processor)
    return provider.get_tracer("spanlet.bench")


def ns_per_span(tracer, spans: int) -> float:
    """One root span with one child, the shape of a served request, repeated;
    result per span. Attributes as a real app would pass them."""
    attrs = {"mm.modality": "image"}
    start = clock()
    for _ in range(spans // 2):
        with tracer.start_as_current_span("request", attributes=attrs):
            with tracer.start_as_current_span("decode"):
                pass
    return (clock() - start) / (spans // 2 * 2)


def ns_per_edge_direct(processor, spans: int, tracer) -> float:
    """The processor's own on_start + on_end, called on a pre-made span, per edge."""
    span = tracer.start_span("probe", attributes={"mm.modality": "audio"})
    readable = span._readable_span()  # what the SDK hands to on_end
    on_start, on_end = processor.on_start, processor.on_end
    start = clock()
    for _ in range(spans):
        on_start(span)
        on_end(readable)
    elapsed = clock() - start
    span.end()
    return elapsed / (2 * spans)


def ns_per_task_switch(tracer, steps: int, tasks: int = 4, spans: bool = True, run=asyncio.run) -> float:
    """`tasks` coroutines on one event loop, each in its own span (or in none),
    each yielding `steps` times: ns per task step, every step a switch to
    another task (and, with spans, to another span)."""

    async def worker(i: int) -> None:
        if spans:
            with tracer.start_as_current_span(f"task{i}"):
                for _ in range(steps):
                    await asyncio.sleep(0)
        else:
            for _ in range(steps):
                await asyncio.sleep(0)

    async def main() -> int:
        start = clock()
        await asyncio.gather(*(worker(i) for i in range(tasks)))
        return clock() - start

    return run(main()) / (tasks * steps)


def ns_per_mark(mark, calls: int) -> float:
    """The call into the marker's mark() alone, as the processor makes it."""
    args = (0xDEADBEEFFEEDFACE123456789ABCDEF0, 0xCAFEF00D0BADF00D, 2)
    start = clock()
    for _ in range(calls):
        mark(*args)
    return (clock() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans", type=int, default=4_000)
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--lib", help="another build of the marker extension (default: the package's own)")
    args = ap.parse_args()

    processor = SpanletSpanProcessor(args.lib)
    if not processor.active:
        sys.exit(f"marker {client.library_path(args.lib) or client.MARKER_MODULE} unusable "
                 "(see the warning above)")
    plain, noop, marked = tracer_with(None), tracer_with(SpanProcessor()), tracer_with(processor)
    for tracer in (plain, noop, marked):
        ns_per_span(tracer, 2000)  # warm-up

    runs = {k: [] for k in ("without", "noop", "with", "edge", "mark",
                            "switch_without", "switch_with", "switch_nospan",
                            "uv_without", "uv_with", "uv_nospan")}
    switch_steps = max(args.spans // 8, 100)
    for _ in range(args.repeat):  # short runs, interleaved, so drift and noise hit all alike
        client._remove_hooks()  # the SDK as it is without spanlet
        runs["without"].append(ns_per_span(plain, args.spans))
        runs["noop"].append(ns_per_span(noop, args.spans))
        runs["switch_without"].append(ns_per_task_switch(plain, switch_steps))
        runs["uv_without"].append(ns_per_task_switch(plain, switch_steps, run=uvloop.run))
        client._install_hooks()
        runs["with"].append(ns_per_span(marked, args.spans))
        runs["edge"].append(ns_per_edge_direct(processor, args.spans // 2, plain))
        runs["mark"].append(ns_per_mark(processor._mark, args.spans))
        runs["switch_with"].append(ns_per_task_switch(marked, switch_steps))
        runs["switch_nospan"].append(ns_per_task_switch(marked, switch_steps, spans=False))
        runs["uv_with"].append(ns_per_task_switch(marked, switch_steps, run=uvloop.run))
        runs["uv_nospan"].append(ns_per_task_switch(marked, switch_steps, spans=False, run=uvloop.run))

    best = {k: min(v) / 1000 for k, v in runs.items()}
    med = {k: statistics.median(v) / 1000 for k, v in runs.items()}

    def row(label: str, value) -> None:
        b, m = value(best), value(med)
        print(f"  {label:<52} {b:8.3f} {m:8.3f}")

    def paired(label: str, value) -> None:
        """`value` of each repeat's own runs (made back to back), median over
        the repeats: drift and load between repeats cancel out."""
        each = [value({k: v[i] / 1000 for k, v in runs.items()}) for i in range(args.repeat)]
        print(f"  {label:<52} {'':>8} {statistics.median(each):8.3f}")

    print("spanlet client: SpanletSpanProcessor cost to the app.\n"
          "  No kernel uprobe is attached here: the uprobe's own cost per edge is measured separately.")
    print(f"  {args.repeat} interleaved runs of {args.spans} spans; python {sys.version.split()[0]}")
    print(f"  {'µs':<52} {'best':>8} {'median':>8}")
    row("per span (start+end), SDK without processor", lambda r: r["without"])
    row("per span (start+end), SDK with a no-op processor", lambda r: r["noop"])
    row("per span (start+end), SDK with SpanletSpanProcessor", lambda r: r["with"])
    row("ratio with / without", lambda r: r["with"] / r["without"])
    row("added per span edge: (with - without) / 2", lambda r: (r["with"] - r["without"]) / 2)
    paired("  the same, each repeat's own (with - without) / 2", lambda r: (r["with"] - r["without"]) / 2)
    row("  of which the SDK calling any processor", lambda r: (r["noop"] - r["without"]) / 2)
    row("processor alone per edge (on_start/on_end direct)", lambda r: r["edge"])
    row("  of which the marker call (mark(), METH_FASTCALL)", lambda r: r["mark"])
    for loop, key, goal in (("asyncio", "switch", ""), ("uvloop", "uv", " (goal: <= 0.5 µs added a step)")):
        without, with_, nospan = f"{key}_without", f"{key}_with", f"{key}_nospan"
        print(f"  {loop}: 4 tasks on one loop, {switch_steps} steps each (await asyncio.sleep(0)){goal}")
        row("per task step, no processor (tasks in 4 spans)", lambda r: r[without])
        row("per task step, with processor (4 spans: 2 marks each)", lambda r: r[with_])
        row("added per task step, 4 spans", lambda r: r[with_] - r[without])
        paired("  the same, each repeat's own difference", lambda r: r[with_] - r[without])
        row("per task step, with processor, tasks in no span", lambda r: r[nospan])
        row("added per task step, tasks in no span", lambda r: r[nospan] - r[without])


if __name__ == "__main__":
    main()
