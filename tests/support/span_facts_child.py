"""A serving process for the span-facts tests and benches: the OTel SDK with the
spanlet processor, spans exported over OTLP/gRPC, kernels launched through the
stand-in libcuda by ctypes, each span a known and different number of them.

    span_facts_child.py ENDPOINT LIBCUDA batch|simple|none
    (none: no exporter, spans never reach the agent)

Driven on stdin, one command a line; each prints "span TRACE_HEX SPAN_HEX N" per
span it ended (N: the launches made inside it), then "done":

    threads T S       T threads, S spans each, interleaved; span j of thread t launches 1 + t*S + j
    asyncio K STEPS   K coroutines on one loop thread, each in its own span, switching at every
                      await; coroutine k launches k + 1 + K*s at its step s, between awaits
    to_thread S       S spans on a loop thread; each launches a few, hands some to asyncio.to_thread
    executor S        S spans; part of each span's launches run on a 2-thread pool via
                      contextvars.copy_context().run
    attach S          S spans; part of each runs on a plain thread that context.attach()es the span
    reused S          pairs of spans with the same span id in two traces, the second open
                      while the first is (two threads); S pairs
    thread_exit N     a thread starts a span, launches N and exits inside it; another thread
                      launches outside any span; the main thread ends the span
    outside N         N launches in no span
    marks N           N spans of one launch each, as fast as possible (with "none": never exported)
    open N            a span made current in the main thread, N launches in it, left open:
                      prints "open TRACE_HEX SPAN_HEX"; "close" ends it (its span line)
    impersonate TRACE_HEX SPAN_HEX N   a span with exactly those ids (a child of a remote
                      parent in that trace, its span id forced), N launches in it: the
                      impostor of the trust tests (with "none": never exported)
    paced RATE LAUNCHES SECONDS [TREE]   RATE spans/s, LAUNCHES each, for SECONDS (benches);
                      TREE > 1: in requests of a SERVER span and TREE - 1 children; prints
                      "paced SPANS LATE_S" (the schedule it kept) instead of span lines
    flush             force_flush the provider -> "flushed"
    exit              shut the provider down (exports what is left) and exit at once
"""

import asyncio
import contextvars
import ctypes
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

import child_loop
from spanlet import SpanletSpanProcessor

endpoint, libcuda, processor = sys.argv[1], sys.argv[2], sys.argv[3]
cuda = ctypes.CDLL(libcuda)
_launch = cuda.cuLaunchKernel
_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3


class ReusableIds(RandomIdGenerator):
    """Random ids, except that `next_span_id` (when set) is handed out instead."""

    def __init__(self):
        self.forced = threading.local()

    def generate_span_id(self) -> int:
        forced = getattr(self.forced, "span_id", None)
        return forced if forced is not None else super().generate_span_id()


ids = ReusableIds()
provider = TracerProvider(resource=Resource.create({"service.name": "span-facts-child"}),
                          id_generator=ids)
marker = SpanletSpanProcessor()
provider.add_span_processor(marker)
if processor != "none":
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
    # "batch": exported every 50 ms (tests see their spans soon); "batch-sdk":
    # the SDK's own defaults (every 5 s or each 512 spans), as apps run it
    provider.add_span_processor(SimpleSpanProcessor(exporter) if processor == "simple"
                                else BatchSpanProcessor(exporter) if processor == "batch-sdk"
                                else BatchSpanProcessor(exporter, schedule_delay_millis=50))
tracer = provider.get_tracer("span-facts-child")
ATTRS = {"mm.modality": "image"}
out_lock = threading.Lock()


def launch(n: int) -> None:
    for _ in range(n):
        _launch(0xF00D, 1, 1, 1, 1, 1, 1, 0, 0, None, None)


def report(span, n: int) -> None:
    ctx = span.get_span_context()
    with out_lock:
        print(f"span {ctx.trace_id:032x} {ctx.span_id:016x} {n}", flush=True)


def threads(t_count: int, spans: int) -> None:
    barrier = threading.Barrier(t_count)

    def worker(t: int) -> None:
        for j in range(spans):
            barrier.wait()  # the threads' spans overlap
            n = 1 + t * spans + j
            with tracer.start_as_current_span(f"t{t}-s{j}", attributes=ATTRS) as s:
                launch(n)
            report(s, n)

    run_threads([threading.Thread(target=worker, args=(t,)) for t in range(t_count)])


def run_threads(ts: list) -> None:
    for th in ts:
        th.start()
    for th in ts:
        th.join()


async def coroutines(k_count: int, steps: int) -> None:
    started = asyncio.Barrier(k_count)

    async def one(k: int) -> None:
        with tracer.start_as_current_span(f"coro{k}", attributes=ATTRS) as s:
            await started.wait()  # every coroutine is inside its span before any launches
            total = 0
            for step in range(steps):
                n = k + 1 + k_count * step
                launch(n)
                total += n
                await asyncio.sleep(0)
        report(s, total)

    await asyncio.gather(*(one(k) for k in range(k_count)))


async def to_thread(spans: int) -> None:
    for j in range(spans):
        here, there = 2 + j, 5 + 3 * j
        with tracer.start_as_current_span(f"to_thread{j}", attributes=ATTRS) as s:
            launch(here)
            await asyncio.to_thread(launch, there)
        report(s, here + there)


