"""The Prometheus collector on fake sources: names, labels, values, histogram
buckets, a failing source that never fails the scrape, and the text of
/metrics written directly: the bytes generate_latest makes of the collector."""

import math

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from spanlet import events
from spanlet.exporters.prometheus import SpanletCollector, SpanletRegistry
from spanlet.metrics import Family, HistogramSample, Sample, labels
from spanlet.probes.tc.flows import JitterStats
from collector_fakes import FakeProbe, engine, every_source, registry, sources

M = events.Modality
A = events.Api


def test_kernel_metrics_with_workload_labels():
    buckets = [0] * 32
    buckets[12] = 2      # two waits under 2^12 µs
    gpu = FakeProbe("gpu_launch",
                    launches=lambda: {(11, M.image, A.driver): 5, (11, M.image, A.runtime): 3,
                                      (12, M.audio, A.driver): 1},
                    sync_waits=lambda: {(11, M.image, A.runtime): (2, 5_000_000, buckets)},
                    memcpy_bytes=lambda: {(11, "h2d"): 1 << 20, (11, "d2h"): 4096, (12, "other"): 7})
    tc = FakeProbe("tc_classify",
                   totals=lambda: {("ingress", "rtp", "audio"): (10, 1420)},
                   jitter=lambda: {("rtp", "audio"): JitterStats(100, 10, 0.1, 100, 10)},
                   rejected=lambda: {"traceparent_duplicate": 4, "rtp_invalid": 0},
                   uncounted=lambda: {"fragment": 3})
    sb = FakeProbe("mmap_sandbox", violations=lambda: {(11, "exec", "kill"): 1},
                   sweep_violations=lambda: {(11, "exec", "kill"): 2, (12, "unauthorized", "kill"): 1},
                   unresolved_opens=lambda: 6)
    reg = registry(sources([gpu, tc, sb]))
    w = {"node": "n1", "namespace": "serving", "pod": "pod-11", "container": "c"}
    # #5 counts what the sweep found too; the sweep's share is its own family
    assert reg.get_sample_value("spanlet_sandbox_violations_total",
                                {**w, "pod": "pod-12", "rule": "unauthorized", "action": "kill"}) == 1
    assert reg.get_sample_value("spanlet_sandbox_sweep_violations_total",
                                {**w, "rule": "exec", "action": "kill"}) == 2
    assert reg.get_sample_value("spanlet_sandbox_unresolved_opens_total", {"node": "n1"}) == 6
    assert reg.get_sample_value("spanlet_tc_rejected_total",
                                {"node": "n1", "reason": "traceparent_duplicate"}) == 4
    assert reg.get_sample_value("spanlet_tc_uncounted_packets_total",
                                {"node": "n1", "reason": "fragment"}) == 3
    assert reg.get_sample_value("spanlet_gpu_kernel_launches_total",
                                {**w, "modality": "image", "api": "driver"}) == 5
    assert reg.get_sample_value("spanlet_gpu_kernel_launches_total",
                                {**w, "pod": "pod-12", "modality": "audio", "api": "driver"}) == 1
    assert reg.get_sample_value("spanlet_gpu_memcpy_bytes_total", {**w, "direction": "h2d"}) == 1 << 20
    assert reg.get_sample_value("spanlet_gpu_memcpy_bytes_total", {**w, "direction": "d2h"}) == 4096
    assert reg.get_sample_value("spanlet_gpu_memcpy_bytes_total",
                                {**w, "pod": "pod-12", "direction": "other"}) == 7
    h = {**w, "modality": "image", "api": "runtime"}
    assert reg.get_sample_value("spanlet_gpu_sync_wait_seconds_count", h) == 2
    assert reg.get_sample_value("spanlet_gpu_sync_wait_seconds_sum", h) == 0.005
    assert reg.get_sample_value("spanlet_gpu_sync_wait_seconds_bucket", {**h, "le": "0.001024"}) == 0
    assert reg.get_sample_value("spanlet_gpu_sync_wait_seconds_bucket", {**h, "le": "0.004096"}) == 2
    net = {"node": "n1", "direction": "ingress", "protocol": "rtp", "modality": "audio"}
    assert reg.get_sample_value("spanlet_network_bytes_total", net) == 1420
    assert reg.get_sample_value("spanlet_network_packets_total", net) == 10
    assert reg.get_sample_value("spanlet_jitter_sensitivity_score",
                                {"node": "n1", "protocol": "rtp", "modality": "audio"}) == 0.1
    assert reg.get_sample_value("spanlet_sandbox_violations_total",
                                {**w, "rule": "exec", "action": "kill"}) == 3
    assert reg.get_sample_value("spanlet_probe_attached", {"node": "n1", "probe": "tc_classify"}) == 1
    assert reg.get_sample_value("spanlet_events_dropped_total", {"node": "n1", "probe": "gpu_launch"}) == 2
    assert reg.get_sample_value("spanlet_export_dropped_spans_total",
                                {"node": "n1", "reason": "queue_full"}) == 4
    assert reg.get_sample_value("spanlet_otlp_receiver_requests_total",
                                {"node": "n1", "transport": "grpc", "outcome": "invalid"}) == 1
    assert reg.get_sample_value("spanlet_otlp_receiver_rejected_spans_total",
                                {"node": "n1", "reason": "bad_span_id"}) == 2
    assert reg.get_sample_value("spanlet_otlp_receiver_accepted_spans_total", {"node": "n1"}) == 9
    for reason, n in (("socket", 5), ("pod_ip", 0), ("unknown", 3)):
        assert reg.get_sample_value("spanlet_otlp_receiver_sender_origins_total",
                                    {"node": "n1", "reason": reason}) == n


