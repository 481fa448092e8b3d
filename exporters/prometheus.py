"""Prometheus exposition of the metric engine (agent/metrics): the collector
that renders its Families at scrape time (served by exporters/http.py)."""

from __future__ import annotations

import logging
from typing import Iterable

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.utils import floatToGoString

from spanlet.metrics import Family, HistogramSample, catalogue

log = logging.getLogger(__name__)



def _metric_family(type_: str, name: str, help_: str, label_names: list[str]) -> Metric:
    """An empty prometheus_client family; counters are named without _total there."""
    if type_ == "counter":
        return CounterMetricFamily(name.removesuffix("_total"), help_, labels=label_names)
    if type_ == "gauge":
        return GaugeMetricFamily(name, help_, labels=label_names)
    return HistogramMetricFamily(name, help_, labels=label_names)


def _render(fam: Family, node: str) -> Metric:
    """One engine Family as a prometheus_client metric family; `node` on every series."""
    names = ["node"] + [k for k, _ in (fam.samples[0].labels if fam.samples else ())]
    out = _metric_family(fam.type, fam.name, fam.help, names)
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
        """Every family the agent can export, from the catalogue: registration
        learns the names without reading a map."""
        for m in catalogue.CATALOGUE:
            yield _metric_family(m.type, m.name, m.help, ["node", *m.labels])

    def collect(self) -> Iterable[Metric]:
        for fam in self.engine.families():
            yield _render(fam, self.node)
