"""The request anatomy's histograms (spanlet_request_cpu_seconds,
spanlet_request_runqueue_seconds) from requests' kernel.request.* totals:
exact buckets read back through the Prometheus collector, exemplars with the
latest request of each bucket in the OpenMetrics exposition (byte for byte
prometheus_client's, readable by its parser) and in the OTLP export, none in
the text format 0.0.4, and the scraper's Accept header choosing between them."""

from __future__ import annotations

import math
from typing import Callable

import pytest
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from spanlet.config import ServingSettings
from spanlet.exporters.otlp.metric_exporter import families_to_request
from spanlet.exporters.prometheus import SpanletCollector, SpanletRegistry, exposition
from spanlet.metrics import Exemplar, Family, HistogramSample, Sample, labels
from spanlet.metrics.serving import REQUEST_CPU_BOUNDS_S, REQUEST_RUNQUEUE_BOUNDS_S, ServingMetrics
from collector_fakes import engine, every_source

SERVER = trace_pb2.Span.SPAN_KIND_SERVER
INTERNAL = trace_pb2.Span.SPAN_KIND_INTERNAL
T0 = 1_700_000_000_000_000_000
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
SERIES = {"node": "n1", "namespace": "ns", "pod": "pod-a", "modality": "audio", "slo_class": "gold"}


class Wall:
    """A wall clock the test sets."""

    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Families:
    """An engine whose families are what `families()` gives (the serving metrics', a list)."""

    def __init__(self, families: Callable[[], list[Family]]):
        self.families = families


def request(n: int, kind=SERVER, **attrs) -> trace_pb2.Span:
    s = trace_pb2.Span(trace_id=bytes([n]) * 16, span_id=bytes([n]) * 8, kind=kind, name="infer",
                       start_time_unix_nano=T0, end_time_unix_nano=T0 + 50_000_000)
    s.attributes.add(key="mm.modality").value.string_value = "audio"
    s.attributes.add(key="slo.class").value.string_value = "gold"
    for key, value in attrs.items():
        kv = s.attributes.add(key=key.replace("__", "."))
        if isinstance(value, float):
            kv.value.double_value = value
        elif isinstance(value, str):
            kv.value.string_value = value
        else:
            kv.value.int_value = value
    return s


def resource(*spans) -> trace_pb2.ResourceSpans:
    rs = trace_pb2.ResourceSpans()
    for k, v in (("k8s.namespace.name", "ns"), ("k8s.pod.name", "pod-a")):
        rs.resource.attributes.add(key=k).value.string_value = v
    rs.scope_spans.add().spans.extend(spans)
    return rs


def cpu(ns, rq=None, **more) -> dict:
    out = {"kernel__request__cpu_ns": ns, **more}
    if rq is not None:
        out["kernel__request__runqueue_ns"] = rq
    return out


@pytest.fixture
def wall():
    return Wall(1_700_000_100.25)


@pytest.fixture
def serving(wall):
    s = ServingMetrics(ServingSettings(), start=0.0, wall_clock=wall)
    s.observe([resource(request(1, **cpu(3_000_000, 200_000)),       # 3 ms, 0.2 ms
                        request(2, **cpu(3_000_000, 0)),             # 3 ms, a measured zero
                        request(3, **cpu(40_000_000, 7_000_000)),    # 40 ms, 7 ms
                        request(4),                                  # no totals: duration only
                        request(5, kind=INTERNAL, gen_ai__server__time_to_first_token=0.1,
                                **cpu(9_000_000, 9)))], now=1.0)             # not a request
    return s


def registry(serving: ServingMetrics) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(SpanletCollector(Families(serving.families), "n1"))
    return reg


