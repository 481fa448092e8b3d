"""Spans per second through the agent's span path on one core: OTLP gRPC in →
join with one kernel launch event per span → export to an upstream OTLP
receiver, side by side with the same spans received and passed on with no
join (the receiver + exporter alone). One process pinned to one CPU (the
sender, the agent's threads and the upstream share it), about 10 s.

Run: .venv/bin/python bench/span_path_bench.py [--seconds S] [--batch N] [--cpu K]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import grpc  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402

from spanlet import config, events  # noqa: E402
from spanlet.pipeline.spans import SpanPath  # noqa: E402
from spanlet.exporters.otlp.receiver import OtlpReceiver  # noqa: E402


def requests(batch: int, count: int) -> list[ExportTraceServiceRequest]:
    out, sid = [], 1
    trace = bytes(range(1, 17))
    for _ in range(count):
        req = ExportTraceServiceRequest()
        rs = req.resource_spans.add()
        rs.resource.attributes.add(key="service.name").value.string_value = "bench"
        ss = rs.scope_spans.add()
        for _ in range(batch):
            s = ss.spans.add(name="infer", trace_id=trace, span_id=sid.to_bytes(8, "big"), kind=2,
                             start_time_unix_nano=1, end_time_unix_nano=2)
            s.attributes.add(key="mm.modality").value.string_value = "image"
            sid += 1
        out.append(req)
    return out


def launch_event(span_id: int) -> events.GpuLaunch:
    ev = events.GpuLaunch()
    ev.hdr.kind = events.Kind.GPU_LAUNCH
    ev.hdr.span_id = span_id
    ev.hdr.trace_id[:] = list(range(1, 17))
    ev.duration_ns = 5000
    ev.entry = events.Entry.cuLaunchKernel
    return ev


def run(with_join: bool, seconds: float, batch: int) -> float:
    got = [0]
    lock = threading.Lock()

    def upstream_take(req) -> int:
        n = sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
        with lock:
            got[0] += n
        return n

    up = OtlpReceiver(config.OtlpConfig(grpc_port=0, http_port=0), upstream_take)
    up.start()
    cfg = config.load(env={}, overrides=[
        "otlp.grpc_port=0", "otlp.http_port=0", "otlp.upstream_protocol=grpc",
        f"otlp.upstream_endpoint=http://127.0.0.1:{up.grpc_port}", "otlp.batch_interval_s=0.05",
        "otlp.batch_size=2048", "join.buffer_events=1000000"])
    path = SpanPath(cfg)
    if not with_join:
        path.join.join = lambda rs: [0] * len(rs)   # receiver + exporter alone
    path.start()
    reqs = requests(batch, 400)
    if with_join:
        for req in reqs:
            for sp in req.resource_spans[0].scope_spans[0].spans:
                path.join.add_event(launch_event(int.from_bytes(sp.span_id, "big")))
    stub = trace_service_pb2_grpc.TraceServiceStub(
        grpc.insecure_channel(f"127.0.0.1:{path.receiver.grpc_port}"))
    sent, t0 = 0, time.perf_counter()
    for req in reqs:
        stub.Export(req)
        sent += batch
        if time.perf_counter() - t0 > seconds:
            break
    path.exporter.force_flush(30_000)
    elapsed = time.perf_counter() - t0
    path.stop(time.monotonic() + 5)
    up.stop()
    assert got[0] == sent, (got[0], sent)
    return sent / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--cpu", type=int, default=min(os.sched_getaffinity(0)),
                    help="the one CPU the whole run is pinned to")
    a = ap.parse_args()
    os.sched_setaffinity(0, {a.cpu})   # before any thread starts: they all inherit it
    base = run(False, a.seconds, a.batch)
    joined = run(True, a.seconds, a.batch)
    print(f"span path, batches of {a.batch}, one process on CPU {a.cpu} alone:")
    print(f"  receive + export, no join : {base:10,.0f} spans/s")
    print(f"  receive + join + export   : {joined:10,.0f} spans/s   ratio {joined / base:.2f}")
    print("goal: >= 50,000 spans/s received + joined + exported on one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
