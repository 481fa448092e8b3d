"""10,000 hostile OTLP payloads against the agent's span path (the Daemon's
own receiver, join, serving metrics, admin API and upstream export, without
probes): nothing crashes, every rejection is counted by kind, valid spans
sent in between keep exactly their own attributes and kernel facts, and
clients that trickle bytes cannot stall the receiver."""

from __future__ import annotations

import gzip
import http.client
import math
import random
import socket
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client import generate_latest

from spanlet import config, events
from spanlet import inspect as inspect_mod
from spanlet.daemon import Daemon
from spanlet.join import FACT_ATTRIBUTES
from facts_fakes import FakeFacts
from spanlet.exporters.otlp.common import TRACES_GRPC_METHOD
from spanlet.exporters.otlp.receiver import OtlpReceiver

CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]
MAX_BYTES = 256 * 1024
N_HOSTILE = 10_000
N_LEGIT = 200
TRACE_ID_RULE = "16 non-zero bytes"


# ---------------------------------------------------------------------------
# the agent under test and the collector it exports to

class Upstream:
    """A real OTLP receiver standing in for the collector; keeps every span
    by (trace id, span id), and counts duplicates."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: dict[tuple[bytes, bytes], trace_pb2.Span] = {}
        self.duplicates = 0
        self.rx = OtlpReceiver(config.OtlpConfig(grpc_port=0, http_port=0,
                                                 max_message_bytes=64 * 1024 * 1024), self.take)

    def take(self, req: ExportTraceServiceRequest, peer=None) -> int:
        n = 0
        with self.lock:
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        key = (sp.trace_id, sp.span_id)
                        self.duplicates += key in self.spans
                        self.spans[key] = sp
                        n += 1
        return n

    def count(self) -> int:
        with self.lock:
            return len(self.spans)


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def agent(tmp_path):
    """A Daemon whose span path and admin socket run (no probes: kernel
    events go in through the daemon's own event sink, as a probe reader's do)."""
    up = Upstream()
    up.rx.start()
    cfg = config.load(env={}, overrides=[
        f"data_dir={tmp_path}", "store.enabled=false", "tc.enabled=false",
        "sandbox.enabled=false", "gpu.enabled=false", "nvml.enabled=false",
        "http_port=0", "otlp.grpc_port=0", "otlp.http_port=0",
        f"otlp.max_message_bytes={MAX_BYTES}",
        f"otlp.upstream_endpoint=http://127.0.0.1:{up.rx.http_port}",
        "otlp.upstream_protocol=http/protobuf", "otlp.batch_interval_s=0.05",
        "otlp.queue_size=1000000", "join.ttl_s=3600", f"admin_socket={tmp_path}/admin.sock"])
    d = Daemon(cfg)
    d.spans.join.facts = FakeFacts()       # the kernel's span facts map, played by the test
    d.spans.start()
    d.admin.start()
    try:
        yield d, up
    finally:
        d.admin.stop()
        d.spans.stop(time.monotonic() + 5)
        up.rx.stop(0)


# ---------------------------------------------------------------------------
# legitimate spans with kernel facts

@dataclass
class Legit:
    trace_id: bytes
    span_id: bytes
    span: trace_pb2.Span
    launches: int
    launch_ns: int
    sync_wait_ns: int
    syncs: int = 0
    events: list = field(default_factory=list)

    def expected_kernel(self) -> dict[str, int]:
        facts = {"launches": self.launches, "launch_ns": self.launch_ns,
                 "sync_wait_ns": self.sync_wait_ns, "syncs": self.syncs}
        return {attr: facts[name] for attr, name in FACT_ATTRIBUTES if facts.get(name)}


def kernel_event(cls, kind, trace_id: bytes, span_id: bytes, duration_ns: int,
                 clock: events.MonotonicClock) -> events._Event:
    """Encoded as the kernel writes it, decoded by the agent's own decoder."""
    ev = cls()
    ev.hdr.ts_ns = time.monotonic_ns()
    ev.hdr.pid = ev.hdr.tid = 4242
    ev.hdr.kind = kind
    ev.hdr.span_id = int.from_bytes(span_id, "big")
    for i, b in enumerate(trace_id):
        ev.hdr.trace_id[i] = b
    ev.duration_ns = duration_ns
    if kind == events.Kind.GPU_LAUNCH:
        ev.entry = events.Entry.cuLaunchKernel
        ev.api = events.Api.driver
    else:
        ev.entry = events.Entry.cuStreamSynchronize
        ev.api = events.Api.driver
    return events.decode(bytes(ev), clock)


