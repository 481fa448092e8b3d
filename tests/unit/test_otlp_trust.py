"""The OTLP receiver locked down: real OTel SDK exporters (gRPC and HTTP)
against TLS with the test's own CA, client certificates, a bearer token and
a per-sender rate limit; each refused client gets the protocol's answer and
is counted, and the others are not affected."""

from __future__ import annotations

import http.client
import logging
import socket
import ssl
import time

import grpc
import pytest
import requests
from collector_fakes import registry, sources
from otlp_upstream import wait_for
from google.rpc import error_details_pb2
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from receivers import receivers
from requests.adapters import HTTPAdapter
from tls_certs import make_pki

from spanlet import config
from spanlet.exporters.otlp import trust
from spanlet.exporters.otlp.common import TRACES_GRPC_METHOD
from spanlet.exporters.otlp.receiver import RETRY_INFO_KEY, OtlpReceiver
from spanlet.exporters.otlp.trust import SenderRateLimiter, sender_of_peer

CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]
TOKEN = "s3cret-token-for-the-test"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


class Spans:
    """on_request: keeps the names of the spans it got."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __call__(self, request: ExportTraceServiceRequest, peer=None) -> int:
        got = [s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
        self.names.extend(got)
        return len(got)


@pytest.fixture
def receiver():
    """receiver(**cfg) -> (started receiver, the spans it got)."""
    with receivers() as make:
        def start(**kw):
            got = Spans()
            return make(got, **kw), got
        yield start


def sdk_spans(n: int, name: str):
    """n finished spans of the real SDK, as a BatchSpanProcessor hands them over."""
    mem = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(mem))
    tracer = provider.get_tracer("trust-test")
    for i in range(n):
        tracer.start_span(f"{name}-{i}").end()
    provider.shutdown()
    return mem.get_finished_spans()


def exporter(protocol: str, rx: OtlpReceiver, *, tls: bool, pki=None, client=None,
             headers=None, timeout: float = 1.5, source: str | None = None):
    """A real OTel SDK span exporter to `rx`; `client`: (cert, key) to present."""
    scheme = "https" if tls else "http"
    if protocol == "grpc":
        creds = None
        if tls:
            cert_key = ({"certificate_chain": client[0].read_bytes(),
                         "private_key": client[1].read_bytes()} if client else {})
            creds = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes(), **cert_key)
        return GrpcExporter(endpoint=f"{scheme}://127.0.0.1:{rx.grpc_port}", insecure=not tls,
                            credentials=creds, headers=headers, timeout=timeout,
                            channel_options=tuple(CHANNEL_OPTIONS))
    session = requests.Session()
    session.trust_env = False
    if source:
        session.mount(f"{scheme}://", SourceAdapter(source))
    kw = {}
    if tls:
        kw["certificate_file"] = str(pki.ca)
        if client:
            kw.update(client_certificate_file=str(client[0]), client_key_file=str(client[1]))
    return HttpExporter(endpoint=f"{scheme}://127.0.0.1:{rx.http_port}/v1/traces", headers=headers,
                        timeout=timeout, session=session, **kw)


class SourceAdapter(HTTPAdapter):
    """Connections from another loopback address: another sender."""

    def __init__(self, source: str) -> None:
        self.source = source
        super().__init__()

    def init_poolmanager(self, *args, **kwargs):
        kwargs["source_address"] = (self.source, 0)
        super().init_poolmanager(*args, **kwargs)


def export(protocol, rx, spans, **kw) -> SpanExportResult:
    exp = exporter(protocol, rx, **kw)
    try:
        return exp.export(spans)
    finally:
        exp.shutdown()


def requests_of(rx, transport: str) -> dict:
    return rx.stats()["requests"][transport]


# ---- TLS ----

@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_sdk_exporter_talks_tls_with_the_tests_ca_and_plain_text_is_refused(receiver, pki, protocol):
    rx, got = receiver(tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.server_key))
    assert rx.lockdown().startswith("TLS,")
    assert export(protocol, rx, sdk_spans(3, "tls"), tls=True, pki=pki) == SpanExportResult.SUCCESS
    assert export(protocol, rx, sdk_spans(2, "plain"), tls=False) == SpanExportResult.FAILURE
    assert sorted(got.names) == ["tls-0", "tls-1", "tls-2"]
    assert requests_of(rx, protocol)["ok"] == 1
    if protocol == "http":
        # plain HTTP on the TLS port: one handshake failure a try (the SDK retries)
        assert requests_of(rx, "http").get("tls_handshake_failed", 0) >= 1


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_client_certificate_required_when_a_ca_file_is_given(receiver, pki, protocol):
    rx, got = receiver(tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.server_key),
                       tls_client_ca_file=str(pki.ca))
    assert rx.lockdown().startswith("TLS with client certificates")
    assert export(protocol, rx, sdk_spans(2, "none"), tls=True, pki=pki) == SpanExportResult.FAILURE
    assert export(protocol, rx, sdk_spans(2, "rogue"), tls=True, pki=pki,
                  client=(pki.rogue_cert, pki.rogue_key)) == SpanExportResult.FAILURE
    assert export(protocol, rx, sdk_spans(2, "mtls"), tls=True, pki=pki,
                  client=(pki.client_cert, pki.client_key)) == SpanExportResult.SUCCESS
    assert sorted(got.names) == ["mtls-0", "mtls-1"]
    assert requests_of(rx, protocol)["ok"] == 1
    if protocol == "http":
        assert requests_of(rx, "http")["tls_handshake_failed"] >= 2


def test_raw_tls_handshake_without_a_client_certificate_is_refused(receiver, pki):
    rx, _ = receiver(tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.server_key),
                     tls_client_ca_file=str(pki.ca))
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    conn = http.client.HTTPSConnection("127.0.0.1", rx.http_port, context=ctx, timeout=10)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        conn.request("POST", "/v1/traces", body=b"", headers={"Content-Type": "application/x-protobuf"})
        conn.getresponse()
    conn.close()
    ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    conn = http.client.HTTPSConnection("127.0.0.1", rx.http_port, context=ctx, timeout=10)
    conn.request("POST", "/v1/traces", body=b"", headers={"Content-Type": "application/x-protobuf"})
    assert conn.getresponse().status == 200
    conn.close()
    assert requests_of(rx, "http") == {"tls_handshake_failed": 1, "ok": 1}


def test_silent_and_stalled_tls_handshakes_are_cut_off_and_others_served(receiver, pki):
    rx, got = receiver(tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.server_key))
    rx.request_timeout_s = 0.5
    silent = socket.create_connection(("127.0.0.1", rx.http_port), timeout=10)
    stalled = socket.create_connection(("127.0.0.1", rx.http_port), timeout=10)
    stalled.sendall(b"\x16\x03\x01\x02\x00")          # a ClientHello's record header only
    assert export("http", rx, sdk_spans(1, "served"), tls=True, pki=pki) == SpanExportResult.SUCCESS
    wait_for(lambda: requests_of(rx, "http").get("timeout") == 2, 10, "both cut off")
    for s in (silent, stalled):
        assert s.recv(1) == b""                           # closed by the receiver
        s.close()
    assert got.names == ["served-0"]
    assert requests_of(rx, "http") == {"timeout": 2, "ok": 1}


# ---- bearer token ----

@pytest.fixture
def token_file(tmp_path):
    p = tmp_path / "token"
    p.write_text(TOKEN + "\n")
    return p


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_wrong_or_missing_token_unauthenticated_right_token_delivers(receiver, token_file, pki,
                                                                     protocol, caplog):
    rx, got = receiver(bearer_token_file=str(token_file), tls_cert_file=str(pki.server_cert),
                       tls_key_file=str(pki.server_key))
    caplog.set_level(logging.DEBUG)
    tls = {"tls": True, "pki": pki}
    assert export(protocol, rx, sdk_spans(1, "none"), **tls) == SpanExportResult.FAILURE
    assert export(protocol, rx, sdk_spans(1, "wrong"), headers={"authorization": "Bearer nope"},
                  **tls) == SpanExportResult.FAILURE
    assert export(protocol, rx, sdk_spans(2, "right"), headers={"authorization": f"Bearer {TOKEN}"},
                  **tls) == SpanExportResult.SUCCESS
    assert sorted(got.names) == ["right-0", "right-1"]
    # one try each: the SDK took the answer as final (UNAUTHENTICATED, 401 are
    # not retryable; a connection or TLS failure would have been retried)
    assert requests_of(rx, protocol) == {"unauthenticated": 2, "ok": 1}
    assert TOKEN not in caplog.text
    # as the agent's self-metrics show them
    src = sources([])
    src.receiver = rx
    reg = registry(src)
    for outcome, n in (("unauthenticated", 2), ("ok", 1)):
        assert reg.get_sample_value("spanlet_otlp_receiver_requests_total", {
            "node": "n1", "transport": protocol, "outcome": outcome}) == n


def test_token_answers_on_the_wire_and_a_changed_file_is_reread(receiver, token_file, monkeypatch):
    monkeypatch.setattr(trust, "TOKEN_RECHECK_S", 0.0)
    rx, got = receiver(bearer_token_file=str(token_file))
    body = ExportTraceServiceRequest().SerializeToString()

    def http_post(auth: str | None) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", rx.http_port, timeout=10)
        headers = {"Content-Type": "application/x-protobuf"}
        if auth:
            headers["Authorization"] = auth
        conn.request("POST", "/v1/traces", body=body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        conn.close()
        return resp

    def grpc_call(auth: str | None) -> grpc.StatusCode:
        with grpc.insecure_channel(f"127.0.0.1:{rx.grpc_port}", options=CHANNEL_OPTIONS) as ch:
            call = ch.unary_unary(TRACES_GRPC_METHOD)
            try:
                call(body, metadata=[("authorization", auth)] if auth else None, timeout=10)
                return grpc.StatusCode.OK
            except grpc.RpcError as e:
                assert TOKEN not in (e.details() or "")
                return e.code()

    r = http_post("Bearer wrong")
    assert r.status == 401 and r.getheader("WWW-Authenticate") == "Bearer"
    assert http_post(None).status == 401
    assert http_post(f"Basic {TOKEN}").status == 401
    assert http_post(f"bearer {TOKEN}").status == 200     # the scheme is case-insensitive
    assert grpc_call("Bearer wrong") == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_call(None) == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_call(f"Bearer {TOKEN}") == grpc.StatusCode.OK

    token_file.write_text("the-rotated-token-longer\n")
    assert http_post(f"Bearer {TOKEN}").status == 401
    assert http_post("Bearer the-rotated-token-longer").status == 200
    assert grpc_call(f"Bearer {TOKEN}") == grpc.StatusCode.UNAUTHENTICATED
    token_file.unlink()                       # a secret mid-update: the last token stays
    assert grpc_call("Bearer the-rotated-token-longer") == grpc.StatusCode.OK
    assert requests_of(rx, "http") == {"unauthenticated": 4, "ok": 2}
    assert requests_of(rx, "grpc") == {"unauthenticated": 3, "ok": 2}


# ---- rate limit ----

def test_one_sender_over_its_rate_is_refused_and_another_is_not(receiver):
    rx, got = receiver(rate_limit_spans_per_s=10, rate_limit_burst=10)
    # 127.0.0.1 spends its burst over gRPC...
    assert export("grpc", rx, sdk_spans(10, "a"), tls=False) == SpanExportResult.SUCCESS
    # ...so its next request is refused with RESOURCE_EXHAUSTED and RetryInfo
    body = ExportTraceServiceRequest()
    body.resource_spans.add().scope_spans.add().spans.add(
        trace_id=b"\1" * 16, span_id=b"\2" * 8, name="raw")
    with grpc.insecure_channel(f"127.0.0.1:{rx.grpc_port}", options=CHANNEL_OPTIONS) as ch:
        with pytest.raises(grpc.RpcError) as err:
            ch.unary_unary(TRACES_GRPC_METHOD)(body.SerializeToString(), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = error_details_pb2.RetryInfo.FromString(dict(err.value.trailing_metadata())[RETRY_INFO_KEY])
    assert 0 < info.retry_delay.ToNanoseconds() / 1e9 <= 1.0
    # ...and over HTTP too (one budget a sender): 429 with Retry-After
    conn = http.client.HTTPConnection("127.0.0.1", rx.http_port, timeout=10)
    conn.request("POST", "/v1/traces", body=body.SerializeToString(),
                 headers={"Content-Type": "application/x-protobuf"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    assert resp.status == 429 and resp.getheader("Retry-After") == "1"
    # another sender (127.0.0.2) meanwhile delivers at once
    t0 = time.monotonic()
    assert export("http", rx, sdk_spans(5, "b"), tls=False, source="127.0.0.2") == SpanExportResult.SUCCESS
    assert time.monotonic() - t0 < 1.0
    # the SDK over its rate honours RetryInfo: waits, retries, delivers
    t0 = time.monotonic()
    assert export("grpc", rx, sdk_spans(5, "c"), tls=False, timeout=10) == SpanExportResult.SUCCESS
    assert time.monotonic() - t0 >= 0.3
    assert sorted(got.names) == sorted([f"a-{i}" for i in range(10)] + [f"b-{i}" for i in range(5)]
                                       + [f"c-{i}" for i in range(5)])
    assert requests_of(rx, "grpc")["rate_limited"] >= 2 and requests_of(rx, "grpc")["ok"] == 2
    assert requests_of(rx, "http") == {"rate_limited": 1, "ok": 1}
    assert rx.stats()["spans_rejected"] == {}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("repeat", range(5))
def test_rate_limiter_keys_refills_and_bounds_senders(repeat):
    clock = Clock()
    lim = SenderRateLimiter(rate=100, burst=50, max_senders=3, clock=clock)
    assert lim.take("10.0.0.1", 50) is None
    wait = lim.take("10.0.0.1", 1)
    assert wait == pytest.approx(0.01)
    assert lim.take("10.0.0.2", 50) is None            # its own bucket
    clock.t += 0.25                                    # 25 spans back
    assert lim.take("10.0.0.1", 25) is None
    assert lim.take("10.0.0.1", 1) is not None
    # a request bigger than the burst goes in on a full bucket, then is paid back
    clock.t += 10
    assert lim.take("10.0.0.1", 250) is None
    assert lim.take("10.0.0.1", 1) == pytest.approx(2.01)
    clock.t += 2.01
    assert lim.take("10.0.0.1", 1) is None
    # at most max_senders buckets: the least recently seen is forgotten
    for s in ("10.0.0.3", "10.0.0.4"):
        assert lim.take(s, 1) is None
    assert lim.senders() == 3
    assert lim.take("10.0.0.2", 50) is None            # forgotten: a full bucket again
    # an empty request still costs one
    lim2 = SenderRateLimiter(rate=1, burst=0, max_senders=10, clock=clock)
    assert lim2.burst == 1
    assert lim2.take("x", 0) is None and lim2.take("x", 0) == pytest.approx(1.0)


@pytest.mark.parametrize("peer, sender", [
    ("ipv4:10.1.2.3:4711", "10.1.2.3"),
    ("ipv6:[::1]:4711", "::1"),
    ("ipv6:[::ffff:10.1.2.3]:4711", "10.1.2.3"),
    ("ipv6:[FD00::5]:1", "fd00::5"),
    ("unix:/run/x.sock", "unix:/run/x.sock"),
])
def test_sender_of_a_grpc_peer(peer, sender):
    assert sender_of_peer(peer) == sender


# ---- settings ----

def test_defaults_stay_plain_and_node_local():
    cfg = config.OtlpConfig()
    assert cfg.receiver_address == "127.0.0.1"
    assert (cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file, cfg.bearer_token_file,
            cfg.rate_limit_spans_per_s) == ("", "", "", "", 0)
    assert OtlpReceiver(cfg, Spans()).lockdown() == "plain (no TLS), no token, no rate limit"


def test_settings_from_the_environment(token_file):
    cfg = config.load(None, env={"SPANLET_OTLP_BEARER_TOKEN_FILE": str(token_file),
                                 "SPANLET_OTLP_RATE_LIMIT_SPANS_PER_S": "250",
                                 "SPANLET_OTLP_RATE_LIMIT_BURST": "1000"})
    assert cfg.otlp.bearer_token_file == str(token_file)
    assert (cfg.otlp.rate_limit_spans_per_s, cfg.otlp.rate_limit_burst) == (250, 1000)
    assert OtlpReceiver(cfg.otlp, Spans()).lockdown() == \
        "plain (no TLS), a bearer token, 250 spans/s a sender (burst 1000)"


@pytest.mark.parametrize("sets, words", [
    (["otlp.tls_cert_file={cert}"], "tls_cert_file and tls_key_file are set together"),
    (["otlp.tls_key_file={key}"], "tls_cert_file and tls_key_file are set together"),
    (["otlp.tls_client_ca_file={ca}"], "tls_client_ca_file needs tls_cert_file"),
    (["otlp.tls_cert_file={missing}", "otlp.tls_key_file={key}"], "cannot be read"),
    (["otlp.tls_cert_file={key}", "otlp.tls_key_file={cert}"], "not a PEM certificate and its key"),
    (["otlp.tls_cert_file={cert}", "otlp.tls_key_file={key}", "otlp.tls_client_ca_file={empty}"],
     "tls_client_ca_file is not PEM CA certificates"),
    (["otlp.bearer_token_file={empty}"], "bearer_token_file"),
    (["otlp.bearer_token_file={missing}"], "cannot be read"),
])
def test_bad_settings_stop_the_start_with_one_clear_error(pki, tmp_path, sets, words):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    paths = {"cert": pki.server_cert, "key": pki.server_key, "ca": pki.ca,
             "missing": tmp_path / "nope", "empty": empty}
    with pytest.raises(config.ConfigError) as err:
        config.load(None, env={}, overrides=[s.format(**paths) for s in sets])
    assert words in str(err.value)
    assert "BEGIN" not in str(err.value)          # no file content quoted


def test_the_token_is_a_secret_of_the_config(token_file):
    cfg = config.load(None, env={}, overrides=[f"otlp.bearer_token_file={token_file}"])
    assert config.redact(f"got Bearer {TOKEN} here", cfg.secrets()) == "got Bearer *** here"


def test_a_file_gone_after_the_config_fails_the_start_and_opens_no_port(pki, tmp_path):
    key = tmp_path / "server.key"
    key.write_bytes(pki.server_key.read_bytes())
    cfg = config.OtlpConfig(grpc_port=0, http_port=0, tls_cert_file=str(pki.server_cert),
                            tls_key_file=str(key))
    key.unlink()
    rx = OtlpReceiver(cfg, Spans())
    with pytest.raises(OSError, match="otlp.tls_key_file .* cannot be read"):
        rx.start()
    assert not rx.running