def executor(spans: int) -> None:
    with ThreadPoolExecutor(2) as pool:
        for j in range(spans):
            here, there = 1 + j, (4 + 2 * j, 7 + j)
            with tracer.start_as_current_span(f"executor{j}", attributes=ATTRS) as s:
                futs = [pool.submit(contextvars.copy_context().run, launch, n) for n in there]
                launch(here)
                for f in futs:
                    f.result()
            report(s, here + sum(there))


def attach(spans: int) -> None:
    for j in range(spans):
        here, there = 3 + j, 6 + 2 * j
        with tracer.start_as_current_span(f"attach{j}", attributes=ATTRS) as s:
            ctx = otel_context.get_current()

            def worker() -> None:
                token = otel_context.attach(ctx)
                try:
                    launch(there)
                finally:
                    otel_context.detach(token)

            th = threading.Thread(target=worker)
            th.start()
            launch(here)
            th.join()
        report(s, here + there)


def reused(pairs: int) -> None:
    for j in range(pairs):
        span_id = ids.generate_span_id()
        both_open = threading.Barrier(2)
        counts = (5 + j, 11 + 2 * j)

        def one(n: int) -> None:
            ids.forced.span_id = span_id
            try:
                # a root span: a new trace each time, the same span id
                with tracer.start_as_current_span(f"reused{j}-{n}", context=otel_context.Context(),
                                                  attributes=ATTRS) as s:
                    ids.forced.span_id = None
                    both_open.wait()
                    launch(n)
                    both_open.wait()
            finally:
                ids.forced.span_id = None
            report(s, n)

        run_threads([threading.Thread(target=one, args=(n,)) for n in counts])


def thread_exit(n: int) -> None:
    holder = []

    def dies_inside() -> None:
        span = tracer.start_span("thread_exit", attributes=ATTRS)
        token = otel_context.attach(trace.set_span_in_context(span))
        launch(n)
        holder.append((span, token))
        # returns without detaching or ending: the thread exits inside the span

    run_threads([threading.Thread(target=dies_inside)])
    run_threads([threading.Thread(target=launch, args=(3,)) for _ in range(4)])
    span, _ = holder[0]
    span.end()
    report(span, n)


def marks(count: int) -> None:
    for j in range(count):
        with tracer.start_as_current_span("mark", attributes=ATTRS):
            launch(1)


held: list = []


def open_span(n: int) -> None:
    span = tracer.start_span("held", attributes=ATTRS)
    token = otel_context.attach(trace.set_span_in_context(span))
    launch(n)
    held.append((span, token, n))
    ctx = span.get_span_context()
    print(f"open {ctx.trace_id:032x} {ctx.span_id:016x}", flush=True)


def close_span() -> None:
    span, token, n = held.pop()
    otel_context.detach(token)
    span.end()
    report(span, n)


def impersonate(trace_hex: str, span_hex: str, n: int) -> None:
    parent = trace.NonRecordingSpan(trace.SpanContext(
        int(trace_hex, 16), ids.generate_span_id(), is_remote=True,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED)))
    ids.forced.span_id = int(span_hex, 16)
    try:
        with tracer.start_as_current_span("impostor", context=trace.set_span_in_context(parent),
                                          attributes=ATTRS) as s:
            ids.forced.span_id = None
            launch(n)
    finally:
        ids.forced.span_id = None
    report(s, n)


def paced(rate: float, launches: int, seconds: float, tree: int = 1) -> None:
    """`tree` 1: root spans; else requests of a SERVER span and tree - 1
    children, each span with its own launches."""
    t0, done, step = time.monotonic(), 0, 1.0 / rate
    total = int(rate * seconds)
    while done < total:
        due = t0 + done * step
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        if tree == 1:
            with tracer.start_as_current_span("paced", attributes=ATTRS):
                launch(launches)
        else:
            with tracer.start_as_current_span("paced", attributes=ATTRS, kind=trace.SpanKind.SERVER):
                launch(launches)
                for _ in range(tree - 1):
                    with tracer.start_as_current_span("paced", attributes=ATTRS):
                        launch(launches)
        done += tree
    print(f"paced {done} {time.monotonic() - t0 - seconds:.3f}", flush=True)


COMMANDS = {
    "threads": lambda a: threads(int(a[0]), int(a[1])),
    "asyncio": lambda a: asyncio.run(coroutines(int(a[0]), int(a[1]))),
    "to_thread": lambda a: asyncio.run(to_thread(int(a[0]))),
    "executor": lambda a: executor(int(a[0])),
    "attach": lambda a: attach(int(a[0])),
    "reused": lambda a: reused(int(a[0])),
    "thread_exit": lambda a: thread_exit(int(a[0])),
    "outside": lambda a: launch(int(a[0])),
    "marks": lambda a: marks(int(a[0])),
    "paced": lambda a: paced(float(a[0]), int(a[1]), float(a[2]), *map(int, a[3:4])),
    "open": lambda a: open_span(int(a[0])),
    "close": lambda a: close_span(),
    "impersonate": lambda a: impersonate(a[0], a[1], int(a[2])),
}

assert marker.active, "marker library not loaded"
child_loop.serve(provider, COMMANDS)
