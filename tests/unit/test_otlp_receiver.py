"""OTLP receiver: real OTel SDK exporters in a child process deliver exactly
their spans; malformed, oversized and hostile payloads get the protocol's
error without hurting the receiver; bad span ids come back as partial success."""

from __future__ import annotations

import gc
import gzip
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

from receivers import receivers

from spanlet.config import OtlpConfig
from spanlet.exporters.otlp.common import TRACES_GRPC_METHOD
from spanlet.exporters.otlp.receiver import Backpressure, OtlpReceiver

# gRPC channels in tests go straight to loopback, whatever proxy the
# environment names.
CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]


class Recorder:
    """on_request callback: keeps every request; accepts `accept` spans of
    each (all by default), or raises what `raise_` holds."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[ExportTraceServiceRequest] = []
        self.accept: int | None = None
        self.raise_: Exception | None = None
        self.peers: list = []

    def __call__(self, request: ExportTraceServiceRequest, peer=None) -> int:
        if self.raise_ is not None:
            raise self.raise_
        with self.lock:
            self.requests.append(request)
            self.peers.append(peer)
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        return n if self.accept is None else self.accept

    def spans(self) -> list:
        with self.lock:
            return [s for r in self.requests for rs in r.resource_spans
                    for ss in rs.scope_spans for s in ss.spans]


@pytest.fixture
def started():
    """started(**cfg) -> (receiver, recorder) on free loopback ports; stopped after."""
    with receivers() as make:
        def start(**kw):
            rec = Recorder()
            return make(rec, **kw), rec
        yield start


@pytest.fixture
def channels():
    made = []

    def make(port):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
        made.append(ch)
        return ch

    try:
        yield make
    finally:
        for ch in made:
            ch.close()


def raw_export(channel):
    """Export with raw bytes in and out (identity serializers)."""
    return channel.unary_unary(TRACES_GRPC_METHOD)


def make_request(n_spans: int = 3, seed: int = 1, service: str = "svc") -> ExportTraceServiceRequest:
    """A request with one resource_spans (so it is a single top-level field)."""
    rnd = random.Random(seed)
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = service
    ss = rs.scope_spans.add()
    ss.scope.name = "test.scope"
    for i in range(n_spans):
        span = ss.spans.add(name=f"span-{i}", trace_id=rnd.randbytes(16), span_id=rnd.randbytes(8),
                            start_time_unix_nano=1_700_000_000_000_000_000 + i,
                            end_time_unix_nano=1_700_000_000_000_100_000 + i)
        span.attributes.add(key="i").value.int_value = i
        span.attributes.add(key="modality").value.string_value = "audio"
    return req


def post(port: int, body: bytes, *, path: str = "/v1/traces", method: str = "POST",
         headers: dict | None = None, conn: http.client.HTTPConnection | None = None):
    """One HTTP request; returns (status, headers, body)."""
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        hdrs = {"Content-Type": "application/x-protobuf"}
        hdrs.update(headers or {})
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()
    finally:
        if own:
            conn.close()


def status_of(body: bytes) -> status_pb2.Status:
    return status_pb2.Status.FromString(body)


def vmrss_kib() -> int:
    gc.collect()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


# ---------------------------------------------------------------------------
# (a) the OTel SDK's own exporters, in a child process

CHILD = textwrap.dedent("""
    import json, sys
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol, endpoint, compression = sys.argv[1:4]
    if protocol == "grpc":
        from grpc import Compression
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True,
                                    compression=getattr(Compression, compression))
    else:
        from opentelemetry.exporter.otlp.proto.http import Compression
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter(endpoint=endpoint, compression=getattr(Compression, compression))
    provider = TracerProvider(resource=Resource.create({"service.name": "otlp-child"}))
    provider.add_span_processor(BatchSpanProcessor(exporter, max_export_batch_size=50))
    tracer = provider.get_tracer("spanlet.test.child")
    out = []
    def record(span, parent):
        ctx = span.get_span_context()
        out.append({"name": span.name, "trace_id": format(ctx.trace_id, "032x"),
                    "span_id": format(ctx.span_id, "016x"),
                    "parent": format(parent, "016x") if parent else "",
                    "attributes": dict(span.attributes)})
    for i in range(120):
        attrs = {"i": i, "modality": "image", "ratio": i / 4, "even": i % 2 == 0,
                 "tags": ["a", str(i)]}
        with tracer.start_as_current_span(f"infer-{i}", attributes=attrs) as parent:
            with tracer.start_as_current_span(f"decode-{i}") as child:
                child.set_attribute("tokens", i * 3)
        record(parent, 0)
        record(child, parent.get_span_context().span_id)
    ok = provider.force_flush(30000)
    provider.shutdown()
    print(json.dumps({"flushed": ok, "spans": [dict(s, attributes={k: list(v) if isinstance(v, tuple)
                                                                     else v for k, v in s["attributes"].items()})
                                               for s in out]}))
