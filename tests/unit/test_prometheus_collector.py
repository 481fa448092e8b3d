"""The Prometheus collector on fake sources: names, labels, values, histogram
buckets, and a failing source that never fails the scrape."""



from spanlet import events
from spanlet.probes.tc.flows import JitterStats
from collector_fakes import FakeProbe, registry, sources

M = events.Modality
A = events.Api


def test_kernel_metrics_with_workload_labels():
    buckets = [0] * 32
    buckets[12] = 2      # two waits under 2^12 µs
    gpu = FakeProbe("gpu_launch",
                    launches=lambda: {(11, M.image, A.driver): 5, (11, M.image, A.runtime): 3,
                                      (12, M.audio, A.driver): 1},
                    sync_wait=lambda: {(11, M.image, A.runtime): (2, 5_000_000)},
                    sync_wait_buckets=lambda: {(11, M.image, A.runtime): buckets})
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
