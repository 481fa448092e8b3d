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
class Exemplar:
    """A recent observation of a histogram bucket and the request that made it,
    so that a dashboard can go from the bucket to the trace (OpenMetrics
    exemplars, OTLP HistogramDataPoint.exemplars)."""
    trace_id: bytes                    # 16 bytes
    span_id: bytes                     # 8 bytes
    value: float                       # the observation, in the family's unit
    time_s: float                      # when it was observed, epoch seconds


@dataclass(frozen=True)
class HistogramSample:
    labels: Labels
    bounds: tuple[float, ...]          # upper bounds, ascending, without +Inf
    bucket_counts: tuple[int, ...]     # per bound, NOT cumulative; len(bounds) + 1 (the last: > max bound)
    sum: float
    count: int
    # per bucket (as bucket_counts) its latest Exemplar or None; () for a family that keeps none
    exemplars: tuple = ()


@dataclass
class Family:
    name: str                          # e.g. spanlet_request_duration_seconds (counters end in _total)
    type: Literal["counter", "gauge", "histogram"]
    help: str
    unit: str = ""                     # "seconds", "bytes", "ratio", "" (a count)
    samples: list = field(default_factory=list)   # Sample or HistogramSample
