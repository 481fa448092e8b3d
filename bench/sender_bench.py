"""What establishing each request's sender costs: OTLP/HTTP requests of a few
spans to a real receiver on one keep-alive connection, the callback a no-op
or the span path's SenderOrigins.origin() over the real span_ctx probe's
sock_owner map, alternating rounds side by side; and origin() alone.
Needs root (loads the span_ctx program).

Run: .venv/bin/python bench/sender_bench.py [--requests N] [--rounds R] [--spans S]
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402

from spanlet import config  # noqa: E402
from spanlet.cgroups import CgroupIndex  # noqa: E402
from spanlet.exporters.otlp.receiver import OtlpReceiver  # noqa: E402
from spanlet.pipeline.senders import SenderOrigins  # noqa: E402
from spanlet.probes.span_ctx import SpanCtxProbe  # noqa: E402


def payload(spans: int) -> bytes:
    req = ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for i in range(spans):
        s = ss.spans.add(name=f"span-{i}", trace_id=bytes(range(1, 17)),
                         span_id=(i + 1).to_bytes(8, "big"))
        s.attributes.add(key="http.route").value.string_value = "/generate"
    return req.SerializeToString()


def round_us(port: int, body: bytes, n: int) -> float:
    """Mean µs a request over one fresh keep-alive connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": "application/x-protobuf"}
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            conn.request("POST", "/v1/traces", body=body, headers=headers)
            r = conn.getresponse()
            r.read()
            assert r.status == 200, r.status
        return (time.perf_counter() - t0) / n * 1e6
    finally:
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--spans", type=int, default=8)
    args = ap.parse_args()
    cfg = config.load(env={}, overrides=["otlp.grpc_port=0", "otlp.http_port=0"])
    probe = SpanCtxProbe(cfg)
    st = probe.start()
    if not st.attached:
        sys.exit(f"span_ctx not attached: {st.reason}")
    senders = SenderOrigins(CgroupIndex(), None, probe.sock_owner)
    mode = {"origin": False}
    found = []

    peers = []

    def on_request(request, peer=None) -> None:
        if mode["origin"]:
            found.append(senders.origin(peer) is not None)
            peers[:] = [peer]

    rx = OtlpReceiver(cfg.otlp, on_request)
    rx.start()
    probe.watch_ports([rx.http_port])
    body = payload(args.spans)
    try:
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for with_origin in (False, True):
                mode["origin"] = with_origin
                times[with_origin].append(round_us(rx.http_port, body, args.requests))
        assert found and all(found), "a request whose sender the kernel did not name"
        plain, origin = (statistics.median(times[k]) for k in (False, True))
        print(f"OTLP/HTTP, {args.spans} spans a request, median of {args.rounds} rounds "
              f"of {args.requests}:")
        print(f"  no-op callback              {plain:8.1f} us/request")
        print(f"  + sender from the socket    {origin:8.1f} us/request  "
              f"(ratio {origin / plain:.3f})")
        n = 20000
        t0 = time.perf_counter()
        for _ in range(n):
            senders.origin(peers[0])
        print(f"  origin() alone, one thread  {(time.perf_counter() - t0) / n * 1e6:8.1f} us/call")
    finally:
        rx.stop(0)
        probe.stop()


if __name__ == "__main__":
    main()