def test_a_failing_source_is_counted_and_the_rest_is_served():
    def broken():
        raise RuntimeError("map gone")

    gpu = FakeProbe("gpu_launch", launches=broken)
    sb = FakeProbe("mmap_sandbox", violations=lambda: {(0, "oversize", "audit"): 2})
    reg = registry(sources([gpu, sb]))
    errors = {"node": "n1", "source": "gpu_launch"}
    assert reg.get_sample_value("spanlet_scrape_errors_total", errors) == 1   # first scrape
    # cgroup id 0 (unknown): the workload labels stay empty
    assert reg.get_sample_value("spanlet_sandbox_violations_total",
                                {"node": "n1", "namespace": "", "pod": "", "container": "",
                                 "rule": "oversize", "action": "audit"}) == 2
    assert reg.get_sample_value("spanlet_scrape_errors_total", errors) == 3   # one per scrape
    assert reg.get_sample_value("spanlet_probe_attached", {"node": "n1", "probe": "gpu_launch"}) == 1


def test_no_nvml_means_no_device_metrics():
    reg = registry(sources([]))
    assert reg.get_sample_value("spanlet_nvml_available", {"node": "n1"}) == 0
    assert reg.get_sample_value("spanlet_gpu_utilization_ratio", {"node": "n1", "gpu": "x"}) is None


# ---- the text of /metrics, written directly ---------------------------------------

class FixedEngine:
    """An engine whose families are given (the collector and render_text read the same)."""

    def __init__(self, families):
        self._families = families

    def families(self):
        return list(self._families)


def both_texts(eng, node="n1") -> tuple[bytes, bytes]:
    """(what SpanletRegistry.text() serves, what generate_latest makes of the collector)."""
    fast, slow = SpanletRegistry(), CollectorRegistry()
    fast.register(SpanletCollector(eng, node))
    slow.register(SpanletCollector(eng, node))
    return fast.text(), generate_latest(slow)


def test_the_direct_text_is_generate_latest_byte_for_byte_on_every_source():
    eng = FixedEngine(engine(every_source()).families())
    fast, slow = both_texts(eng)
    assert fast == slow
    assert fast.count(b"\n") > 100


def test_the_direct_text_escapes_formats_and_orders_as_generate_latest():
    lab = labels(pod='a"b\\c\nd', api="driver", zone="z")
    fams = [
        Family("spanlet_x_total", "counter", 'help with \\ and\nnewline', samples=[
            Sample(lab, 1_234_567_890), Sample(labels(pod="p", api="a", zone=""), 0)]),
        Family("spanlet_g", "gauge", "g", samples=[
            Sample(labels(gpu="0"), 0.1), Sample(labels(gpu="1"), math.inf),
            Sample(labels(gpu="2"), -math.inf), Sample(labels(gpu="3"), math.nan),
            Sample(labels(gpu="4"), 1e-9), Sample(labels(gpu="5"), 12345678.5)]),
        Family("spanlet_empty", "gauge", "nothing yet"),
        Family("spanlet_h_seconds", "histogram", "h", samples=[
            HistogramSample(lab, (1e-6, 0.004, 2.0, 67.108864), (1, 0, 2, 3, 4), 12.5, 10),
            HistogramSample(labels(aa="1", zz="2"), (0.5,), (0, 0), 0.0, 0),
            HistogramSample(labels(aa="2"), (0.5, 1.0), (999_999, 1, 5), 7e5, 1_000_005),
            HistogramSample(labels(aa="3", le="x", zz="4"), (0.5,), (1, 1), 1.0, 2)]),   # more labels than the first
        Family("spanlet_h2", "histogram", "no bounds", samples=[
            HistogramSample(labels(x="1"), (), (3,), 1.5, 3)]),
    ]
    fast, slow = both_texts(FixedEngine(fams), node='node "7"')
    assert fast == slow
    assert b'pod="a\\"b\\\\c\\nd"' in fast and b"1.23456789e+09" in fast
    assert b" 1.000005e+06\n" in fast and b" 999999.0\n" in fast   # both int paths


def test_a_registry_holding_another_collector_falls_back_to_generate_latest():
    reg = SpanletRegistry()
    reg.register(SpanletCollector(FixedEngine([Family("spanlet_g", "gauge", "g", samples=[
        Sample(labels(gpu="0"), 1)])]), "n1"))
    other = Gauge("other_gauge", "another library's", registry=reg)
    other.set(3)
    assert reg.text() == generate_latest(reg)
    assert b"other_gauge 3.0" in reg.text()
    reg.unregister(other)
    assert b"other_gauge" not in reg.text()