""")


def any_value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("OTEL_") and "proxy" not in k.lower()}
    env["NO_PROXY"] = env["no_proxy"] = "*"
    return env


@pytest.mark.parametrize("protocol,compression", [("grpc", "NoCompression"), ("grpc", "Gzip"),
                                                  ("http", "NoCompression"), ("http", "Gzip")])
def test_otel_sdk_child_process_spans_arrive_exactly(started, protocol, compression):
    r, rec = started()
    endpoint = (f"127.0.0.1:{r.grpc_port}" if protocol == "grpc"
                else f"http://127.0.0.1:{r.http_port}/v1/traces")
    out = subprocess.run([sys.executable, "-c", CHILD, protocol, endpoint, compression],
                         capture_output=True, text=True, timeout=90, env=child_env())
    assert out.returncode == 0, out.stderr[-3000:]
    sent = json.loads(out.stdout)
    assert sent["flushed"] is True
    expected = {s["span_id"]: s for s in sent["spans"]}
    assert len(expected) == 240

    got = {}
    for req in rec.requests:
        for rs in req.resource_spans:
            service = {a.key: any_value(a.value) for a in rs.resource.attributes}["service.name"]
            assert service == "otlp-child"
            for ss in rs.scope_spans:
                assert ss.scope.name == "spanlet.test.child"
                for s in ss.spans:
                    key = s.span_id.hex()
                    assert key not in got, "span delivered twice"
                    got[key] = {"name": s.name, "trace_id": s.trace_id.hex(), "span_id": key,
                                "parent": s.parent_span_id.hex(),
                                "attributes": {a.key: any_value(a.value) for a in s.attributes}}
    assert got == expected
    transport = "grpc" if protocol == "grpc" else "http"
    st = r.stats()
    assert st["spans_accepted"] == 240
    assert st["spans_rejected"] == {}
    assert st["requests"][transport] == {"ok": len(rec.requests)}
    assert len(rec.requests) >= 240 // 50


# ---------------------------------------------------------------------------
# (b) hostile input

MAX_BYTES = 64 * 1024
RSS_BOUND_KIB = 10 * 1024


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field_len(num: int, payload: bytes) -> bytes:
    return varint(num << 3 | 2) + varint(len(payload)) + payload


def request_of_size(size: int) -> bytes:
    """A valid request of exactly `size` bytes."""
    req = make_request(1)
    span = req.resource_spans[0].scope_spans[0].spans[0]
    span.name = ""
    pad = size - req.ByteSize()
    for _ in range(10):
        span.name = "x" * pad
        if req.ByteSize() == size:
            break
        pad += size - req.ByteSize()
    data = req.SerializeToString()
    assert len(data) == size
    return data


def nested_kvlist_request(depth: int) -> bytes:
    """A request whose one span attribute is a kvlist in a kvlist ... `depth`
    deep, encoded by hand (the protobuf library refuses to build it)."""
    value = field_len(1, b"leaf")                       # AnyValue.string_value
    for _ in range(depth):
        kv = field_len(1, b"k") + field_len(2, value)   # KeyValue{key, value}
        value = field_len(6, field_len(1, kv))          # AnyValue.kvlist_value{values}
    attribute = field_len(1, b"deep") + field_len(2, value)
    span = field_len(1, bytes(range(1, 17))) + field_len(2, bytes(range(1, 9))) + field_len(9, attribute)
    return field_len(1, field_len(2, field_len(2, span)))   # request{rs{scope_spans{spans}}}


def hostile_payloads(n: int, seed: int) -> list[tuple[bytes, bool]]:
    """(payload, must_be_rejected). Most are malformed by construction; the
    bit-flipped ones are checked against the protobuf parser itself."""
    rnd = random.Random(seed)
    valid = make_request(12, seed=seed).SerializeToString()
    out = []
    for i in range(n):
        kind = i % 5
        if kind == 0:       # every proper prefix of a one-field message is malformed
            out.append((valid[:rnd.randrange(1, len(valid))], True))
        elif kind == 1:     # a length-delimited field claiming more than is there
            rest = rnd.randbytes(rnd.randrange(0, 32_000))
            out.append((b"\x0a" + varint(len(rest) + rnd.randrange(1, 10_000)) + rest, True))
        elif kind == 2:     # wire types 6 and 7 do not exist
            tag = rnd.randrange(1, 15) << 3 | rnd.choice((6, 7))
            out.append((bytes([tag]) + rnd.randbytes(rnd.randrange(0, 32_000)), True))
        elif kind == 3:     # field number 0 is invalid
            out.append((b"\x00" + rnd.randbytes(rnd.randrange(0, 32_000)), True))
        else:               # a few flipped bytes: valid or not, the parser decides
            data = bytearray(valid)
            for _ in range(rnd.randrange(1, 4)):
                data[rnd.randrange(len(data))] ^= 1 << rnd.randrange(8)
            try:
                ExportTraceServiceRequest.FromString(bytes(data))
                bad = False
            except Exception:
                bad = True
            out.append((bytes(data), bad))
    return out


def valid_spans_in(payload: bytes) -> int:
    req = ExportTraceServiceRequest.FromString(payload)
    return sum(1 for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans
               if len(s.trace_id) == 16 and any(s.trace_id) and len(s.span_id) == 8
               and any(s.span_id) and len(s.parent_span_id) in (0, 8))


def grpc_round(export, payloads) -> dict:
    seen = {"invalid": 0, "ok": 0, "spans": 0}
    for payload, bad in payloads:
        try:
            answer = export(payload, timeout=10)
        except grpc.RpcError as e:
            assert bad, f"valid payload refused: {e.code()} {e.details()}"
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
            seen["invalid"] += 1
        else:
            assert not bad, f"malformed payload accepted: {payload[:40]!r}"
            ExportTraceServiceResponse.FromString(answer)
            seen["ok"] += 1
            seen["spans"] += valid_spans_in(payload)
    return seen


def http_round(port, payloads) -> dict:
    seen = {"invalid": 0, "ok": 0, "spans": 0}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        for payload, bad in payloads:
            status, _, body = post(port, payload, conn=conn)
            if bad:
                assert status == 400, status
                assert status_of(body).code == 3        # INVALID_ARGUMENT
                assert status_of(body).message
                seen["invalid"] += 1
            else:
                assert status == 200, (status, body)
                ExportTraceServiceResponse.FromString(body)
                seen["ok"] += 1
                seen["spans"] += valid_spans_in(payload)
    finally:
        conn.close()
    return seen


def assert_still_serves(r, rec, channel, seed) -> None:
    before = len(rec.spans())
    req = make_request(2, seed=seed)
    assert TraceServiceStub(channel).Export(req, timeout=10) == ExportTraceServiceResponse()
    status, _, body = post(r.http_port, req.SerializeToString())
    assert (status, body) == (200, b"")
    assert len(rec.spans()) == before + 4


def test_grpc_poll_thread_is_named_in_python_and_the_kernel(started, channels):
    before = set(threading.enumerate())
    rx, rec = started()
    new = set(threading.enumerate()) - before
    serving = [t for t in new if t.name == "otlp-grpc-serve"]
    assert len(serving) == 1 and serving[0].is_alive()
    assert not [t.name for t in new if t.name.endswith("(_serve)")]
    comm = Path(f"/proc/self/task/{serving[0].native_id}/comm").read_text().strip()
    assert comm == "otlp-grpc-serve"
    raw_export(channels(rx.grpc_port))(make_request(2).SerializeToString())   # and it still serves
    assert len(rec.spans()) == 2


def test_random_and_truncated_payloads_get_invalid_argument_and_memory_stays_flat(started, channels):
    r, rec = started(max_message_bytes=MAX_BYTES)
    ch = channels(r.grpc_port)
    export = raw_export(ch)
    # Warm up caches, thread pools and arenas before the baseline.
    warm_g = grpc_round(export, hostile_payloads(100, seed=7))
    warm_h = http_round(r.http_port, hostile_payloads(100, seed=8))
    assert_still_serves(r, rec, ch, seed=9)
    accepted_before = r.stats()["spans_accepted"]
    # Made before the baseline and kept: the test's own memory is not measured.
    for_grpc, for_http = hostile_payloads(1000, seed=1), hostile_payloads(1000, seed=2)
    rss_before = vmrss_kib()

    g = grpc_round(export, for_grpc)
    h = http_round(r.http_port, for_http)
    assert g["invalid"] >= 800 and h["invalid"] >= 800   # 4 kinds of 5 are malformed by construction
    assert_still_serves(r, rec, ch, seed=10)

    rss_growth_kib = vmrss_kib() - rss_before
    # 2,000 requests of 16 KiB on average (~31 MiB): keeping any of them would show.
    assert rss_growth_kib < RSS_BOUND_KIB, f"RSS grew {rss_growth_kib} KiB"
    st = r.stats()
    assert st["requests"]["grpc"]["invalid"] == warm_g["invalid"] + g["invalid"]
    assert st["requests"]["http"]["invalid"] == warm_h["invalid"] + h["invalid"]
    # The well-formed ones passed on exactly their spans with good ids.
    assert st["spans_accepted"] - accepted_before == g["spans"] + h["spans"] + 4


def test_oversized_nested_and_wrong_requests_get_the_protocol_error(started, channels):
    r, rec = started(max_message_bytes=MAX_BYTES)
    ch = channels(r.grpc_port)
    export = raw_export(ch)
    port = r.http_port

    for payload in (bytes(MAX_BYTES + 1), request_of_size(MAX_BYTES + 1)):
        with pytest.raises(grpc.RpcError) as e:
            export(payload, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status, headers, body = post(port, payload)
        assert status == 413 and status_of(body).code == 8 and headers["Connection"] == "close"

    # Decompressed size counts: a small gzip body that inflates past the limit.
    bomb = gzip.compress(bytes(MAX_BYTES * 16))
    assert len(bomb) < MAX_BYTES
    status, _, body = post(port, bomb, headers={"Content-Encoding": "gzip"})
    assert status == 413 and status_of(body).code == 8
    # Chunked bodies are bounded the same way.
    status, _, body = post(port, iter([bytes(MAX_BYTES // 2)] * 3))
    assert status == 413

    deep = nested_kvlist_request(200)
    assert len(deep) < MAX_BYTES
    with pytest.raises(grpc.RpcError) as e:
        export(deep, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status, _, body = post(port, deep)
    assert status == 400 and status_of(body).code == 3
    status, _, body = post(port, gzip.compress(deep), headers={"Content-Encoding": "gzip"})
    assert status == 400
    # A shallow nesting is an ordinary request.
    assert export(nested_kvlist_request(10), timeout=10) == b""

    for body_, headers_ in ((b"not gzip at all", {"Content-Encoding": "gzip"}),
                            (gzip.compress(b"x" * 100)[:-9], {"Content-Encoding": "gzip"})):
        status, _, body = post(port, body_, headers=headers_)
        assert status == 400, body
    status, _, body = post(port, b"", headers={"Content-Encoding": "br"})
    assert status == 415
    status, _, body = post(port, b"{}", headers={"Content-Type": "application/json"})
    assert status == 415 and status_of(body).message
    status, _, body = post(port, b"", path="/v1/metrics")
    assert status == 404
    status, headers, body = post(port, b"", method="GET")
    assert status == 405 and headers["Allow"] == "POST"
    status, _, _ = post(port, b"", method="PUT")
    assert status == 405

    # A POST without a length, then raw garbage on the HTTP socket.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/x-protobuf\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 411 ")
    rnd = random.Random(4)
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(rnd.randbytes(rnd.randrange(1, 3000)) + b"\r\n\r\n")
            s.shutdown(socket.SHUT_WR)
            while s.recv(4096):      # whatever the answer, the server ends the connection
                pass

    # A valid chunked request is fine.
    status, _, body = post(port, iter([make_request(3).SerializeToString()]))
    assert (status, body) == (200, b"")

    assert_still_serves(r, rec, ch, seed=3)
    st = r.stats()["requests"]["http"]
    assert st["too_large"] == 4 and st["unsupported_media_type"] == 2
    assert st["not_found"] == 1 and st["method_not_allowed"] == 2 and st["length_required"] == 1


# ---------------------------------------------------------------------------
# (c) span ids checked one by one

def request_with_bad_ids() -> tuple[ExportTraceServiceRequest, set[bytes]]:
    rnd = random.Random(5)
    req = ExportTraceServiceRequest()
    good: set[bytes] = set()

    def add(ss, trace_id, span_id, parent=b""):
        ss.spans.add(name="s", trace_id=trace_id, span_id=span_id, parent_span_id=parent)
        if len(trace_id) == 16 and any(trace_id) and len(span_id) == 8 and any(span_id) \
                and len(parent) in (0, 8):
            good.add(span_id)

    a = req.resource_spans.add().scope_spans.add()
    a.scope.name = "a"
    for _ in range(3):
        add(a, rnd.randbytes(16), rnd.randbytes(8))
    add(a, b"", rnd.randbytes(8))                               # trace_id missing
    add(a, rnd.randbytes(16), bytes(8))                         # span_id all zero
    b = req.resource_spans.add().scope_spans.add()
    b.scope.name = "b"
    add(b, rnd.randbytes(16), rnd.randbytes(8), rnd.randbytes(8))
    add(b, rnd.randbytes(16), rnd.randbytes(8))
    add(b, rnd.randbytes(15), rnd.randbytes(8))                 # trace_id 15 bytes
    add(b, rnd.randbytes(16), rnd.randbytes(9))                 # span_id 9 bytes
    add(b, rnd.randbytes(16), rnd.randbytes(8), rnd.randbytes(4))   # parent 4 bytes
    c = req.resource_spans.add().scope_spans.add()
    c.scope.name = "c"
    add(c, bytes(16), rnd.randbytes(8))                         # trace_id all zero
    add(c, rnd.randbytes(16), b"")                              # span_id missing
    assert len(good) == 5
    return req, good


EXPECTED_REASONS = {"trace_id_missing": 2, "span_id_missing": 2, "trace_id_length": 1,
                    "span_id_length": 1, "parent_span_id_length": 1}


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_spans_with_bad_ids_are_rejected_in_partial_success(started, channels, transport):
    r, rec = started()
    req, good = request_with_bad_ids()
    if transport == "grpc":
        resp = TraceServiceStub(channels(r.grpc_port)).Export(req, timeout=10)
    else:
        status, _, body = post(r.http_port, req.SerializeToString())
        assert status == 200
        resp = ExportTraceServiceResponse.FromString(body)
    assert resp.partial_success.rejected_spans == 7
    assert "2 spans without trace_id" in resp.partial_success.error_message
    assert "1 span with a parent_span_id that is not 8 bytes" in resp.partial_success.error_message
    (got,) = rec.requests
    assert {s.span_id for s in rec.spans()} == good
    # The resource left with no valid span is gone; the scopes are kept.
    assert [rs.scope_spans[0].scope.name for rs in got.resource_spans] == ["a", "b"]
    st = r.stats()
    assert st["spans_rejected"] == EXPECTED_REASONS
    assert st["spans_accepted"] == 5
    assert st["requests"][transport] == {"partial": 1}


def test_spans_the_callback_does_not_take_are_reported_rejected(started, channels):
    r, rec = started()
    rec.accept = 2
    resp = TraceServiceStub(channels(r.grpc_port)).Export(make_request(5), timeout=10)
    assert resp.partial_success.rejected_spans == 3
    assert "not accepted" in resp.partial_success.error_message
    req, _ = request_with_bad_ids()
    status, _, body = post(r.http_port, req.SerializeToString())
    assert ExportTraceServiceResponse.FromString(body).partial_success.rejected_spans == 7 + 3
    st = r.stats()
    assert st["spans_accepted"] == 4
    assert st["spans_rejected"] == dict(EXPECTED_REASONS, not_accepted=6)


def test_a_request_without_valid_spans_is_a_success_without_callback(started, channels):
    r, rec = started()
    empty = ExportTraceServiceRequest()
    assert TraceServiceStub(channels(r.grpc_port)).Export(empty, timeout=10) == ExportTraceServiceResponse()
    assert post(r.http_port, b"")[0] == 200
    assert rec.requests == []


def test_backpressure_and_callback_errors(started, channels):
    r, rec = started()
    stub = TraceServiceStub(channels(r.grpc_port))
    rec.raise_ = Backpressure("queue full", retry_after_s=2.5)
    with pytest.raises(grpc.RpcError) as e:
        stub.Export(make_request(1), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    details = dict(e.value.trailing_metadata())["grpc-status-details-bin"]
    info = error_details_pb2.RetryInfo()
    status_pb2.Status.FromString(details).details[0].Unpack(info)
    assert info.retry_delay.ToNanoseconds() == 2_500_000_000
    status, headers, body = post(r.http_port, make_request(1).SerializeToString())
    assert status == 503 and headers["Retry-After"] == "3"

    rec.raise_ = RuntimeError("bug in the pipeline")
    with pytest.raises(grpc.RpcError) as e:
        stub.Export(make_request(1), timeout=10)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert post(r.http_port, make_request(1).SerializeToString())[0] == 500

    rec.raise_ = None
    assert stub.Export(make_request(1), timeout=10) == ExportTraceServiceResponse()
    st = r.stats()["requests"]
    assert st["grpc"] == {"busy": 1, "error": 1, "ok": 1}
    assert st["http"] == {"busy": 1, "error": 1}


# ---------------------------------------------------------------------------
# (d) request framing: what RFC 9112 refuses is answered, the connection
# closed, and a request sent after it on that connection never processed

HEAD = b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"


def valid_http(seed: int = 11) -> bytes:
    """A whole, valid request of 2 spans."""
    body = make_request(2, seed=seed).SerializeToString()
    return HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body


# Each is followed, in the same write, by valid_http(): a parser that reads
# the framing another way (a lenient one, or a proxy in front) would take
# that for a second request.
SMUGGLED = valid_http()
HOSTILE_FRAMING = {
    "two_content_lengths": (HEAD + b"Content-Length: 0\r\nContent-Length: %d\r\n\r\n" % len(SMUGGLED),
                            400),
    "content_length_and_chunked": (HEAD + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n"
                                   % (len(SMUGGLED) + 5) + b"0\r\n\r\n", 400),
    "unknown_coding": (HEAD + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501),
    "vertical_tab_before_chunked": (HEAD + b"Transfer-Encoding: \x0bchunked\r\n\r\n0\r\n\r\n", 400),
    "nul_after_chunked": (HEAD + b"Transfer-Encoding: chunked\x00\r\n\r\n0\r\n\r\n", 400),
    "space_before_colon": (HEAD + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n", 400),
    "folded_transfer_encoding": (HEAD + b"Transfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n", 400),
    "folded_line_after_length": (HEAD + b"Content-Length: 0\r\nX-Pad: a\r\n\tTransfer-Encoding: chunked"
                                 b"\r\n\r\n", 400),
    "chunk_size_not_hex": (HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    "chunk_size_negative": (HEAD + b"Transfer-Encoding: chunked\r\n\r\n-1\r\n", 400),
    "chunk_size_plus_sign": (HEAD + b"Transfer-Encoding: chunked\r\n\r\n+0\r\n\r\n", 400),
    "chunk_size_0x_prefix": (HEAD + b"Transfer-Encoding: chunked\r\n\r\n0x0\r\n\r\n", 400),
    "chunk_size_21_digits": (HEAD + b"Transfer-Encoding: chunked\r\n\r\n1" + b"0" * 20 + b"\r\n", 400),
    "chunk_without_crlf": (HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n", 400),
}


def exchange(port: int, data: bytes) -> tuple[list[tuple[int, dict, bytes]], bool]:
    """Send `data` in one write and read the answers until the receiver
    closes the connection, or for 5 s; returns (status, headers, body) of
    each, and whether the receiver closed."""
    raw = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        try:
            while chunk := s.recv(65536):
                raw += chunk
            closed = True
        except TimeoutError:
            closed = False
    answers = []
    while raw:
        head, sep, raw = raw.partition(b"\r\n\r\n")
        assert sep, f"an answer cut short: {head[:200]!r}"
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        length = int(headers["content-length"])
        answers.append((int(lines[0].split(" ")[1]), headers, raw[:length]))
        raw = raw[length:]
    return answers, closed


@pytest.mark.parametrize("case", sorted(HOSTILE_FRAMING))
def test_hostile_framing_is_refused_and_nothing_after_it_processed(started, case):
    r, rec = started()
    request, expected_status = HOSTILE_FRAMING[case]
    answers, closed = exchange(r.http_port, request + SMUGGLED)
    assert rec.spans() == []
    assert [a[0] for a in answers] == [expected_status] and closed
    _, headers, body = answers[0]
    assert headers["connection"] == "close"
    assert status_of(body).message.startswith("malformed HTTP request")
    assert r.stats()["requests"]["http"] == {"malformed_http": 1}
    # and it serves the next connection
    assert post(r.http_port, make_request(3).SerializeToString())[0] == 200
    assert len(rec.spans()) == 3


REFUSED_HEADS = {
    "request_line_too_long": (b"POST /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),
    "header_too_long": (HEAD + b"X: " + b"b" * 70_000 + b"\r\n\r\n", 431),
    "too_many_headers": (HEAD + b"X-A: 1\r\n" * 120 + b"\r\n", 431),
    "no_host": (b"POST /v1/traces HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 400),
    "http_2": (b"POST /v1/traces HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    "unknown_method": (b"BREW /v1/traces HTTP/1.1\r\nHost: x\r\n\r\n", 501),
    "transfer_encoding_in_http_1_0": (HEAD.replace(b"HTTP/1.1", b"HTTP/1.0")
                                      + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
}


@pytest.mark.parametrize("case", sorted(REFUSED_HEADS))
def test_heads_over_the_limits_or_not_served_are_refused(started, case):
    r, rec = started()
    request, expected_status = REFUSED_HEADS[case]
    answers, closed = exchange(r.http_port, request + SMUGGLED)
    assert [a[0] for a in answers] == [expected_status] and closed
    assert rec.spans() == []
    assert r.stats()["requests"]["http"] == {"malformed_http": 1}


def test_pipelined_valid_requests_are_each_answered(started):
    """What the test above relies on: a request sent along with another is
    processed when the framing of the first is sound (as an identical
    Content-Length sent twice is)."""
    r, rec = started()
    body = make_request(1, seed=12).SerializeToString()
    twice = HEAD + b"Content-Length: %d\r\nContent-Length: %d\r\n\r\n" % (len(body), len(body)) + body
    chunked = HEAD + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    last = valid_http().replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n")
    answers, closed = exchange(r.http_port, twice + chunked + last)
    assert [a[0] for a in answers] == [200, 200, 200] and closed
    assert len(rec.spans()) == 4
    assert r.stats()["requests"]["http"] == {"ok": 3}


def test_a_client_waiting_for_100_continue_gets_it_then_its_answer(started):
    r, rec = started()
    body = make_request(2).SerializeToString()
    with socket.create_connection(("127.0.0.1", r.http_port), timeout=10) as s:
        s.sendall(HEAD + b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        assert s.recv(4096).startswith(b"HTTP/1.1 100 ")
        s.sendall(body)
        assert s.recv(4096).startswith(b"HTTP/1.1 200 ")
    assert len(rec.spans()) == 2


# ---------------------------------------------------------------------------
# lifecycle

def test_the_reaper_sleeps_while_nothing_has_a_deadline(started, channels):
    """No wake-ups of the deadline reaper while no call or connection waits
    (an idle agent costs nothing there); one after a request: it wakes for
    the request's deadline, finds it done, and sleeps again."""
    rx, rec = started()
    time.sleep(0.3)
    before = rx.reaper_wakeups
    time.sleep(1.5)
    assert rx.reaper_wakeups == before
    stub = TraceServiceStub(channels(rx.grpc_port))
    stub.Export(ExportTraceServiceRequest(), timeout=10)
    time.sleep(0.5)
    assert rx.reaper_wakeups - before <= 2
    settled = rx.reaper_wakeups
    time.sleep(1.0)
    assert rx.reaper_wakeups == settled


