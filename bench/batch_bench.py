"""Batched steps through the agent's span path on one core, side by side in one
run with the plain join of the same spans:

- throughput: an engine's export requests of step spans (each linked to 8
  request spans, weights given) interleaved with a front end's export
  requests of those request (SERVER) spans, every span with its kernel facts
  row (50 launches and a sync); "plain": the same spans without links (no
  step ever seen: nothing held, nothing shared). Spans/s received, joined and
  exported upstream; with steps, the requests are held join.batch_wait_s (here
  short, so that the run measures the join, not the wait).
- latency: paced requests (send → upstream receipt of each request span), plain
  vs with steps at the default join.batch_wait_s: the added latency of the wait.

Rows are in the tests' stand-in map (facts_fakes.FakeFacts): the cost of the
real map's lookup is in bench/span_path_bench.py. One process pinned to one
CPU (the sender, the agent's threads and the upstream share it).

Run: .venv/bin/python bench/batch_bench.py [--seconds S] [--cpu K]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

import grpc  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402

from facts_fakes import FakeFacts  # noqa: E402
from spanlet import config  # noqa: E402
from spanlet.exporters.otlp.receiver import OtlpReceiver  # noqa: E402
from spanlet.join import SpanJoin  # noqa: E402
from spanlet.pipeline.spans import SpanPath  # noqa: E402

PER_STEP = 8
STEPS_PER_EXPORT = 64         # an engine's export: 64 steps (512 links)
LAUNCHES, SYNC_NS = 50, 20_000
REQ_TRACE_BASE, STEP_TRACE = 1 << 64, bytes(range(101, 117))


def workload(exports: int, linked: bool) -> list[ExportTraceServiceRequest]:
    """Pairs of (engine export of 64 steps, front-end export of their 512 requests)."""
    out, sid = [], 1
    for _ in range(exports):
        engine, front = ExportTraceServiceRequest(), ExportTraceServiceRequest()
        es = engine.resource_spans.add().scope_spans.add()
        fs = front.resource_spans.add().scope_spans.add()
        for _ in range(STEPS_PER_EXPORT):
            step = es.spans.add(name="engine.step", trace_id=STEP_TRACE, span_id=sid.to_bytes(8, "big"),
                                kind=1, start_time_unix_nano=1, end_time_unix_nano=2)
            sid += 1
            for w in range(PER_STEP):
                trace = (REQ_TRACE_BASE + sid).to_bytes(16, "big")
                fs.spans.add(name="POST /generate", trace_id=trace, span_id=sid.to_bytes(8, "big"),
                             kind=2, start_time_unix_nano=1, end_time_unix_nano=2)
                if linked:
                    link = step.links.add(trace_id=trace, span_id=sid.to_bytes(8, "big"))
                    link.attributes.add(key="spanlet.weight").value.double_value = 1.0 + w
                sid += 1
        out += [engine, front]
    return out


def rows_for(reqs) -> FakeFacts:
    fake = FakeFacts()
    for req in reqs:
        for sp in req.resource_spans[0].scope_spans[0].spans:
            fake.add(sp.trace_id, int.from_bytes(sp.span_id, "big"), driver=LAUNCHES, syncs=1,
                     sync_wait_ns=SYNC_NS)
    return fake


class Bench:
    """An upstream receiver noting when each span came, and a span path exporting to it."""

    def __init__(self, *overrides: str):
        self.got, self.came = 0, {}
        self.lock = threading.Lock()
        self.up = OtlpReceiver(config.OtlpConfig(grpc_port=0, http_port=0), self._take)
        self.up.start()
        cfg = config.load(env={}, overrides=[
            "otlp.grpc_port=0", "otlp.http_port=0", "otlp.upstream_protocol=grpc",
            f"otlp.upstream_endpoint=http://127.0.0.1:{self.up.grpc_port}",
            "otlp.batch_interval_s=0.05", "otlp.batch_size=2048", "otlp.queue_size=1000000",
            "join.buffer_events=1000000", *overrides])
        self.path = SpanPath(cfg)
        self.path.start()
        self.stub = trace_service_pb2_grpc.TraceServiceStub(
            grpc.insecure_channel(f"127.0.0.1:{self.path.receiver.grpc_port}"))

    def _take(self, req, peer=None) -> int:
        now = time.perf_counter()
        n = 0
        with self.lock:
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        if sp.kind == 2:
                            self.came[sp.span_id] = now
                        n += 1
            self.got += n
        return n

    def wait_for(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.got < n and time.monotonic() < deadline:
            time.sleep(0.005)
        assert self.got == n, (self.got, n)

    def stop(self) -> None:
        self.path.stop(time.monotonic() + 5)
        self.up.stop()


def throughput(linked: bool, seconds: float) -> tuple[float, dict]:
    reqs = workload(max(1, int(seconds * 40)), linked)
    b = Bench("join.batch_wait_s=0.05")
    b.path.join.facts = rows_for(reqs)
    try:
        sent, t0 = 0, time.perf_counter()
        for req in reqs:
            b.stub.Export(req)
            sent += len(req.resource_spans[0].scope_spans[0].spans)
            if time.perf_counter() - t0 > seconds and req.resource_spans[0].scope_spans[0].spans[0].kind == 2:
                break
        b.wait_for(sent)
        elapsed = time.perf_counter() - t0
        return sent / elapsed, b.path.join.stats.as_dict()
    finally:
        b.stop()


def join_alone(linked: bool, exports: int = 40) -> float:
    """µs a span in SpanJoin.join (and release) alone, no gRPC, no export."""
    reqs = workload(exports, linked)
    j = SpanJoin(config.JoinConfig(buffer_events=1_000_000), facts=rows_for(reqs))
    n, t0 = 0, time.perf_counter()
    for req in reqs:
        held: list = []
        j.join(req.resource_spans, held)
        j.release(held)
        n += len(req.resource_spans[0].scope_spans[0].spans)
    return (time.perf_counter() - t0) / n * 1e6


def latency(linked: bool, rate: float, seconds: float) -> list[float]:
    """Send → upstream receipt of each request span, requests paced at `rate`
    front-end exports/s (8 requests each), each after its engine's export."""
    exports = max(1, int(rate * seconds))
    reqs = []
    for pair in range(exports):    # one step of 8 requests per pair
        engine, front = ExportTraceServiceRequest(), ExportTraceServiceRequest()
        base = 1 + pair * (PER_STEP + 1)
        step = engine.resource_spans.add().scope_spans.add().spans.add(
            name="engine.step", trace_id=STEP_TRACE, span_id=base.to_bytes(8, "big"), kind=1)
        fs = front.resource_spans.add().scope_spans.add()
        for i in range(1, PER_STEP + 1):
            trace = (REQ_TRACE_BASE + base + i).to_bytes(16, "big")
            fs.spans.add(name="POST /generate", trace_id=trace, span_id=(base + i).to_bytes(8, "big"),
                         kind=2)
            if linked:
                step.links.add(trace_id=trace, span_id=(base + i).to_bytes(8, "big"))
        reqs.append((engine, front))
    b = Bench()                      # the default join.batch_wait_s
    b.path.join.facts = rows_for([r for pair in reqs for r in pair])
    sent_at, n = {}, 0
    try:
        t0 = time.perf_counter()
        for k, (engine, front) in enumerate(reqs):
            due = t0 + k / rate
            if due > time.perf_counter():
                time.sleep(due - time.perf_counter())
            b.stub.Export(engine)
            now = time.perf_counter()
            b.stub.Export(front)
            for sp in front.resource_spans[0].scope_spans[0].spans:
                sent_at[sp.span_id] = now
            n += 1 + PER_STEP
        b.wait_for(n)
        return sorted(b.came[k] - t for k, t in sent_at.items())
    finally:
        b.stop()


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rate", type=float, default=50.0, help="paced front-end exports/s (latency)")
    ap.add_argument("--cpu", type=int, default=min(os.sched_getaffinity(0)))
    a = ap.parse_args()
    os.sched_setaffinity(0, {a.cpu})
    wait = config.JoinConfig().batch_wait_s
    print(f"batched steps ({PER_STEP} requests a step, {STEPS_PER_EXPORT} steps an engine export), "
          f"one process on CPU {a.cpu}, facts rows in the stand-in map:")
    plain, _ = throughput(False, a.seconds)
    steps, st = throughput(True, a.seconds)
    print(f"  plain join (no links)              : {plain:10,.0f} spans/s")
    print(f"  join with batch steps              : {steps:10,.0f} spans/s   ratio {steps / plain:.2f}; "
          f"{st['batch_steps']:,} steps, {st['batch_requests']:,} requests with shares, "
          f"{st['batch_late']} late, {st['batch_expired']} expired")
    alone = [(join_alone(False), join_alone(True)) for _ in range(3)]
    print("  the join alone (no gRPC, no export), 3 rounds: "
          + ", ".join(f"{p:.1f} vs {b:.1f}" for p, b in alone) + " µs a span (plain vs with steps)")
    lp = latency(False, a.rate, a.seconds)
    lb = latency(True, a.rate, a.seconds)
    print(f"  request span latency, send → upstream, {a.rate:g} exports/s of 8 requests "
          f"(join.batch_wait_s = {wait:g}):")
    for name, xs in (("plain join", lp), ("with batch steps", lb)):
        print(f"    {name:<32}: p50 {pct(xs, .5) * 1e3:8.1f} ms, p99 {pct(xs, .99) * 1e3:8.1f} ms, "
              f"mean {statistics.fmean(xs) * 1e3:8.1f} ms")
    print(f"  added by the wait: p50 {(pct(lb, .5) - pct(lp, .5)) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
