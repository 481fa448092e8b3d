"""The C reading of a resource's bytes that spares the serving metrics a
Python look at each span (spanlet._wire.serving_spans): the spans it names
are exactly those of SERVER kind or with events, and the metrics made with
it equal those made span by span, on random resources (many seeds)."""

import random

import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

import spanlet.metrics.serving as serving
from spanlet.config import ServingSettings
from spanlet.metrics.serving import ServingMetrics
from spanlet._wire import serving_spans   # built by every build of the package
from wire_gen import resource, serving_oracle

@pytest.mark.parametrize("seed", range(30))
def test_the_spans_named_are_the_requests_and_spans_with_events(seed):
    rng = random.Random(seed)
    rs = resource(rng, triggers=False)
    assert serving_spans(rs.SerializeToString()) == serving_oracle(rs)


def test_bytes_not_well_formed_are_none():
    blob = resource(random.Random(1), triggers=False).SerializeToString()
    assert serving_spans(blob[:-3]) is None
    assert serving_spans(b"\x12\x05\x12\x10abc") is None
    assert serving_spans(b"") == []


@pytest.mark.parametrize("seed", range(20))
def test_metrics_with_the_c_reading_equal_those_span_by_span(seed, monkeypatch):
    rng = random.Random(seed)
    batches = [[resource(rng, triggers=rng.random() < 0.3) for _ in range(rng.randrange(1, 4))]
               for _ in range(6)]
    fast = ServingMetrics(ServingSettings(), start=0.0)
    for i, b in enumerate(batches):
        fast.observe(b, float(i), [rs.SerializeToString() if k % 2 else None for k, rs in enumerate(b)])
    monkeypatch.setattr(serving, "_serving_spans", None)
    slow = ServingMetrics(ServingSettings(), start=0.0)
    for i, b in enumerate(batches):
        slow.observe(b, float(i))
    for m in (fast, slow):
        m.roll(10.0)
    assert repr(fast.families()) == repr(slow.families())
    assert any(f.samples for f in slow.families())


def test_the_last_kind_of_a_span_wins_and_is_read_as_32_bits_as_a_parse_keeps():
    """Found by the differential fuzzing (test_wire_differential.py): a span
    whose kind comes twice is of the last one."""
    span = trace_pb2.Span(name="s").SerializeToString()
    for extra, server in ((b"\x30\x02\x30\x03", False), (b"\x30\x03\x30\x02", True),
                          (b"\x30\x82\x80\x80\x80\x10", True)):        # 2 + 2**32: an int32 of 2
        scope = b"\x12" + bytes([len(span + extra)]) + span + extra      # ScopeSpans.spans
        blob = b"\x12" + bytes([len(scope)]) + scope                        # ResourceSpans.scope_spans
        assert trace_pb2.ResourceSpans.FromString(blob).scope_spans[0].spans[0].kind == (2 if server else 3)
        assert serving_spans(blob) == ([(0, 0)] if server else [])