def test_exact_buckets_of_requests_that_carry_totals(serving):
    value = registry(serving).get_sample_value
    assert value("spanlet_request_duration_seconds_count", SERIES) == 4
    # name: (count, sum, cumulative count per le)
    expected = {"spanlet_request_cpu_seconds": (3, 0.046, {"0.0025": 0, "0.005": 2, "0.025": 2,
                                                          "0.05": 3, "+Inf": 3}),
                "spanlet_request_runqueue_seconds": (3, 0.0072, {"0.0001": 1, "0.00025": 2,
                                                                "0.005": 2, "0.01": 3})}
    for name, (count, total, buckets) in expected.items():
        assert value(f"{name}_count", SERIES) == count
        assert value(f"{name}_sum", SERIES) == pytest.approx(total)
        assert {le: value(f"{name}_bucket", {**SERIES, "le": le}) for le in buckets} == buckets


def test_bad_totals_are_rejected_and_counted(wall):
    s = ServingMetrics(ServingSettings(), start=0.0, wall_clock=wall)
    s.observe([resource(request(1, **cpu(-5)), request(2, **cpu("lots")), request(3, **cpu(math.inf)),
                        request(4, **cpu(10**18)), request(6, **cpu(2_000_000.0)))], now=1.0)
    assert {k: v for k, v in s.rejected.items() if v} == {
        "negative_value": 1, "wrong_type": 1, "not_finite": 1, "out_of_range": 1}
    assert registry(s).get_sample_value("spanlet_request_cpu_seconds_count", SERIES) == 1


def cpu_family(serving: ServingMetrics) -> Family:
    return next(f for f in serving.families() if f.name == "spanlet_request_cpu_seconds")


def test_each_bucket_keeps_its_latest_request_as_exemplar(serving, wall):
    (h,) = cpu_family(serving).samples
    assert len(h.exemplars) == len(REQUEST_CPU_BOUNDS_S) + 1
    le_5ms = REQUEST_CPU_BOUNDS_S.index(0.005)
    le_50ms = REQUEST_CPU_BOUNDS_S.index(0.05)
    assert h.exemplars[le_5ms] == Exemplar(bytes([2]) * 16, bytes([2]) * 8, 0.003, wall.t)
    assert h.exemplars[le_50ms] == Exemplar(bytes([3]) * 16, bytes([3]) * 8, 0.04, wall.t)
    assert sum(e is not None for e in h.exemplars) == 2
    # a later request takes the bucket; a wall clock that steps back does not take the time back
    wall.t -= 100
    serving.observe([resource(request(7, **cpu(4_000_000)))], now=2.0)
    (h,) = cpu_family(serving).samples
    assert h.exemplars[le_5ms].trace_id == bytes([7]) * 16 and h.exemplars[le_5ms].time_s == wall.t + 100
    (rq,) = next(f for f in serving.families() if f.name == "spanlet_request_runqueue_seconds").samples
    assert rq.exemplars[REQUEST_RUNQUEUE_BOUNDS_S.index(0.01)].trace_id == bytes([3]) * 16


def test_exemplars_go_with_their_idle_series(serving):
    serving.roll(now=10.0)
    assert cpu_family(serving).samples
    serving.roll(now=10.0 + ServingSettings().series_idle_s + 5)
    anatomy = cpu_family(serving)
    assert not anatomy.samples and not serving.anatomy[0].exemplars


def both_openmetrics(eng, node="n1") -> tuple[bytes, bytes]:
    """(SpanletRegistry's OpenMetrics text, prometheus_client's of the collector)."""
    fast, slow = SpanletRegistry(), CollectorRegistry()
    fast.register(SpanletCollector(eng, node))
    slow.register(SpanletCollector(eng, node))
    return fast.text(openmetrics=True), openmetrics_latest(slow)