def test_start_stop_are_idempotent_and_free_the_ports():
    cfg = OtlpConfig(grpc_port=0, http_port=0)
    r = OtlpReceiver(cfg, Recorder())
    r.stop()                      # before start: nothing to do
    r.start()
    ports = (r.grpc_port, r.http_port)
    r.start()
    assert (r.grpc_port, r.http_port) == ports
    r.stop(0)
    r.stop(0)
    # Both ports can be bound again at once: nothing of the receiver is left on them.
    again = OtlpReceiver(OtlpConfig(grpc_port=ports[0], http_port=ports[1]), Recorder())
    again.start()
    try:
        assert (again.grpc_port, again.http_port) == ports
    finally:
        again.stop(0)


def test_a_port_in_use_is_an_error_naming_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        for kw in ({"grpc_port": busy, "http_port": 0}, {"grpc_port": 0, "http_port": busy}):
            r = OtlpReceiver(OtlpConfig(**kw), Recorder())
            with pytest.raises(OSError, match=str(busy)):
                r.start()
            assert not r.running
            r.stop()
    # Another receiver's gRPC port too (gRPC would share it with SO_REUSEPORT).
    first = OtlpReceiver(OtlpConfig(grpc_port=0, http_port=0), Recorder())
    first.start()
    try:
        second = OtlpReceiver(OtlpConfig(grpc_port=first.grpc_port, http_port=0), Recorder())
        with pytest.raises(OSError, match=str(first.grpc_port)):
            second.start()
    finally:
        first.stop(0)


