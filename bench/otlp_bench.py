"""Spans per second the OTLP receiver takes over gRPC (batches of 512, no-op
callback), side by side with a bare gRPC server that returns without parsing,
and the receiver over HTTP/protobuf; one process, about 10 s in all.

Run: .venv/bin/python bench/otlp_bench.py [--seconds S] [--batch N] [--inflight K]
"""

from __future__ import annotations

import argparse
import http.client
import random
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import grpc  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402

from spanlet.config import OtlpConfig  # noqa: E402
from spanlet.exporters.otlp.common import TRACES_GRPC_METHOD, TRACES_GRPC_SERVICE  # noqa: E402
from spanlet.exporters.otlp.receiver import GRPC_WORKERS, OtlpReceiver  # noqa: E402

OPTIONS = [("grpc.enable_http_proxy", 0)]


def payload(batch: int) -> bytes:
    """One request of `batch` spans shaped like a serving process's: a few
    attributes each, ids random."""
    rnd = random.Random(0)
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = "bench"
    ss = rs.scope_spans.add()
    ss.scope.name = "bench"
    for i in range(batch):
        s = ss.spans.add(name="infer", trace_id=rnd.randbytes(16), span_id=rnd.randbytes(8),
                         parent_span_id=rnd.randbytes(8), kind=2,
                         start_time_unix_nano=1_700_000_000_000_000_000 + i,
                         end_time_unix_nano=1_700_000_000_010_000_000 + i)
        s.attributes.add(key="gen_ai.request.model").value.string_value = "llama-3-70b"
        s.attributes.add(key="modality").value.string_value = "image"
        s.attributes.add(key="tokens").value.int_value = i
    return req.SerializeToString()


def grpc_rate(port: int, body: bytes, spans: int, seconds: float, inflight: int) -> float:
    """Spans/s with `inflight` calls kept outstanding for `seconds`."""
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as ch:
        call = ch.unary_unary(TRACES_GRPC_METHOD)
        call(body, timeout=10)                                   # connect, warm up
        done = 0
        t0 = time.perf_counter()
        pending = [call.future(body, timeout=30) for _ in range(inflight)]
        while time.perf_counter() - t0 < seconds:
            fut = pending.pop(0)
            fut.result()
            done += 1
            pending.append(call.future(body, timeout=30))
        for fut in pending:
            fut.result()
            done += 1
        return done * spans / (time.perf_counter() - t0)


def http_rate(port: int, body: bytes, spans: int, seconds: float, clients: int) -> float:
    counts = [0] * clients
    t0 = time.perf_counter()

    def client(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        hdrs = {"Content-Type": "application/x-protobuf"}
        while time.perf_counter() - t0 < seconds:
            conn.request("POST", "/v1/traces", body=body, headers=hdrs)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200, resp.status
            counts[k] += 1
        conn.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) * spans / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="per measurement (3 of them)")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--inflight", type=int, default=8)
    args = ap.parse_args()
    body = payload(args.batch)

    bare = grpc.server(futures.ThreadPoolExecutor(max_workers=GRPC_WORKERS))
    bare.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(TRACES_GRPC_SERVICE, {
        "Export": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"")}),))
    bare_port = bare.add_insecure_port("127.0.0.1:0")
    bare.start()
    try:
        base = grpc_rate(bare_port, body, args.batch, args.seconds, args.inflight)
    finally:
        bare.stop(0)

    received = [0]
    lock = threading.Lock()

    def on_request(req, peer=None) -> None:      # no-op but for a count, like a callback that queues
        n = sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
        with lock:
            received[0] += n
        return n

    r = OtlpReceiver(OtlpConfig(grpc_port=0, http_port=0, max_message_bytes=64 * 1024 * 1024), on_request)
    r.start()
    try:
        rx = grpc_rate(r.grpc_port, body, args.batch, args.seconds, args.inflight)
        rx_http = http_rate(r.http_port, body, args.batch, args.seconds, clients=args.inflight // 2 or 1)
    finally:
        r.stop(0)
    assert r.stats()["spans_rejected"] == {}

    print(f"batch {args.batch} spans ({len(body)} bytes), {args.inflight} calls in flight, one process")
    print(f"{'server':<40}{'spans/s':>12}{'ratio':>8}")
    print(f"{'bare gRPC, no parsing':<40}{base:>12,.0f}{1.0:>8.2f}")
    print(f"{'OtlpReceiver gRPC (parse+validate)':<40}{rx:>12,.0f}{rx / base:>8.2f}")
    print(f"{'OtlpReceiver HTTP/protobuf':<40}{rx_http:>12,.0f}{rx_http / base:>8.2f}")
    print(f"spans passed to the callback: {received[0]:,}")


if __name__ == "__main__":
    main()
