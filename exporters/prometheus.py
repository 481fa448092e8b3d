"""Prometheus exposition of the metric engine (agent/metrics): the collector
that renders its Families at scrape time (served by exporters/http.py)."""

from __future__ import annotations

import logging
from typing import Iterable

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.utils import floatToGoString

from spanlet.metrics import Family, HistogramSample

log = logging.getLogger(__name__)



def _render(fam: Family, node: str) -> Metric:
    """One engine Family as a prometheus_client metric family; `node` on every series."""
    names = ["node"] + [k for k, _ in (fam.samples[0].labels if fam.samples else ())]
    if fam.type == "counter":
        name = fam.name[:-len("_total")] if fam.name.endswith("_total") else fam.name
        out = CounterMetricFamily(name, fam.help, labels=names)
    elif fam.type == "gauge":
        out = GaugeMetricFamily(fam.name, fam.help, labels=names)
    else:
        out = HistogramMetricFamily(fam.name, fam.help, labels=names)
    for s in fam.samples:
        values = [node] + [v for _, v in s.labels]
        if isinstance(s, HistogramSample):
            cumulative, rows = 0, []
            for bound, n in zip(s.bounds, s.bucket_counts):
                cumulative += n
                rows.append((floatToGoString(bound), cumulative))
            rows.append(("+Inf", s.count))
            out.add_metric(values, rows, s.sum)
        else:
            out.add_metric(values, s.value)
    return out


class SpanletCollector:
    """Renders the metric engine's Families at scrape time (ebpf_exporter
    style: maps are read when Prometheus asks, not copied by a loop)."""

    def __init__(self, engine, node: str):
        self.engine = engine
        self.node = node

    def describe(self) -> Iterable[Metric]:
        return []  # registration must not read maps

    def collect(self) -> Iterable[Metric]:
        for fam in self.engine.families():
            yield _render(fam, self.node)
