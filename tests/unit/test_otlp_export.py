"""Upstream OTLP export: against a real receiver and scripted servers, spans
arrive exactly once through retries spaced by the backoff; final errors,
full queues and shutdown drop exactly what they should; the standard
OTEL_EXPORTER_OTLP_* variables resolve as the specification says."""

from __future__ import annotations

import random
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans

from spanlet.config import ConfigError, OtlpConfig
from spanlet.exporters.otlp.common import STATUS_DETAILS_KEY
from spanlet.exporters.otlp.span_exporter import OtlpSpanExporter, split_resource_spans
from spanlet.exporters.otlp.transport import parse_retry_after
from spanlet.exporters.otlp.upstream import GRPC, HTTP_PROTOBUF, parse_headers, resolve_upstream
from loopback_http import LoopbackHttp, QuietHandler
from spanlet.exporters.otlp.common import TRACES_GRPC_SERVICE
from spanlet.exporters.otlp.receiver import Backpressure, OtlpReceiver

BACKOFF_S = 0.1
NO_PROXY = {"NO_PROXY": "*", "no_proxy": "*"}   # requests and grpc honour these


def make_resource_spans(counts: list[int], seed: int = 1) -> tuple[list[ResourceSpans], list[bytes]]:
    """One ResourceSpans per count (two scopes each when possible); returns
    them and their span ids in order."""
    rnd = random.Random(seed)
    out, ids = [], []
    for r, n in enumerate(counts):
        rs = ResourceSpans()
        rs.resource.attributes.add(key="service.name").value.string_value = f"svc-{r}"
        scopes = [rs.scope_spans.add() for _ in range(2 if n > 1 else 1)]
        for k, ss in enumerate(scopes):
            ss.scope.name = f"scope-{k}"
        for i in range(n):
            sid = rnd.randbytes(8)
            ids.append(sid)
            scopes[i * len(scopes) // n].spans.add(name=f"s{r}.{i}", trace_id=rnd.randbytes(16),
                                                   span_id=sid)
        out.append(rs)
    return out, ids


class Upstream:
    """A real OtlpReceiver that answers Backpressure for its first
    `fail_first` requests, then accepts; records call times and span ids."""

    def __init__(self, fail_first: int = 0, retry_after_s: float | None = None) -> None:
        self.fail_first = fail_first
        self.retry_after_s = retry_after_s
        self.lock = threading.Lock()
        self.calls: list[float] = []
        self.span_ids: list[bytes] = []
        self.resources: list[str] = []
        self.receiver = OtlpReceiver(OtlpConfig(grpc_port=0, http_port=0), self)

    def __call__(self, request: ExportTraceServiceRequest, peer=None) -> int:
        with self.lock:
            self.calls.append(time.monotonic())
            if self.fail_first < 0 or len(self.calls) <= self.fail_first:
                raise Backpressure("test upstream busy", self.retry_after_s)
            n = 0
            for rs in request.resource_spans:
                self.resources.append(rs.resource.attributes[0].value.string_value)
                for ss in rs.scope_spans:
                    self.span_ids.extend(s.span_id for s in ss.spans)
                    n += len(ss.spans)
            return n

    def endpoint(self, protocol: str) -> str:
        port = self.receiver.grpc_port if protocol == GRPC else self.receiver.http_port
        return f"http://127.0.0.1:{port}"


@pytest.fixture
def upstream():
    made = []

    def make(**kw) -> Upstream:
        u = Upstream(**kw)
        u.receiver.start()
        made.append(u)
        return u

    try:
        yield make
    finally:
        for u in made:
            u.receiver.stop(0)