def test_kept_alive_http_connection_is_closed_by_stop(started):
    r, rec = started()
    conn = http.client.HTTPConnection("127.0.0.1", r.http_port, timeout=10)
    try:
        assert post(r.http_port, make_request(1).SerializeToString(), conn=conn)[0] == 200
        t0 = time.monotonic()
        r.stop(0)
        assert time.monotonic() - t0 < 5
        with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
            post(r.http_port, make_request(1).SerializeToString(), conn=conn)
    finally:
        conn.close()


def client_ports_to(port: int) -> set[int]:
    """The local ports of the established connections from 127.0.0.1 to 127.0.0.1:`port` (IPv4, or
    IPv4-mapped on an IPv6 socket, as gRPC's client makes them)."""
    out = set()
    for table, loopback in (("tcp", "0100007F"), ("tcp6", "0000000000000000FFFF00000100007F")):
        with open(f"/proc/net/{table}") as f:
            for line in f.readlines()[1:]:
                local, remote, state = line.split()[1:4]
                if state == "01" and remote == f"{loopback}:{port:04X}" and local.startswith(loopback + ":"):
                    out.add(int(local.split(":")[1], 16))
    return out


@pytest.mark.parametrize("rep", range(5))
def test_each_request_comes_with_the_connection_it_came_on(started, channels, rep):
    """The peer is the client's socket (address and port), the local end the
    receiver's port: what the sender is established from (never the payload)."""
    from spanlet.exporters.otlp.trust import Peer

    r, rec = started()
    conn = http.client.HTTPConnection("127.0.0.1", r.http_port, timeout=30)
    try:
        for _ in range(2):                      # two requests on one keep-alive connection
            assert post(r.http_port, make_request(seed=rep).SerializeToString(), conn=conn)[0] == 200
        client_port = conn.sock.getsockname()[1]
    finally:
        conn.close()
    raw_export(channels(r.grpc_port))(make_request(seed=rep).SerializeToString(), timeout=10)
    http_peer = Peer("http", "127.0.0.1", client_port, "127.0.0.1", r.http_port)
    assert rec.peers[:2] == [http_peer, http_peer]
    grpc_peer = rec.peers[2]
    assert (grpc_peer.transport, grpc_peer.host, grpc_peer.local_host, grpc_peer.local_port) == \
        ("grpc", "127.0.0.1", "127.0.0.1", r.grpc_port)
    # the channel's connection, still open (the kernel may give it the closed HTTP connection's port)
    assert grpc_peer.port in client_ports_to(r.grpc_port) - {0, r.grpc_port}


