"""The default thresholds of METRICS.md, as the tests know them independently
of the agent's code (METRICS.md lives outside the repository)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Threshold:
    number: int           # row of METRICS.md
    metric: str           # exported family name
    alert: str
    op: str               # comparison that fires
    value: str            # the default, as written in the expr
    quantile: str = ""    # histograms: the quantile compared
    selector: str = ""    # a matcher the expr must carry (per-class defaults)


# Every row of METRICS.md with a default threshold (#1, #3 and #6 have none).
# METRICS.md lives outside the repository, so its numbers are copied here; a
# change of a default there must change this table and the rules together.
THRESHOLDS = [
    Threshold(2, "spanlet_gpu_sync_wait_seconds", "SpanletGpuSyncWaitP99High", ">", "0.05", "0.99"),
    Threshold(4, "spanlet_jitter_sensitivity_score", "SpanletJitterSensitivityHigh", ">", "0.08"),
    Threshold(5, "spanlet_sandbox_violations_total", "SpanletSandboxViolation", ">", "0"),
    # #7 is "<= 0.87 and >= 1.2 GiB free"; free memory is not exported, the rule keeps the ratio.
    Threshold(7, "spanlet_gpu_memory_peak_ratio", "SpanletGpuMemoryPeakHigh", ">", "0.87"),
    Threshold(8, "spanlet_gpu_pcie_utilization_ratio", "SpanletGpuPcieSaturated", ">", "0.85"),
    Threshold(9, "spanlet_request_duration_seconds", "SpanletRequestLatencyGold", ">", "0.2", "0.95",
              'slo_class="gold"'),
    Threshold(9, "spanlet_request_duration_seconds", "SpanletRequestLatencySilver", ">", "0.5", "0.95",
              'slo_class="silver"'),
    Threshold(9, "spanlet_request_duration_seconds", "SpanletRequestLatencyBronze", ">", "0.8", "0.95",
              'slo_class="bronze"'),
    Threshold(10, "spanlet_time_to_first_token_seconds", "SpanletTimeToFirstTokenHigh", ">", "0.4", "0.95"),
    Threshold(11, "spanlet_p99_latency_volatility_ratio", "SpanletLatencyVolatilityHigh", ">", "0.032"),
    Threshold(12, "spanlet_slo_compliance_ratio", "SpanletSloComplianceLowGold", "<", "0.95", "",
              'slo_class="gold"'),
    Threshold(12, "spanlet_slo_compliance_ratio", "SpanletSloComplianceLowSilver", "<", "0.85", "",
              'slo_class="silver"'),
    # Bronze has no objective in METRICS.md: 0.75 is this project's choice.
    Threshold(12, "spanlet_slo_compliance_ratio", "SpanletSloComplianceLowBronze", "<", "0.75", "",
              'slo_class="bronze"'),
    Threshold(13, "spanlet_throughput_decay_ratio", "SpanletThroughputDecayHigh", ">", "0.45"),
    Threshold(14, "spanlet_modality_alignment_delay_seconds", "SpanletModalityAlignmentDelayHigh",
              ">", "0.02", "0.95"),
    # "rate alert" without a number in METRICS.md: 0.05/s is this project's choice.
    Threshold(15, "spanlet_modality_degradations_total", "SpanletModalityDegradationRateHigh", ">", "0.05"),
    Threshold(16, "spanlet_embedding_drift_score", "SpanletEmbeddingDriftHigh", ">", "0.018"),
    Threshold(17, "spanlet_span_kernel_coverage_ratio", "SpanletSpanKernelCoverageLow", "<", "0.95"),
]


METRICS_WITH_THRESHOLD = {2, 4, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17}