def make_legit(rnd: random.Random, i: int, clock) -> Legit:
    trace_id, span_id = rnd.randbytes(15) + b"\x01", rnd.randbytes(7) + b"\x01"
    now = time.time_ns()
    span = trace_pb2.Span(trace_id=trace_id, span_id=span_id, name=f"legit-{i}",
                          kind=trace_pb2.Span.SPAN_KIND_SERVER,
                          start_time_unix_nano=now - 50_000_000, end_time_unix_nano=now)
    span.attributes.add(key="legit.index").value.int_value = i
    span.attributes.add(key="mm.modality").value.string_value = "text"
    span.attributes.add(key="note").value.string_value = f"mine-{i}-" + "x" * (i % 7)
    lg = Legit(trace_id, span_id, span, launches=i % 5 + 1, launch_ns=0, sync_wait_ns=0)
    for k in range(lg.launches):
        d = 1000 * (i + 1) + k
        lg.launch_ns += d
        lg.events.append(kernel_event(events.GpuLaunch, events.Kind.GPU_LAUNCH, trace_id, span_id,
                                      d, clock))
    for k in range(i % 3):
        d = 7_000 + i * 10 + k
        lg.sync_wait_ns += d
        lg.syncs += 1
        lg.events.append(kernel_event(events.GpuSync, events.Kind.GPU_SYNC, trace_id, span_id,
                                      d, clock))
    return lg


def kernel_saw(d: Daemon, lg: Legit) -> None:
    """What the kernel does before the span ends: its facts row, and its
    records on the sampled side stream."""
    d.spans.join.facts.add(lg.trace_id, int.from_bytes(lg.span_id, "big"), driver=lg.launches,
                           launch_ns=lg.launch_ns, sync_wait_ns=lg.sync_wait_ns, syncs=lg.syncs)
    for ev in lg.events:
        d.sink(ev)


def request_of(spans: list[trace_pb2.Span], service: str = "legit-svc") -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = service
    ss = rs.scope_spans.add()
    ss.scope.name = "hostile.test"
    for s in spans:
        ss.spans.add().CopyFrom(s)
    return req


# ---------------------------------------------------------------------------
# hostile payloads: (transport, kind, payload, extra, expected outcome)

def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def field_len(num: int, payload: bytes) -> bytes:
    return varint(num << 3 | 2) + varint(len(payload)) + payload


def nested_request(depth: int, array: bool) -> bytes:
    """One span whose attribute is an AnyValue `depth` kvlists (or arrays)
    deep, encoded by hand: the protobuf library will not build it."""
    value = field_len(1, b"leaf")                       # AnyValue.string_value
    for _ in range(depth):
        if array:
            value = field_len(5, field_len(1, value))   # AnyValue.array_value{values}
        else:                                           # AnyValue.kvlist_value{values{key, value}}
            value = field_len(6, field_len(1, field_len(1, b"k") + field_len(2, value)))
    attribute = field_len(1, b"deep") + field_len(2, value)
    span = field_len(1, bytes(range(1, 17))) + field_len(2, bytes(range(1, 9))) + field_len(9, attribute)
    return field_len(1, field_len(2, field_len(2, span)))


def id_ok(s) -> bool:
    return (len(s.trace_id) == 16 and any(s.trace_id) and len(s.span_id) == 8 and any(s.span_id)
            and len(s.parent_span_id) in (0, 8))


