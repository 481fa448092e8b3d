"""Spans per second through the agent's span path on one core: OTLP gRPC in →
join (each span takes its kernel facts row: 50 launches and a sync) → export
to an upstream OTLP receiver, side by side with the same spans received and
passed on with no join, and with a sampled launch record per span on top.
The rows are in the real span facts map (the span_ctx program loaded, rows
written before the run) when run as root, else in the tests' stand-in map
(facts_fakes.FakeFacts). One process pinned to one CPU (the sender, the
agent's threads and the upstream share it), about 15 s.

Run: [sudo] .venv/bin/python bench/span_path_bench.py [--seconds S] [--batch N] [--cpu K] [--facts kernel|fake]
"""

from __future__ import annotations

import argparse
import os
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


REQUESTS = 400
LAUNCHES, SYNC_NS = 50, 20_000


def kernel_facts(cfg, reqs):
    """The span_ctx program's span facts map with a row for every span of `reqs`
    (written as the GPU program would); its reader and a stop function."""
    from spanlet.probes.span_ctx import SpanCtxProbe

    probe = SpanCtxProbe(cfg)
    if not probe.start().attached:
        raise SystemExit(f"span_ctx did not attach: {probe.status.reason}")
    for req in reqs:
        for sp in req.resource_spans[0].scope_spans[0].spans:
            probe.facts.put_row(sp.trace_id, int.from_bytes(sp.span_id, "big"),
                                launches_driver=LAUNCHES, syncs=1, sync_wait_ns=SYNC_NS, pid=1)
    return probe.facts, probe.stop


def fake_facts(cfg, reqs):
    fake = FakeFacts()
    for req in reqs:
        for sp in req.resource_spans[0].scope_spans[0].spans:
            fake.add(sp.trace_id, int.from_bytes(sp.span_id, "big"), driver=LAUNCHES, syncs=1,
                     sync_wait_ns=SYNC_NS)
    return fake, lambda: None


def run(mode: str, facts_kind: str, seconds: float, batch: int) -> tuple[float, int]:
    """Spans/s and spans joined to their row; mode: "none" (receiver + exporter
    alone), "facts" (each span takes its row) or "facts+event" (and one sampled record)."""
    got = [0]
    lock = threading.Lock()

    def upstream_take(req, peer=None) -> int:
        n = sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
        with lock:
            got[0] += n
        return n

    up = OtlpReceiver(config.OtlpConfig(grpc_port=0, http_port=0), upstream_take)
    up.start()
    cfg = config.load(env={}, overrides=[
        "otlp.grpc_port=0", "otlp.http_port=0", "otlp.upstream_protocol=grpc",
        f"otlp.upstream_endpoint=http://127.0.0.1:{up.grpc_port}", "otlp.batch_interval_s=0.05",
        "otlp.batch_size=2048", "join.buffer_events=1000000",
        f"join.span_facts_max={1 << (REQUESTS * batch - 1).bit_length()}"])
    path = SpanPath(cfg)
    reqs = requests(batch, REQUESTS)
    stop_facts = lambda: None  # noqa: E731
    if mode == "none":
        path.join.join = lambda rs, held=None, **kw: [0] * len(rs)   # receiver + exporter alone
    else:
        path.join.facts, stop_facts = (kernel_facts if facts_kind == "kernel" else fake_facts)(cfg, reqs)
    try:
        if mode == "facts+event":
            for req in reqs:
                for sp in req.resource_spans[0].scope_spans[0].spans:
                    path.join.add_event(launch_event(int.from_bytes(sp.span_id, "big")))
        path.start()
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
        joined = path.join.stats.rows_taken
    finally:
        stop_facts()   # its pinned maps go with it
    assert got[0] == sent, (got[0], sent)
    return sent / elapsed, joined, sent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--cpu", type=int, default=min(os.sched_getaffinity(0)),
                    help="the one CPU the whole run is pinned to")
    ap.add_argument("--facts", choices=["kernel", "fake"], default="kernel" if os.geteuid() == 0 else "fake")
    a = ap.parse_args()
    os.sched_setaffinity(0, {a.cpu})   # before any thread starts: they all inherit it
    rows = {mode: run(mode, a.facts, a.seconds, a.batch) for mode in ("none", "facts", "facts+event")}
    base = rows["none"][0]
    print(f"span path, batches of {a.batch}, one process on CPU {a.cpu} alone, "
          f"facts rows in the {'real span facts map' if a.facts == 'kernel' else 'stand-in map'}:")
    labels = {"none": "receive + export, no join", "facts": "receive + join (facts row) + export",
              "facts+event": "  the same + 1 sampled record"}
    for mode, (rate, joined, sent) in rows.items():
        extra = f"   ratio {rate / base:.2f}, {joined:,} of {sent:,} spans took their row" \
            if mode != "none" else ""
        print(f"  {labels[mode]:<38}: {rate:10,.0f} spans/s{extra}")
    print("goal: >= 50,000 spans/s received + joined + exported on one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
