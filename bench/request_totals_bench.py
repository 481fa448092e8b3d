"""What the request totals (agent/request_totals.py, `kernel.request.*` on each
server span) cost the span path, per span: export requests of 64 spans in
requests of 4 (a server span and its 3 children, each with the joined facts
it would carry), side by side in one run with what the span path does to the
same resources anyway (serializing them once), with and without scheduler
facts on the spans (`sched.enabled` off: nothing to sum).

    .venv/bin/python bench/request_totals_bench.py [--rounds 7] [--requests 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

from opentelemetry.proto.trace.v1 import trace_pb2  # noqa: E402

from spanlet.request_totals import RequestTotals  # noqa: E402

SPANS_PER_REQUEST, REQUESTS_PER_EXPORT = 4, 16
SERVER, INTERNAL = trace_pb2.Span.SPAN_KIND_SERVER, trace_pb2.Span.SPAN_KIND_INTERNAL
FACTS = {"kernel.gpu.launches": 50, "kernel.gpu.syncs": 1, "kernel.gpu.sync_wait_ns": 4_000_000}
SCHED = {"kernel.sched.cpu_ns": 2_000_000, "kernel.sched.runqueue_ns": 300_000,
         "kernel.sched.blocked_ns": 9_000_000, "kernel.sched.iowait_ns": 0,
         "kernel.sched.switches": 12, "kernel.sched.preemptions": 2,
         "kernel.gpu.memcpy_h2d_bytes": 1 << 20}


def export(n: int, sched: bool) -> list[trace_pb2.ResourceSpans]:
    """One export request: one resource, REQUESTS_PER_EXPORT requests of a
    server span and its children, children first (as they end)."""
    rs = trace_pb2.ResourceSpans()
    rs.resource.attributes.add(key="service.name").value.string_value = "bench"
    ss = rs.scope_spans.add()
    ss.scope.name = "opentelemetry.instrumentation.asgi"
    for r in range(REQUESTS_PER_EXPORT):
        trace = os.urandom(16)
        root = os.urandom(8)
        for i in range(SPANS_PER_REQUEST):
            s = trace_pb2.Span(trace_id=trace, span_id=root if i == SPANS_PER_REQUEST - 1 else os.urandom(8),
                               name="POST /v1/infer" if i == SPANS_PER_REQUEST - 1 else f"step {i}",
                               start_time_unix_nano=1, end_time_unix_nano=2)
            if i == SPANS_PER_REQUEST - 1:
                s.kind = SERVER
            else:
                s.kind, s.parent_span_id = INTERNAL, root
            s.attributes.add(key="http.route").value.string_value = "/v1/infer"
            for k, v in {**FACTS, **(SCHED if sched else {})}.items():
                s.attributes.add(key=k).value.int_value = v
            ss.spans.append(s)
    return [rs]


def timed(exports, with_totals: bool) -> float:
    """ns per span."""
    totals = RequestTotals()
    spans = 0
    t0 = time.perf_counter_ns()
    for rss in exports:
        blobs = [None] * len(rss)
        if with_totals:
            totals.apply(rss, blobs)          # serializes each resource once, as the path does
        else:
            for i, rs in enumerate(rss):
                blobs[i] = rs.SerializeToString()
        spans += SPANS_PER_REQUEST * REQUESTS_PER_EXPORT
    return (time.perf_counter_ns() - t0) / spans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=2000, help="export requests a round")
    a = ap.parse_args()
    print(f"{a.rounds} rounds of {a.requests} export requests of {SPANS_PER_REQUEST * REQUESTS_PER_EXPORT} "
          f"spans ({REQUESTS_PER_EXPORT} requests of {SPANS_PER_REQUEST}), alternating; medians")
    print(f"{'spans':<24} {'serialize ns/span':>18} {'+ request totals':>18} {'added ns/span':>14} {'ratio':>6}")
    for sched in (False, True):
        base, with_totals = [], []
        for _ in range(a.rounds):
            # fresh spans each time: apply puts attributes on the server spans
            base.append(timed([export(i, sched) for i in range(a.requests)], False))
            with_totals.append(timed([export(i, sched) for i in range(a.requests)], True))
        b, w = statistics.median(base), statistics.median(with_totals)
        name = "with sched facts" if sched else "without (sched off)"
        print(f"{name:<24} {b:>18.0f} {w:>18.0f} {w - b:>14.0f} {w / b:>6.2f}")


if __name__ == "__main__":
    main()