def outcome_of(payload: bytes) -> tuple[str, int, int]:
    """What the OTLP rules say the agent must answer: (outcome, valid spans,
    rejected spans), judged by the protobuf parser and the id rules."""
    try:
        req = ExportTraceServiceRequest.FromString(payload)
    except Exception:
        return "invalid", 0, 0
    spans = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    good = sum(1 for s in spans if id_ok(s))
    bad = len(spans) - good
    return ("partial" if bad else "ok"), good, bad


def garbage_span(rnd: random.Random, *, valid_ids: bool, absurd: bool = False,
                 huge: int = 0) -> trace_pb2.Span:
    if valid_ids:
        tid, sid = rnd.randbytes(15) + b"\x02", rnd.randbytes(7) + b"\x02"
    else:
        tid, sid = rnd.choice([
            (rnd.randbytes(rnd.choice([0, 1, 15, 17, 32])), rnd.randbytes(8)),
            (rnd.randbytes(16), rnd.randbytes(rnd.choice([0, 1, 7, 9, 16]))),
            (bytes(16), rnd.randbytes(8)), (rnd.randbytes(16), bytes(8))])
    s = trace_pb2.Span(trace_id=tid, span_id=sid, name="garbage",
                       kind=trace_pb2.Span.SPAN_KIND_SERVER)
    if not valid_ids and rnd.random() < 0.3:
        s.parent_span_id = rnd.randbytes(rnd.choice([1, 4, 12]))
    if absurd:
        s.start_time_unix_nano, s.end_time_unix_nano = rnd.choice([
            (2**64 - 1, 0), (0, 2**64 - 1), (2**64 - 1, 2**64 - 1), (5, 3), (0, 0),
            (time.time_ns(), time.time_ns() - 10**18)])
        s.attributes.add(key="mm.modality").value.string_value = rnd.choice(["text", "\x00", "q" * 300])
        s.attributes.add(key="gen_ai.server.time_to_first_token").value.double_value = \
            rnd.choice([math.nan, math.inf, -1.0, 1e308])
        s.attributes.add(key="slo.class").value.string_value = rnd.choice(["gold", "z" * 1000])
        s.attributes.add(key="kernel.gpu.launches").value.int_value = 10**9   # a forged fact
    if huge:
        s.attributes.add(key="huge").value.string_value = "h" * huge
        s.attributes.add(key="blob").value.bytes_value = rnd.randbytes(huge // 4)
    return s


@dataclass
class Item:
    transport: str     # grpc | http | raw
    kind: str
    payload: bytes
    outcome: str       # the receiver's counter this must land in
    valid: int = 0     # spans accepted
    rejected: int = 0  # spans rejected (bad ids)
    headers: dict = field(default_factory=dict)
    legit: list = field(default_factory=list)   # Legit spans carried


MALFORMED_HTTP = [
    b"POST /v1/traces HTTX/1.1\r\n\r\n",                          # not a version
    b"BREW /v1/traces HTTP/1.1\r\n\r\n",                          # no such method
    b"POST /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",             # request line too long
    b"POST /v1/traces HTTP/1.1\r\nX: " + b"b" * 70_000 + b"\r\n\r\n",   # header line too long
    b"POST /v1/traces HTTP/1.1\r\n" + b"X-A: 1\r\n" * 120 + b"\r\n",    # too many headers
    b"POST /v1/traces HTTP/2.0\r\n\r\n",                          # a version we do not speak
]


def hostile_items(rnd: random.Random, legit: list[Legit]) -> list[Item]:
    valid_req = request_of([garbage_span(rnd, valid_ids=True) for _ in range(6)]).SerializeToString()
    items: list[Item] = []

    def proto(transport, kind, payload, **kw):
        outcome, good, bad = outcome_of(payload)
        items.append(Item(transport, kind, payload, outcome, good, bad, **kw))

    both = ("grpc", "http")
    for i in range(3900):                     # random bytes
        proto(both[i % 2], "random", rnd.randbytes(rnd.randrange(0, 4096)))
    for i in range(2000):                     # truncated valid messages
        proto(both[i % 2], "truncated", valid_req[:rnd.randrange(1, len(valid_req))])
    for i in range(500):                      # AnyValue nested hundreds to thousands deep
        proto(both[i % 2], "nested", nested_request(rnd.choice([101, 500, 2000, 5000]), array=i % 4 < 2))
    for i in range(300):                      # huge attribute values, under the size limit
        spans = [garbage_span(rnd, valid_ids=(i % 10 == 0), huge=rnd.randrange(20_000, 60_000))]
        proto(both[i % 2], "huge_attribute", request_of(spans, "garbage").SerializeToString())
    for i in range(1500):                     # trace/span ids of the wrong length or zero
        spans = [garbage_span(rnd, valid_ids=False) for _ in range(rnd.randrange(1, 5))]
        proto(both[i % 2], "bad_ids", request_of(spans, "garbage").SerializeToString())
    for i in range(500):                      # absurd timestamps and attribute values
        spans = [garbage_span(rnd, valid_ids=rnd.random() < 0.7, absurd=True)
                 for _ in range(rnd.randrange(1, 4))]
        proto(both[i % 2], "absurd", request_of(spans, "garbage").SerializeToString())
    for i in range(200):                      # a legit span's id under another trace id
        target = legit[i % len(legit)]
        s = garbage_span(rnd, valid_ids=True, absurd=True)
        s.span_id = target.span_id
        proto(both[i % 2], "impostor", request_of([s], "garbage").SerializeToString())
    for i in range(500):                      # wrong content types (JSON is not served)
        ctype = ["application/json", "text/plain", "", "application/x-protobuf-json",
                 "multipart/form-data"][i % 5]
        body = b'{"resourceSpans": []}' if "json" in ctype else rnd.randbytes(100)
        items.append(Item("http", "content_type", body, "unsupported_media_type",
                          headers={"Content-Type": ctype}))
    for i in range(100):                      # over the size limit
        body = rnd.randbytes(MAX_BYTES + 1 + rnd.randrange(0, 4096))
        items.append(Item(both[i % 2], "oversized", body, "too_large" if i % 2 else "not_received"))
    for i in range(100):                      # a few KiB inflating past the limit
        bomb = bytes(MAX_BYTES * rnd.choice([2, 16]))
        if i % 2:
            items.append(Item("http", "gzip_bomb", gzip.compress(bomb), "too_large",
                              headers={"Content-Encoding": "gzip"}))
        else:                                 # gRPC message compression: grpc inflates it
            items.append(Item("grpc", "gzip_bomb", bomb, "not_received"))
    for i in range(100):                      # gRPC: a call that sends no message
        items.append(Item("grpc", "no_message", b"", "not_received"))
    for i in range(300):                      # not HTTP, or HTTP that h11 or the receiver refuses
        items.append(Item("raw", "malformed_http", MALFORMED_HTTP[i % len(MALFORMED_HTTP)],
                          "malformed_http"))
    assert len(items) == N_HOSTILE
    return items


def legit_items(rnd: random.Random, legit: list[Legit]) -> list[Item]:
    """Half alone in their request, half mixed with rejected and accepted garbage spans."""
    out = []
    for i, lg in enumerate(legit):
        spans = [lg.span]
        if i % 2:
            spans = [garbage_span(rnd, valid_ids=False), lg.span,
                     garbage_span(rnd, valid_ids=True, absurd=True),
                     garbage_span(rnd, valid_ids=False, huge=5000)]
            rnd.shuffle(spans)
        payload = request_of(spans).SerializeToString()
        outcome, good, bad = outcome_of(payload)
        out.append(Item("grpc" if i % 4 < 2 else "http", "legit", payload, outcome, good, bad,
                        legit=[lg]))
    return out


# ---------------------------------------------------------------------------
# delivery

GRPC_CODES = {"invalid": grpc.StatusCode.INVALID_ARGUMENT,
              "not_received": grpc.StatusCode.RESOURCE_EXHAUSTED}
HTTP_STATUS = {"ok": 200, "partial": 200, "invalid": 400, "too_large": 413,
               "unsupported_media_type": 415}


class Sender:
    """Delivers a list of items over one gRPC channel, one keep-alive HTTP
    connection and fresh raw sockets; checks each answer."""

    def __init__(self, grpc_port: int, http_port: int):
        self.channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=CHANNEL_OPTIONS)
        self.export = self.channel.unary_unary(TRACES_GRPC_METHOD)
        self.stream = self.channel.stream_unary(TRACES_GRPC_METHOD)
        self.http_port = http_port
        self.conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)

    def close(self) -> None:
        self.channel.close()
        self.conn.close()

    def send(self, it: Item) -> None:
        getattr(self, "_" + it.transport)(it)

    def _grpc(self, it: Item) -> None:
        try:
            if it.kind == "no_message":
                answer = self.stream(iter(()), timeout=60)
            else:
                answer = self.export(it.payload, timeout=60, compression=(
                    grpc.Compression.Gzip if it.kind == "gzip_bomb" else None))
        except grpc.RpcError as e:
            code = grpc.StatusCode.INVALID_ARGUMENT if it.kind == "no_message" else \
                GRPC_CODES.get(it.outcome)
            assert e.code() == code, (it.kind, e.code(), e.details())
            return
        assert it.outcome in ("ok", "partial"), (it.kind, it.outcome, "answered OK")
        resp = ExportTraceServiceResponse.FromString(answer)
        assert resp.partial_success.rejected_spans == it.rejected, it.kind

    def _http(self, it: Item) -> None:
        headers = {"Content-Type": "application/x-protobuf", **it.headers}
        if not headers["Content-Type"]:
            del headers["Content-Type"]
        for attempt in range(2):
            try:
                self.conn.request("POST", "/v1/traces", body=it.payload, headers=headers)
                resp = self.conn.getresponse()
                body = resp.read()
                break
            except (ConnectionError, http.client.HTTPException):
                # the server closes after an unread body (413, 400 ...); http.client
                # may find out only on the next request: that request is resent
                self.conn.close()
                assert attempt == 0, it.kind
        if resp.getheader("Connection", "").lower() == "close":
            self.conn.close()
        assert resp.status == HTTP_STATUS[it.outcome], (it.kind, resp.status, body[:200])
        if resp.status == 200:
            resp_pb = ExportTraceServiceResponse.FromString(body)
            assert resp_pb.partial_success.rejected_spans == it.rejected, it.kind
        else:
            assert status_pb2.Status.FromString(body).message, it.kind

    def _raw(self, it: Item) -> None:
        answer = b""
        with socket.create_connection(("127.0.0.1", self.http_port), timeout=60) as s:
            try:
                s.sendall(it.payload)
                s.shutdown(socket.SHUT_WR)
                while chunk := s.recv(65536):
                    answer += chunk
            except ConnectionResetError:
                # the server answers before reading a too-long line, then closes
                # with it unread: the kernel may reset before we read the answer
                return
        head, _, body = answer.partition(b"\r\n\r\n")
        assert int(head.split(b" ", 2)[1]) in (400, 414, 431, 501, 505), answer[:100]
        assert status_pb2.Status.FromString(body).message.startswith("malformed HTTP request")


