"""The C reading of a resource's bytes that spares the serving metrics a
Python look at each span (spanlet._wire.serving_spans): the spans it names
are exactly those of SERVER kind or with events, and the metrics made with
it equal those made span by span, on random resources (many seeds)."""

import random

import pytest
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

import spanlet.metrics.serving as serving
from spanlet.config import ServingSettings
from spanlet.metrics.serving import ServingMetrics
from spanlet._wire import serving_spans   # built by every build of the package

T0 = 1_700_000_000_000_000_000
KINDS = list(range(6))


def resource(rng: random.Random, triggers: bool) -> trace_pb2.ResourceSpans:
    rs = trace_pb2.ResourceSpans(resource=resource_pb2.Resource())
    kv = rs.resource.attributes.add(key="k8s.pod.name")
    kv.value.string_value = f"pod-{rng.randrange(3)}"
    for _ in range(rng.randrange(1, 4)):
        ss = rs.scope_spans.add()
        ss.scope.name = "s"
        for _ in range(rng.randrange(0, 40)):
            start = T0 + rng.randrange(10**9)
            sp = ss.spans.add(trace_id=rng.randbytes(16), span_id=rng.randbytes(8), kind=rng.choice(KINDS),
                              parent_span_id=rng.choice([b"", rng.randbytes(8)]),
                              flags=rng.choice([0, 0x100, 0x300]), start_time_unix_nano=start,
                              end_time_unix_nano=start + rng.randrange(1, 10**9),
                              name=rng.choice(["infer", "\x30\x02", "Z" * 11]))
            sp.attributes.add(key="mm.modality").value.string_value = rng.choice(["image", "text", "audio"])
            if triggers and rng.random() < 0.2:
                sp.attributes.add(key="gen_ai.usage.output_tokens").value.int_value = rng.randrange(100)
            if rng.random() < 0.15:
                sp.events.add(name=rng.choice(["first_token", "other"]), time_unix_nano=start + 5)
    return rs


@pytest.mark.parametrize("seed", range(30))
def test_the_spans_named_are_the_requests_and_spans_with_events(seed):
    rng = random.Random(seed)
    rs = resource(rng, triggers=False)
    want = [(i, j) for i, ss in enumerate(rs.scope_spans) for j, sp in enumerate(ss.spans)
            if sp.kind == trace_pb2.Span.SPAN_KIND_SERVER or len(sp.events)]
    assert serving_spans(rs.SerializeToString()) == want


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