# -- the ids checked in C on the request's bytes (native/spanlet_wire.c, valid_spans) ---------------

def _random_request(rnd: random.Random) -> ExportTraceServiceRequest:
    """Spans whose ids are valid, missing, all zero or of the wrong length,
    resources and scopes with nothing in them, ids sent twice."""
    req = ExportTraceServiceRequest()
    ids = [lambda n: rnd.randbytes(n), lambda n: rnd.randbytes(n), lambda n: rnd.randbytes(n),
           lambda n: b"", lambda n: bytes(n), lambda n: rnd.randbytes(n + rnd.choice((-1, 1)))]
    for _ in range(rnd.randint(0, 3)):
        rs = req.resource_spans.add()
        for _ in range(rnd.randint(0, 3)):
            ss = rs.scope_spans.add()
            for _ in range(rnd.randint(0, 4)):
                ss.spans.add(trace_id=rnd.choice(ids)(16), span_id=rnd.choice(ids)(8),
                             parent_span_id=rnd.choice([b"", rnd.randbytes(8), rnd.randbytes(8), b"x"]))
    return req


def _varint(n: int) -> bytes:
    out = b""
    while n > 0x7F:
        out, n = out + bytes([(n & 0x7F) | 0x80]), n >> 7
    return out + bytes([n])