def deliver(d: Daemon, batches: list[list[Item]]) -> None:
    rx = d.spans.receiver
    errors: list[BaseException] = []

    def run(items: list[Item]) -> None:
        sender = Sender(rx.grpc_port, rx.http_port)
        try:
            for it in items:
                sender.send(it)
        except BaseException as e:   # reported by the main thread
            errors.append(e)
        finally:
            sender.close()

    threads = [threading.Thread(target=run, args=(b,)) for b in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a sender hung"
    if errors:
        raise errors[0]


def one_legit_export_per_transport(d: Daemon, rnd: random.Random, clock,
                                   first_index: int = 0) -> list[Legit]:
    """Two spans with kernel facts, one exported over gRPC, one over HTTP;
    each answer checked (a plain success)."""
    legit = [make_legit(rnd, first_index + k, clock) for k in range(2)]
    for lg in legit:
        kernel_saw(d, lg)
    sender = Sender(d.spans.receiver.grpc_port, d.spans.receiver.http_port)
    try:
        for transport, lg in zip(("grpc", "http"), legit):
            sender.send(Item(transport, "legit", request_of([lg.span]).SerializeToString(), "ok"))
    finally:
        sender.close()
    return legit


def expected_counts(items: list[Item]) -> tuple[dict, int, int]:
    requests: dict[str, dict[str, int]] = {"grpc": {}, "http": {}}
    accepted = rejected = 0
    for it in items:
        transport = "http" if it.transport in ("http", "raw") else "grpc"
        requests[transport][it.outcome] = requests[transport].get(it.outcome, 0) + 1
        accepted += it.valid
        rejected += it.rejected
    return requests, accepted, rejected


def kernel_attrs(span) -> dict[str, int]:
    return {kv.key: kv.value.int_value for kv in span.attributes if kv.key.startswith("kernel.")}


# ---------------------------------------------------------------------------

def test_ten_thousand_hostile_payloads_crash_nothing_count_everything_attribute_exactly(agent):
    d, up = agent
    rnd = random.Random(20240808)
    clock = events.MonotonicClock()
    legit = [make_legit(rnd, i, clock) for i in range(N_LEGIT)]
    for lg in legit:                       # the kernel saw them before their spans end
        kernel_saw(d, lg)
    assert d.spans.join.pending_events() == sum(len(lg.events) for lg in legit)

    hostile = hostile_items(rnd, legit)
    good = legit_items(rnd, legit)
    rnd.shuffle(hostile)
    # every 50th request is a legit one, spread over 4 senders (2 gRPC-first, 2 HTTP-first)
    stream: list[Item] = []
    for i, it in enumerate(hostile):
        stream.append(it)
        if i % 50 == 0 and good:
            stream.append(good.pop())
    assert not good
    batches = [stream[k::4] for k in range(4)]
    t0 = time.monotonic()
    deliver(d, batches)
    elapsed = time.monotonic() - t0

    requests, accepted, rejected = expected_counts(stream)
    rx = d.spans.receiver
    # gRPC calls that grpc itself ended are counted when their handler sees the end
    try:
        wait_for(lambda: rx.stats()["requests"] == requests, 30, "every request counted")
    finally:
        assert rx.stats()["requests"] == requests
    st = rx.stats()
    assert st["spans_accepted"] == accepted
    assert sum(st["spans_rejected"].values()) == rejected
    assert set(st["spans_rejected"]) <= {"trace_id_missing", "trace_id_length", "span_id_missing",
                                         "span_id_length", "parent_span_id_length"}
    assert requests["grpc"]["invalid"] > 2000 and requests["http"]["malformed_http"] == 300

    # after the storm: one more valid export on each transport is processed correctly
    legit += one_legit_export_per_transport(d, rnd, clock, first_index=N_LEGIT)
    accepted += 2

    # upstream got every accepted span once, legit ones exactly as sent plus their own facts
    wait_for(lambda: up.count() >= accepted, 60, "every accepted span exported")
    assert up.count() == accepted and up.duplicates == 0
    for lg in legit:
        got = up.spans[(lg.trace_id, lg.span_id)]
        own = [kv for kv in got.attributes if not kv.key.startswith("kernel.")]
        assert own == list(lg.span.attributes), lg.span.name
        assert kernel_attrs(got) == lg.expected_kernel(), lg.span.name
        assert len(got.events) == len(lg.events)
        assert (got.name, got.start_time_unix_nano, got.end_time_unix_nano) == \
            (lg.span.name, lg.span.start_time_unix_nano, lg.span.end_time_unix_nano)
    legit_keys = {(lg.trace_id, lg.span_id) for lg in legit}
    for key, sp in up.spans.items():
        if key in legit_keys:
            continue
        # garbage never gets kernel facts or events: its forged kernel.* value is passed on untouched
        assert not sp.events and kernel_attrs(sp) in ({}, {"kernel.gpu.launches": 10**9})
    assert d.spans.join.pending_events() == 0
    assert d.spans.join.stats.spans_joined == len(legit)

    # the rest of the agent is intact: metrics render, inspect answers with the same counts
    families = d.metrics.families()
    for fam in families:
        for s in fam.samples:
            value = s.value if hasattr(s, "value") else s.sum
            assert math.isfinite(value) and (fam.type != "counter" or value >= 0), (fam.name, s)
    assert b"spanlet_request_duration_seconds" in generate_latest(d.registry)
    answer = inspect_mod.ask(str(d.cfg.admin_socket), "summary")
    rx_view = next(x for x in answer["data"]["exporters"] if x["name"] == "otlp_receiver")
    assert rx_view["stats"]["requests"]["grpc"] == rx.stats()["requests"]["grpc"]
    assert rx_view["stats"]["requests"]["http"] == rx.stats()["requests"]["http"]
    spans_view = inspect_mod.ask(str(d.cfg.admin_socket), "spans", {"limit": 1000})
    assert len(spans_view["data"]["spans"]) == min(512, accepted)
    print(f"\n{N_HOSTILE + len(legit)} requests in {elapsed:.1f} s over 4 senders")


def test_slow_senders_and_connection_floods_cannot_stall_the_receiver(agent):
    """Calls that never finish their message are cut at the request deadline
    (their gRPC workers and HTTP threads freed) and counted; HTTP
    connections past the cap are closed at once and counted."""
    d, up = agent
    rx = d.spans.receiver
    rx.request_timeout_s = 1.0
    rx.max_http_connections = 8
    stop = threading.Event()

    def never():
        stop.wait(60)
        yield b""                         # pragma: no cover (cancelled first)

    channel = grpc.insecure_channel(f"127.0.0.1:{rx.grpc_port}", options=CHANNEL_OPTIONS)
    socks = []
    try:
        stalled = [channel.stream_unary(TRACES_GRPC_METHOD).future(never()) for _ in range(8)]
        # HTTP: 8 connections (the cap) sending half a request line, and 3 more
        for _ in range(8):
            s = socket.create_connection(("127.0.0.1", rx.http_port), timeout=30)
            s.sendall(b"POST /v1/tra")
            socks.append(s)
        wait_for(lambda: len(rx._httpd._conns) == 8, 10, "8 HTTP connections open")
        extra = [socket.create_connection(("127.0.0.1", rx.http_port), timeout=30) for _ in range(3)]
        for s in extra:                   # closed at once, without an answer
            assert s.recv(100) == b""
            s.close()
        # every stalled call and connection is cut at its deadline ...
        for f in stalled:
            with pytest.raises(grpc.RpcError) as e:
                f.result(timeout=30)
            assert e.value.code() == grpc.StatusCode.CANCELLED
        for s in socks:
            s.settimeout(30)
            assert s.recv(100) == b""
        wait_for(lambda: rx.stats()["requests"]["http"].get("timeout") == 8, 10, "HTTP timeouts counted")
        wait_for(lambda: rx.stats()["requests"]["grpc"].get("timeout") == 8, 10, "gRPC timeouts counted")
        assert rx.stats()["requests"]["http"]["too_many_connections"] == 3
        # ... and the receiver serves both transports again
        lg = one_legit_export_per_transport(d, random.Random(9), events.MonotonicClock())
        wait_for(lambda: up.count() == 2, 30, "the two spans exported")
        for x in lg:
            assert kernel_attrs(up.spans[(x.trace_id, x.span_id)]) == x.expected_kernel()
        assert rx.stats()["requests"]["grpc"]["ok"] == 1 and rx.stats()["requests"]["http"]["ok"] == 1
    finally:
        stop.set()
        for s in socks:
            s.close()
        channel.close()
