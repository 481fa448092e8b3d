"""The metric engine's common shapes: every metric of METRICS.md is produced as
a Family of samples in base units, which the Prometheus collector, the OTLP
metrics exporter and the store render, each in its own format."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Labels = tuple[tuple[str, str], ...]   # sorted (name, value) pairs


def labels(**kv: str) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in kv.items()))


@dataclass(frozen=True)
class Sample:
    labels: Labels
    value: float


@dataclass(frozen=True)
class HistogramSample:
    labels: Labels
    bounds: tuple[float, ...]          # upper bounds, ascending, without +Inf
    bucket_counts: tuple[int, ...]     # per bound, NOT cumulative; len(bounds) + 1 (the last: > max bound)
    sum: float
    count: int


@dataclass
class Family:
    name: str                          # e.g. spanlet_request_duration_seconds (counters end in _total)
    type: Literal["counter", "gauge", "histogram"]
    help: str
    unit: str = ""                     # "seconds", "bytes", "ratio", "" (a count)
    samples: list = field(default_factory=list)   # Sample or HistogramSample