@pytest.fixture
def exporter():
    """exporter(endpoint, protocol, environ=..., **cfg) -> OtlpSpanExporter, shut down after."""
    made = []

    def make(endpoint: str = "", protocol: str = "", environ: dict | None = None, **kw):
        kw.setdefault("batch_interval_s", 0.05)
        cfg = OtlpConfig(upstream_endpoint=endpoint, upstream_protocol=protocol, **kw)
        e = OtlpSpanExporter(cfg, environ={**NO_PROXY, **(environ or {})}, initial_backoff_s=BACKOFF_S)
        made.append(e)
        return e

    try:
        yield make
    finally:
        for e in made:
            e.shutdown(timeout_millis=2000)


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# ---------------------------------------------------------------------------
# retries against a real receiver

@pytest.mark.parametrize("protocol,compression", [(GRPC, "none"), (GRPC, "gzip"),
                                                  (HTTP_PROTOBUF, "none"), (HTTP_PROTOBUF, "gzip")])
def test_unavailable_then_accepted_arrives_exactly_once_with_backoff(upstream, exporter,
                                                                      protocol, compression):
    up = upstream(fail_first=3)
    e = exporter(up.endpoint(protocol), protocol, batch_size=100, max_retry_s=30,
                 environ={"OTEL_EXPORTER_OTLP_COMPRESSION": compression})
    rs, ids = make_resource_spans([100, 120, 30, 1])
    assert e.export(rs) is True
    assert e.force_flush(30000) is True

    assert sorted(up.span_ids) == sorted(ids)          # all of them, none twice
    assert up.span_ids[:100] == ids[:100]              # the first batch is the first 100, in order
    st = e.stats()
    assert st["exported"] == 251 and st["retries"] == 3
    assert st["dropped_failed"] == st["dropped_queue_full"] == st["queue_spans"] == 0
    assert st["batches"] == 3                          # 100 + 100 + 51
    # The first batch was tried 4 times; the waits follow the backoff plan.
    planned = e.retry_delays
    assert len(planned) == 3
    gaps = [b - a for a, b in zip(up.calls[:4], up.calls[1:4])]
    for k, (gap, delay) in enumerate(zip(gaps, planned)):
        nominal = BACKOFF_S * 2 ** k
        assert 0.8 * nominal <= delay <= 1.2 * nominal, (k, delay)
        assert gap >= 0.8 * delay, (k, gap, delay)
        assert gap < delay + 2.0, (k, gap, delay)


@pytest.mark.parametrize("protocol,server_delay", [(GRPC, 0.6), (HTTP_PROTOBUF, 1.0)])
def test_retry_info_and_retry_after_are_honoured(upstream, exporter, protocol, server_delay):
    # gRPC RetryInfo carries 0.6 s; HTTP Retry-After rounds up to whole seconds.
    up = upstream(fail_first=1, retry_after_s=server_delay)
    e = exporter(up.endpoint(protocol), protocol)
    rs, ids = make_resource_spans([5])
    e.export(rs)
    assert e.force_flush(30000)
    assert up.span_ids == ids
    assert e.retry_delays[0] >= server_delay            # the server's delay, not our 0.1 s
    assert up.calls[1] - up.calls[0] >= 0.9 * server_delay


@pytest.mark.parametrize("protocol", [GRPC, HTTP_PROTOBUF])
def test_retries_end_at_max_retry_s_and_the_batch_is_counted(upstream, exporter, protocol):
    up = upstream(fail_first=-1)                        # never accepts
    e = exporter(up.endpoint(protocol), protocol, max_retry_s=0.5)
    rs, _ = make_resource_spans([7, 3])
    t0 = time.monotonic()
    e.export(rs)
    assert e.force_flush(10000) is True
    assert time.monotonic() - t0 < 5
    st = e.stats()
    assert st["dropped_failed"] == 10 and st["exported"] == 0
    # Waits of 0.1 and 0.2 s (+-20%) fit in 0.5 s, the third (0.32 s at
    # least) never does; a slow machine may use up the budget one try earlier.
    assert len(up.calls) in (2, 3) and st["retries"] == len(up.calls) - 1
    assert up.calls[-1] - up.calls[0] < 0.5


