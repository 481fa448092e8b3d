"""Device-layer metrics (METRICS.md #6–#8) from the NVML poller; absent
without NVML. One function per metric, named after it."""

from __future__ import annotations

from spanlet.metrics import Family, Sample, labels
from spanlet.metrics.catalogue import family


def spanlet_gpu_utilization_ratio(nvml) -> Family:
    fam = family("spanlet_gpu_utilization_ratio")
    fam.samples = [Sample(labels(gpu=g), s.sm_utilization_ratio)
                   for g, s in sorted(nvml.snapshot().items()) if s.sm_utilization_ratio is not None]
    return fam


def spanlet_gpu_memory_peak_ratio(peaks: dict[str, float]) -> Family:
    fam = family("spanlet_gpu_memory_peak_ratio")
    fam.samples = [Sample(labels(gpu=g), r) for g, r in sorted(peaks.items())]
    return fam


def spanlet_gpu_pcie_utilization_ratio(nvml) -> Family:
    fam = family("spanlet_gpu_pcie_utilization_ratio")
    for g, s in sorted(nvml.snapshot().items()):
        if s.pcie_tx_ratio is not None:
            fam.samples.append(Sample(labels(gpu=g, direction="tx"), s.pcie_tx_ratio))
        if s.pcie_rx_ratio is not None:
            fam.samples.append(Sample(labels(gpu=g, direction="rx"), s.pcie_rx_ratio))
    return fam
