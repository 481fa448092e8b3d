# The upstream OTLP collector goes away for a stretch (compressed in time) under a steady span stream, over gRPC
# and over HTTP/protobuf, against a real OTLP receiver that comes back on the same port. While it is away the
# exporter holds no more than its queue bound (in spans, and in bytes) plus the batch it retries, and every
# span it could not keep is counted: offered = exported + dropped + queued + in flight, at every step. When the
# upstream returns, export resumes in the same exporter within a few retries, and no span it acknowledged
# arrives twice.
from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans

from spanlet.config import OtlpConfig
from spanlet.exporters.otlp.span_exporter import OtlpSpanExporter
from spanlet.exporters.otlp.upstream import GRPC, HTTP_PROTOBUF
from spanlet.exporters.otlp.receiver import OtlpReceiver

NO_PROXY = {"NO_PROXY": "*", "no_proxy": "*"}
SPANS_PER_STEP = 100
ATTRIBUTE_BYTES = 1000        # each span carries a payload of this size: about 1.1 kB serialized
BOUND_SPANS = 1000            # the bound that binds, in spans or in bytes (about the same memory)
BOUND_BYTES = 1_100_000
OUTAGE_STEPS = 1000           # 100k spans, about 110 MB serialized, offered while the upstream is away
PAYLOAD = "x" * ATTRIBUTE_BYTES


class RestartableUpstream:
    """A real OTLP receiver that can go away and come back on the same ports; counts every span id it took."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.received: Counter = Counter()
        self.requests = 0
        self.grpc_port = self.http_port = 0
        self.receiver: OtlpReceiver | None = None
        self.start()

    def __call__(self, request, peer=None) -> int:
        n = 0
        with self.lock:
            self.requests += 1
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.received[span.span_id] += 1
                        n += 1
        return n

    def start(self) -> None:
        self.receiver = OtlpReceiver(OtlpConfig(grpc_port=self.grpc_port, http_port=self.http_port), self)
        self.receiver.start()
        self.grpc_port, self.http_port = self.receiver.grpc_port, self.receiver.http_port

    def stop(self) -> None:
        self.receiver.stop(0)
        self.receiver = None

    def endpoint(self, protocol: str) -> str:
        return f"http://127.0.0.1:{self.grpc_port if protocol == GRPC else self.http_port}"


class SpanStream:
    """Offers SPANS_PER_STEP spans with fresh ids per step, and checks the exporter's books after each."""

    def __init__(self, exporter: OtlpSpanExporter) -> None:
        self.exporter = exporter
        self.offered_ids: list[bytes] = []
        self.rng = random.Random(5)
        self.max_queue_spans = self.max_queue_bytes = 0

    def step(self) -> None:
        rs = ResourceSpans()
        rs.resource.attributes.add(key="service.name").value.string_value = "frontend"
        ss = rs.scope_spans.add()
        for _ in range(SPANS_PER_STEP):
            sid = self.rng.randbytes(8)
            self.offered_ids.append(sid)
            span = ss.spans.add(name="POST /v1/audio", trace_id=self.rng.randbytes(16), span_id=sid)
            span.attributes.add(key="payload").value.string_value = PAYLOAD
        self.exporter.export([rs])
        st = self.exporter.stats()
        self.max_queue_spans = max(self.max_queue_spans, st["queue_spans"])
        self.max_queue_bytes = max(self.max_queue_bytes, st["queue_bytes"])
        assert len(self.offered_ids) == accounted(st), st

    def run(self, steps: int, period_s: float = 0.0) -> None:
        next_at = time.monotonic()
        for _ in range(steps):
            self.step()
            if period_s:
                next_at += period_s
                time.sleep(max(0.0, next_at - time.monotonic()))


def accounted(st: dict) -> int:
    """Every span the exporter was offered has exactly one place in its counters."""
    return (st["exported"] + st["rejected_upstream"] + st["dropped_queue_full"] + st["dropped_failed"]
            + st["dropped_shutdown"] + st["queue_spans"] + st["inflight_spans"])


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def upstream():
    up = RestartableUpstream()
    try:
        yield up
    finally:
        if up.receiver is not None:
            up.stop()


@pytest.mark.parametrize("protocol, bound", [(GRPC, "spans"), (HTTP_PROTOBUF, "bytes")])
def test_upstream_away_bounds_memory_counts_every_drop_and_resumes_without_duplicates(upstream, protocol, bound):
    cfg = OtlpConfig(upstream_endpoint=upstream.endpoint(protocol), upstream_protocol=protocol,
                     queue_size=BOUND_SPANS if bound == "spans" else 100 * BOUND_SPANS,
                     batch_size=200, batch_interval_s=0.02, max_retry_s=3600)
    exporter = OtlpSpanExporter(cfg, environ=NO_PROXY, initial_backoff_s=0.05, max_backoff_s=0.2,
                                queue_max_bytes=BOUND_BYTES if bound == "bytes" else 64 * BOUND_BYTES)
    try:
        stream = SpanStream(exporter)
        stream.run(5, 0.005)
        assert exporter.force_flush(20_000)
        assert exporter.stats()["exported"] == len(stream.offered_ids)

        # Away while nothing is in flight, so that no acknowledged request is cut short.
        upstream.stop()
        retries = exporter.stats()["retries"]
        stream.run(20, 0.005)
        wait_for(lambda: exporter.stats()["retries"] >= retries + 3, 30.0, "retries while the upstream is away")
        full = exporter.stats()
        assert full["dropped_queue_full"] > 0  # the queue reached its bound
        rss_full = rss_bytes()
        stream.run(OUTAGE_STEPS, 0.005)
        rss_growth = rss_bytes() - rss_full
        away = exporter.stats()
        offered_while_full = OUTAGE_STEPS * SPANS_PER_STEP * ATTRIBUTE_BYTES
        # Memory: the exporter's own queue never passed its bound, and the process did not keep what it dropped.
        if bound == "spans":
            assert stream.max_queue_spans == BOUND_SPANS
        else:
            assert BOUND_BYTES - 2 * ATTRIBUTE_BYTES * SPANS_PER_STEP < stream.max_queue_bytes <= BOUND_BYTES
        assert away["inflight_spans"] <= cfg.batch_size
        assert rss_growth < offered_while_full / 4, (rss_growth, offered_while_full)
        assert away["dropped_queue_full"] - full["dropped_queue_full"] == OUTAGE_STEPS * SPANS_PER_STEP
        assert away["dropped_failed"] == away["dropped_shutdown"] == 0

        # Back on the same port: the same exporter resumes within a few retries (not after the transport's own
        # reconnection backoff, which grows to minutes over a long outage).
        retries_at_return = away["retries"]
        upstream.start()
        wait_for(lambda: exporter.stats()["exported"] > away["exported"], 30.0, "export to resume")
        assert exporter.stats()["retries"] - retries_at_return <= 10
        stream.run(20, 0.005)
        assert exporter.force_flush(30_000)
        end = exporter.stats()
    finally:
        exporter.shutdown(timeout_millis=2000)

    assert end["queue_spans"] == end["inflight_spans"] == end["queue_bytes"] == 0
    assert len(stream.offered_ids) == accounted(end) == end["exported"] + end["dropped_queue_full"]
    with upstream.lock:
        received = dict(upstream.received)
    assert max(received.values()) == 1, "a span the upstream acknowledged was sent again"
    assert len(received) == end["exported"]
    assert set(received) <= set(stream.offered_ids)