@pytest.mark.parametrize("protocol", [GRPC, HTTP_PROTOBUF])
def test_unreachable_upstream_is_retried_then_dropped(exporter, protocol):
    e = exporter(f"http://127.0.0.1:{free_port()}", protocol, max_retry_s=0.3,
                 upstream_timeout_s=2)
    rs, _ = make_resource_spans([4])
    e.export(rs)
    assert e.force_flush(10000) is True
    st = e.stats()
    assert st["dropped_failed"] == 4 and st["retries"] >= 1


# ---------------------------------------------------------------------------
# scripted upstreams for the final and throttling answers

class ScriptedGrpc:
    """TraceService answering from a script of (code, retry_delay_s); OK
    once the script runs out. Records call times and metadata."""

    def __init__(self, script) -> None:
        self.script = list(script)
        self.calls: list[float] = []
        self.metadata: list[dict] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.method_handlers_generic_handler(TRACES_GRPC_SERVICE, {
            "Export": grpc.unary_unary_rpc_method_handler(self.export)})
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def export(self, payload: bytes, context) -> bytes:
        self.calls.append(time.monotonic())
        self.metadata.append(dict(context.invocation_metadata()))
        ExportTraceServiceRequest.FromString(payload)
        if not self.script:
            return b""
        code, delay = self.script.pop(0)
        if delay is not None:
            info = error_details_pb2.RetryInfo()
            info.retry_delay.FromNanoseconds(int(delay * 1e9))
            st = status_pb2.Status(code=code.value[0], message="scripted")
            st.details.add().Pack(info)
            context.set_trailing_metadata(((STATUS_DETAILS_KEY, st.SerializeToString()),))
        context.abort(code, "scripted")