def test_openmetrics_text_is_prometheus_clients_byte_for_byte_with_exemplars(serving):
    fast, slow = both_openmetrics(Families(serving.families))
    assert fast == slow
    hexed = (bytes([3]) * 16).hex()
    assert (f'spanlet_request_cpu_seconds_bucket{{le="0.05",modality="audio",namespace="ns",node="n1",'
            f'pod="pod-a",slo_class="gold"}} 3.0 # {{trace_id="{hexed}"}} 0.04 1700000100.25\n').encode() in fast
    assert fast.endswith(b"# EOF\n")
    parsed = {f.name: f for f in parse_openmetrics(fast.decode())}
    buckets = [s for s in parsed["spanlet_request_cpu_seconds"].samples if s.exemplar is not None]
    assert {(s.labels["le"], s.exemplar.labels["trace_id"]) for s in buckets} == {
        ("0.005", (bytes([2]) * 16).hex()), ("0.05", hexed)}


def test_openmetrics_text_of_every_source_and_of_escapes_is_prometheus_clients():
    fast, slow = both_openmetrics(engine(every_source()))
    assert fast == slow and fast.count(b"\n") > 100
    assert b"# TYPE spanlet_network_bytes counter\n" in fast          # OpenMetrics counters
    e = Exemplar(b"\x01" * 16, b"\x02" * 8, 1e-7, 1_700_000_000.5)
    fams = [Family("spanlet_x_total", "counter", 'help "quoted" with \\ and\nnewline', samples=[
                Sample(labels(pod='a"b\\c\nd'), 3)]),
            Family("spanlet_h_seconds", "histogram", "h", samples=[
                HistogramSample(labels(pod="p"), (0.5, 1.0), (999_999, 1, 5), 7e5, 1_000_005, (e, None, e)),
                HistogramSample(labels(pod="q"), (0.5,), (1, 1), 1.0, 2)])]
    fast, slow = both_openmetrics(Families(lambda: fams), node='node "7"')
    assert fast == slow
    assert b'# HELP spanlet_x help \\"quoted\\" with \\\\ and\\nnewline\n' in fast


def test_the_text_format_stays_0_0_4_without_exemplars(serving):
    reg = SpanletRegistry()
    reg.register(SpanletCollector(Families(serving.families), "n1"))
    plain = CollectorRegistry()
    plain.register(SpanletCollector(Families(serving.families), "n1"))
    text = reg.text()
    assert text == generate_latest(plain) and b" # {" not in text and b"# EOF" not in text
    assert {f.name for f in parse_text(text.decode())} >= {"spanlet_request_cpu_seconds",
                                                           "spanlet_request_runqueue_seconds"}


@pytest.mark.parametrize("accept, openmetrics", [
    (PROMETHEUS_ACCEPT, True), ("application/openmetrics-text; version=1.0.0", True),
    ("text/plain;version=0.0.4;q=0.5,*/*;q=0.1", False), ("", False), ("*/*", False)])
def test_the_scrapers_accept_header_picks_the_format(serving, accept, openmetrics):
    reg = SpanletRegistry()
    reg.register(SpanletCollector(Families(serving.families), "n1"))
    body, ctype = exposition(reg, accept)
    assert ctype.startswith("application/openmetrics-text; version=1.0.0") == openmetrics
    assert ctype.startswith("text/plain") == (not openmetrics)
    assert (b' # {trace_id="' in body) == openmetrics
    other = CollectorRegistry()                     # not a SpanletRegistry: prometheus_client's
    other.register(SpanletCollector(Families(serving.families), "n1"))
    assert exposition(other, accept) == (body, ctype)


def test_otlp_histogram_points_carry_the_exemplars(serving, wall):
    req, _ = families_to_request(serving.families(), start_ns=1, now_ns=2, node="n1")
    (metric,) = [m for m in req.resource_metrics[0].scope_metrics[0].metrics
                 if m.name == "spanlet_request_cpu_seconds"]
    (point,) = metric.histogram.data_points
    got = sorted((e.trace_id, e.span_id, e.as_double, e.time_unix_nano) for e in point.exemplars)
    assert got == [(bytes([2]) * 16, bytes([2]) * 8, 0.003, round(wall.t * 1e9)),
                   (bytes([3]) * 16, bytes([3]) * 8, 0.04, round(wall.t * 1e9))]