def _twice(rnd: random.Random) -> bytes:
    """A request of one span whose ids come twice in its bytes (a parse keeps the last)."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Span
    pick = lambda: rnd.choice([b"", bytes(16), rnd.randbytes(16)])      # noqa: E731
    span = b"".join(Span(trace_id=pick(), span_id=rnd.randbytes(8)).SerializeToString() for _ in range(2))
    scope = b"\x12" + _varint(len(span)) + span
    resource = b"\x12" + _varint(len(scope)) + scope
    return b"\x0a" + _varint(len(resource)) + resource


@pytest.mark.parametrize("seed", range(300))
def test_the_c_check_of_the_ids_agrees_with_the_python_one(seed):
    from spanlet._wire import valid_spans

    from spanlet.exporters.otlp.receiver import drop_invalid_spans
    rnd = random.Random(seed)
    payload = _twice(rnd) if seed % 5 == 0 else _random_request(rnd).SerializeToString()
    req, before = (ExportTraceServiceRequest.FromString(payload) for _ in range(2))
    fast = valid_spans(payload)
    valid, rejected = drop_invalid_spans(req)
    if fast >= 0:
        assert fast == valid and not rejected and req == before      # nothing the Python check drops
    else:
        assert rejected or req != before                             # something it drops


def test_the_c_check_counts_a_valid_request_and_refuses_other_bytes():
    from spanlet._wire import valid_spans
    req = ExportTraceServiceRequest()
    for r in range(3):
        for s in range(2):
            req.resource_spans.add().scope_spans.add().spans.add(trace_id=bytes([r + 1] * 16),
                                                                span_id=bytes([s + 1] * 8))
    assert valid_spans(req.SerializeToString()) == 6
    assert valid_spans(b"") == 0
    assert valid_spans(req.SerializeToString()[:-1]) == -1
    assert valid_spans(b"\x10\x01") == 0          # a field ExportTraceServiceRequest does not have
    assert valid_spans(b"\x08\x01") == -1         # resource_spans not of its wire type
    with pytest.raises(TypeError):
        valid_spans("not bytes")