class ScriptedHttp(LoopbackHttp):
    """OTLP/HTTP endpoint answering from a script of (status, headers, body);
    200 with an empty response once the script runs out."""

    def __init__(self, script) -> None:
        self.script = list(script)
        self.calls: list[float] = []
        self.headers: list[dict] = []
        outer = self

        class Handler(QuietHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.calls.append(time.monotonic())
                outer.headers.append({k.lower(): v for k, v in self.headers.items()})
                status, headers, reply = outer.script.pop(0) if outer.script else (200, {}, b"")
                self.reply(status, reply, headers=headers)

        super().__init__(Handler)


@pytest.fixture
def scripted():
    made = []

    def make(protocol, script):
        s = ScriptedGrpc(script) if protocol == GRPC else ScriptedHttp(script)
        made.append(s)
        return s

    try:
        yield make
    finally:
        for s in made:
            s.server.stop(0) if isinstance(s, ScriptedGrpc) else s.close()


C = grpc.StatusCode
PARTIAL = ExportTraceServiceResponse()
PARTIAL.partial_success.rejected_spans = 3
PARTIAL.partial_success.error_message = "3 spans too old"


@pytest.mark.parametrize("protocol,script,calls,exported,dropped", [
    (GRPC, [(C.INVALID_ARGUMENT, None)], 1, 0, 6),
    (GRPC, [(C.UNAUTHENTICATED, None)], 1, 0, 6),
    (GRPC, [(C.RESOURCE_EXHAUSTED, None)], 1, 0, 6),          # no RetryInfo: final
    (GRPC, [(C.RESOURCE_EXHAUSTED, 0.3)], 2, 6, 0),           # with RetryInfo: retried
    (GRPC, [(C.DEADLINE_EXCEEDED, None), (C.ABORTED, None), (C.UNAVAILABLE, 0)], 4, 6, 0),
    (HTTP_PROTOBUF, [(400, {}, b"")], 1, 0, 6),
    (HTTP_PROTOBUF, [(500, {}, b"")], 1, 0, 6),               # not in the retryable list
    (HTTP_PROTOBUF, [(429, {"Retry-After": "0"}, b""), (502, {}, b""), (504, {}, b"")], 4, 6, 0),
    (HTTP_PROTOBUF, [(503, {"Retry-After": "bogus"}, b"")], 2, 6, 0),
])
def test_final_and_retryable_answers(scripted, exporter, protocol, script, calls, exported, dropped):
    server = scripted(protocol, script)
    e = exporter(f"http://127.0.0.1:{server.port}", protocol, max_retry_s=20)
    rs, _ = make_resource_spans([6])
    e.export(rs)
    assert e.force_flush(20000)
    st = e.stats()
    assert len(server.calls) == calls
    assert (st["exported"], st["dropped_failed"], st["retries"]) == (exported, dropped, calls - 1)
    if protocol == GRPC and script[0][1]:
        assert server.calls[1] - server.calls[0] >= 0.9 * script[0][1]


@pytest.mark.parametrize("protocol", [GRPC, HTTP_PROTOBUF])
def test_partial_success_is_not_retried_and_headers_are_sent(scripted, exporter, protocol):
    script = ([] if protocol == GRPC else [(200, {}, PARTIAL.SerializeToString())])
    server = scripted(protocol, script)
    e = exporter(f"http://127.0.0.1:{server.port}", protocol,
                 upstream_headers={"Authorization": "Bearer cfg"},
                 environ={"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20env,x-tenant=blue%2Fgreen"})
    rs, _ = make_resource_spans([6])
    e.export(rs)
    assert e.force_flush(20000)
    sent = server.metadata[0] if protocol == GRPC else server.headers[0]
    assert sent["authorization"] == "Bearer cfg"              # config wins over the environment
    assert sent["x-tenant"] == "blue/green"                  # URL-decoded
    st = e.stats()
    assert len(server.calls) == 1
    if protocol == HTTP_PROTOBUF:
        assert (st["exported"], st["rejected_upstream"]) == (3, 3)
        assert sent["content-type"] == "application/x-protobuf"


# ---------------------------------------------------------------------------
# queue, shutdown, disabled

def test_full_queue_drops_exactly_the_overflow(upstream, exporter):
    up = upstream()
    # A batch never fills and the timer is a minute away: nothing leaves the queue by itself.
    e = exporter(up.endpoint(GRPC), GRPC, queue_size=100, batch_size=1000, batch_interval_s=60)
    rs, ids = make_resource_spans([40, 40, 40])
    assert e.export(rs) is False
    st = e.stats()
    assert (st["queue_spans"], st["dropped_queue_full"]) == (100, 20)
    assert up.calls == []
    assert e.force_flush(10000) is True
    assert up.span_ids == ids[:100]                       # the first 100, in order
    assert up.resources == ["svc-0", "svc-1", "svc-2"]    # the cut one keeps its resource

    more, _ = make_resource_spans([150], seed=2)
    assert e.export(more) is False
    assert e.stats()["dropped_queue_full"] == 70
    assert e.export(make_resource_spans([0])[0]) is True   # nothing to queue is no drop
    assert e.force_flush(10000)
    assert e.stats()["exported"] == 200


@pytest.mark.parametrize("protocol", [GRPC, HTTP_PROTOBUF])
def test_batches_are_cut_inside_a_queued_resource_in_order(upstream, exporter, protocol):
    """Each resource is queued serialized (its bytes the queue's byte count);
    a batch takes whole resources and cuts the one past its room: the
    upstream gets every span once, in order, each cut keeping its resource."""
    up = upstream()
    e = exporter(up.endpoint(protocol), protocol, batch_size=100, batch_interval_s=60)
    rs, ids = make_resource_spans([60, 60, 60])
    assert e.export(rs) is True
    assert e.stats()["queue_bytes"] == sum(r.ByteSize() for r in rs)
    assert e.force_flush(10000) is True
    assert up.span_ids == ids                              # all, once, in order
    assert up.resources == ["svc-0", "svc-1", "svc-1", "svc-2"]    # 60 + 40 | 20 + 60
    st = e.stats()
    assert (st["exported"], st["batches"], st["queue_spans"], st["queue_bytes"]) == (180, 2, 0, 0)


def test_shutdown_flushes_then_is_safe_twice(upstream, exporter):
    up = upstream()
    e = exporter(up.endpoint(HTTP_PROTOBUF), HTTP_PROTOBUF, batch_interval_s=60)
    rs, ids = make_resource_spans([30])
    e.export(rs)
    e.shutdown(timeout_millis=10000)
    assert up.span_ids == ids
    assert not e._worker.thread.is_alive()
    e.shutdown(timeout_millis=10000)
    assert e.export(make_resource_spans([10], seed=3)[0]) is False
    st = e.stats()
    assert (st["exported"], st["dropped_shutdown"]) == (30, 10)


def test_shutdown_deadline_bounds_retrying_and_counts_what_is_left(upstream, exporter):
    up = upstream(fail_first=-1)
    e = exporter(up.endpoint(GRPC), GRPC, batch_size=20, max_retry_s=60)
    rs, _ = make_resource_spans([50])
    e.export(rs)
    wait_until(lambda: len(up.calls) >= 1)
    t0 = time.monotonic()
    e.shutdown(timeout_millis=500)
    assert time.monotonic() - t0 < 2.5
    assert not e._worker.thread.is_alive()
    st = e.stats()
    assert (st["exported"], st["dropped_shutdown"], st["queue_spans"]) == (0, 50, 0)


def test_no_endpoint_means_disabled_without_a_thread(exporter):
    before = {t.name for t in threading.enumerate()}
    e = exporter()
    assert e.enabled is False and e._worker is None
    assert "otlp-export" not in {t.name for t in threading.enumerate()} - before
    rs, _ = make_resource_spans([5])
    assert e.export(rs) is True
    assert e.force_flush(10) is True
    e.shutdown()
    e.shutdown()
    assert e.stats()["enabled"] is False and e.stats()["exported"] == 0


def test_split_keeps_order_resource_and_scopes():
    (rs,), ids = make_resource_spans([7])
    pieces = split_resource_spans(rs, 2, 3)
    assert [sum(len(ss.spans) for ss in p.scope_spans) for p in pieces] == [2, 3, 2]
    assert [s.span_id for p in pieces for ss in p.scope_spans for s in ss.spans] == ids
    assert all(p.resource == rs.resource for p in pieces)
    assert [[ss.scope.name for ss in p.scope_spans] for p in pieces] == [
        ["scope-0"], ["scope-0", "scope-1"], ["scope-1"]]


# ---------------------------------------------------------------------------
# where to send: config, then the standard variables

E = "OTEL_EXPORTER_OTLP_"


@pytest.mark.parametrize("cfg,env,expected", [
    ({}, {}, None),
    ({}, {E + "ENDPOINT": " "}, None),                                   # empty is unset
    ({}, {E + "ENDPOINT": "http://col:4318"},
     dict(protocol=HTTP_PROTOBUF, endpoint="http://col:4318/v1/traces", insecure=True)),
    ({}, {E + "ENDPOINT": "https://col:4318/base/"},
     dict(endpoint="https://col:4318/base/v1/traces", insecure=False)),
    ({}, {E + "ENDPOINT": "http://a:1", E + "TRACES_ENDPOINT": "http://col:4318/custom"},
     dict(endpoint="http://col:4318/custom")),                          # TRACES form as-is
    ({}, {E + "PROTOCOL": "grpc", E + "ENDPOINT": "https://col:4317"},
     dict(protocol=GRPC, endpoint="col:4317", insecure=False)),
    ({}, {E + "PROTOCOL": "http/protobuf", E + "TRACES_PROTOCOL": "grpc", E + "ENDPOINT": "http://col:4317/"},
     dict(protocol=GRPC, endpoint="col:4317", insecure=True)),
    ({}, {E + "PROTOCOL": "grpc", E + "ENDPOINT": "col:4317"}, dict(endpoint="col:4317", insecure=False)),
    ({}, {E + "PROTOCOL": "grpc", E + "ENDPOINT": "col:4317", E + "INSECURE": "true"},
     dict(insecure=True)),
    ({}, {E + "PROTOCOL": "grpc", E + "ENDPOINT": "col:4317", E + "INSECURE": "true",
          E + "TRACES_INSECURE": "false"}, dict(insecure=False)),
    ({}, {E + "PROTOCOL": "http/json", E + "ENDPOINT": "http://col:4318"},
     dict(protocol=HTTP_PROTOBUF)),                                      # unsupported: default
    ({"upstream_endpoint": "http://cfg:4317", "upstream_protocol": "grpc"},
     {E + "ENDPOINT": "http://env:4318", E + "PROTOCOL": "http/protobuf"},
     dict(protocol=GRPC, endpoint="cfg:4317")),                          # config wins
    ({"upstream_endpoint": "http://cfg:4318"}, {}, dict(endpoint="http://cfg:4318/v1/traces")),
    ({"upstream_endpoint": "https://cfg/otlp/v1/traces"}, {}, dict(endpoint="https://cfg/otlp/v1/traces")),
    ({"upstream_endpoint": "cfg:4318"}, {E + "INSECURE": "true"}, dict(endpoint="http://cfg:4318/v1/traces")),
    ({}, {E + "ENDPOINT": "http://c:1", E + "HEADERS": "Api-Key=a%3Db,x=1,broken,=v",
          E + "TRACES_HEADERS": "only=traces"}, dict(headers=(("only", "traces"),))),
    ({"upstream_headers": {"X": "cfg"}}, {E + "ENDPOINT": "http://c:1", E + "HEADERS": "x=env,y=2"},
     dict(headers=(("x", "cfg"), ("y", "2")))),
    ({}, {E + "ENDPOINT": "http://c:1", E + "TIMEOUT": "2500"}, dict(timeout_s=2.5)),
    ({}, {E + "ENDPOINT": "http://c:1", E + "TIMEOUT": "500", E + "TRACES_TIMEOUT": "750"},
     dict(timeout_s=0.75)),
    ({"upstream_timeout_s": 7}, {E + "ENDPOINT": "http://c:1", E + "TIMEOUT": "2500"}, dict(timeout_s=7)),
    ({}, {E + "ENDPOINT": "http://c:1", E + "TIMEOUT": "soon"}, dict(timeout_s=10.0)),
    ({}, {E + "ENDPOINT": "http://c:1", E + "COMPRESSION": "gzip"}, dict(compression="gzip")),
    ({}, {E + "ENDPOINT": "http://c:1", E + "COMPRESSION": "zstd"}, dict(compression="none")),
    ({}, {E + "ENDPOINT": "https://c:1", E + "CERTIFICATE": "/etc/ca.pem"},
     dict(certificate="/etc/ca.pem")),
])
def test_endpoint_resolution(cfg, env, expected):
    up = resolve_upstream(OtlpConfig(**cfg), env)
    if expected is None:
        assert up is None
        return
    for key, value in expected.items():
        assert getattr(up, key) == value, key


@pytest.mark.parametrize("protocol", [GRPC, HTTP_PROTOBUF])
def test_an_unreadable_certificate_is_a_config_error_naming_it(tmp_path, protocol):
    missing = str(tmp_path / "ca.pem")
    cfg = OtlpConfig(upstream_endpoint="https://col:4318", upstream_protocol=protocol)
    with pytest.raises(ConfigError, match="ca.pem"):
        OtlpSpanExporter(cfg, environ={E + "CERTIFICATE": missing})


def test_header_and_retry_after_parsing():
    assert parse_headers("a=1, B = two%20words ,c=x%3Dy,,bad,=nokey") == {
        "a": "1", "b": "two words", "c": "x=y"}
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("-1") is None and parse_retry_after("later") is None
    assert parse_retry_after(None) is None
    now = 1_700_000_000.0
    assert parse_retry_after("Tue, 14 Nov 2023 22:13:40 GMT", now=now) == pytest.approx(20.0)
