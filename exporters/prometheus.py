"""Prometheus exposition of the metric engine (agent/metrics): the collector
that renders its Families at scrape time (served by exporters/http.py), and
the text of /metrics written straight from the Families: the same bytes
prometheus_client's generate_latest (text format 0.0.4) or its OpenMetrics
generate_latest (with the histograms' exemplars, for a scraper that asks for
application/openmetrics-text, as Prometheus does) makes of the collector,
without a prometheus_client object per series and sample (most of a
scrape's time with 100 pods of histograms)."""

from __future__ import annotations

import logging
from itertools import accumulate
from typing import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, Exemplar as PromExemplar, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE
from prometheus_client.openmetrics.exposition import escape_label_name, escape_metric_name
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.utils import floatToGoString

from spanlet.metrics import Exemplar, Family, HistogramSample, catalogue

log = logging.getLogger(__name__)


def _metric_family(type_: str, name: str, help_: str, label_names: list[str]) -> Metric:
    """An empty prometheus_client family; counters are named without _total there."""
    if type_ == "counter":
        return CounterMetricFamily(name.removesuffix("_total"), help_, labels=label_names)
    if type_ == "gauge":
        return GaugeMetricFamily(name, help_, labels=label_names)
    return HistogramMetricFamily(name, help_, labels=label_names)


EXEMPLAR_LABEL = "trace_id"        # what Grafana's exemplar link reads the trace id from


def _prom_exemplar(e: Exemplar | None) -> tuple:
    return () if e is None else (PromExemplar({EXEMPLAR_LABEL: e.trace_id.hex()}, e.value, e.time_s),)


def _render(fam: Family, node: str) -> Metric:
    """One engine Family as a prometheus_client metric family; `node` on every series."""
    names = ["node"] + [k for k, _ in (fam.samples[0].labels if fam.samples else ())]
    out = _metric_family(fam.type, fam.name, fam.help, names)
    for s in fam.samples:
        values = [node] + [v for _, v in s.labels]
        if isinstance(s, HistogramSample):
            cumulative, rows = 0, []
            exemplars = s.exemplars or (None,) * (len(s.bounds) + 1)
            for bound, n, e in zip(s.bounds, s.bucket_counts, exemplars):
                cumulative += n
                rows.append((floatToGoString(bound), cumulative, *_prom_exemplar(e)))
            rows.append(("+Inf", s.count, *_prom_exemplar(exemplars[len(s.bounds)])))
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


# ---- the text format, written directly ----------------------------------------------

_NAMES: dict[str, str] = {}


def _label_name(k: str) -> str:
    out = _NAMES.get(k)
    if out is None:
        out = _NAMES[k] = escape_label_name(k)
    return out


def _label_value(v: str) -> str:
    if "\\" in v or "\n" in v or '"' in v:
        return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
    return v


def _num(v) -> str:
    """floatToGoString(v), without its float formatting for the small integers
    that most samples and bucket counts are."""
    if type(v) is int and -1_000_000 < v < 1_000_000:
        return f"{v}.0"
    return floatToGoString(v)


_BOUNDS: dict[tuple[float, ...], list[str]] = {}


def _bounds(bounds: tuple[float, ...]) -> list[str]:
    out = _BOUNDS.get(bounds)
    if out is None:
        out = [floatToGoString(b) for b in bounds] + ["+Inf"]
        if len(_BOUNDS) < 64:
            _BOUNDS[bounds] = out
    return out


def _layout(labels) -> tuple[list[int], list[str], int, int]:
    """How a series with these label names is written: the indexes of its
    values (node first, then the labels') in sorted-name order, a name twice
    keeping its last value as a dict of the pairs does; each one's `name="`;
    how many names sort before le, and where those after it start (a label
    named le is left out of the buckets' pairs)."""
    last = {k: i for i, k in enumerate(["node", *[k for k, _ in labels]])}
    keys = sorted(last)
    below = sum(k < "le" for k in keys)
    return [last[k] for k in keys], [f'{_label_name(k)}="' for k in keys], below, below + ("le" in last)


def _exemplar_text(e: Exemplar | None) -> str:
    """An OpenMetrics exemplar as openmetrics_latest writes it after _render()."""
    if e is None:
        return ""
    return f' # {{{EXEMPLAR_LABEL}="{e.trace_id.hex()}"}} {floatToGoString(e.value)} {e.time_s}'


def _text_of(fam: Family, node: str, out: list[str], openmetrics: bool = False) -> None:
    """One Family as generate_latest (or, `openmetrics`, openmetrics_latest)
    writes it after _render(): labels sorted by name (node and le among
    them), counters' samples named with _total (and their HELP and TYPE in
    the text format 0.0.4), exemplars on buckets in OpenMetrics only."""
    base = fam.name.removesuffix("_total") if fam.type == "counter" else fam.name
    name = escape_metric_name(base + "_total" if fam.type == "counter" else base)
    title = escape_metric_name(base) if openmetrics else name
    doc = fam.help.replace("\\", r"\\").replace("\n", r"\n")
    if openmetrics:
        doc = doc.replace('"', r'\"')
    out.append(f"# HELP {title} {doc}\n# TYPE {title} {fam.type}\n")
    first = fam.samples[0].labels if fam.samples else ()
    layout = _layout(first)
    for s in fam.samples:
        # the first sample's label names are every sample's, by position, as
        # _render() pairs them (a sample with fewer values has fewer names)
        order, heads, below, above = layout if len(s.labels) >= len(first) else _layout(first[:len(s.labels)])
        values = [node, *[v for _, v in s.labels]]
        parts = [f'{h}{_label_value(values[i])}"' for h, i in zip(heads, order)]
        labelled = ",".join(parts)
        if not isinstance(s, HistogramSample):
            out.append(f"{name}{{{labelled}}} {_num(s.value)}\n")
            continue
        head = f"{name}_bucket{{{','.join(parts[:below])}{',' if below else ''}le=\""
        tail = f"\"{',' if above < len(parts) else ''}{','.join(parts[above:])}}} "
        counts = list(accumulate(s.bucket_counts[:len(s.bounds)])) + [s.count]
        if openmetrics and s.exemplars:
            out.extend([f"{head}{le}{tail}{_num(n)}{_exemplar_text(e)}\n"
                        for le, n, e in zip(_bounds(s.bounds), counts, s.exemplars)])
        elif all(type(n) is int for n in counts) and 0 <= min(counts) and max(counts) < 1_000_000:
            out.extend([f"{head}{le}{tail}{n}.0\n" for le, n in zip(_bounds(s.bounds), counts)])
        else:
            out.extend([f"{head}{le}{tail}{_num(n)}\n" for le, n in zip(_bounds(s.bounds), counts)])
        if not s.bounds or s.bounds[0] >= 0:
            out.append(f"{name}_count{{{labelled}}} {_num(s.count)}\n"
                       f"{name}_sum{{{labelled}}} {_num(s.sum)}\n")


def render_text(families: Iterable[Family], node: str, openmetrics: bool = False) -> bytes:
    """The Prometheus text format (0.0.4) of engine Families, `node` on every
    series; `openmetrics`: the OpenMetrics text format's, less its closing
    "# EOF" line (SpanletRegistry.text ends the exposition)."""
    out: list[str] = []
    for fam in families:
        _text_of(fam, node, out, openmetrics)
    return "".join(out).encode("utf-8")


class SpanletRegistry(CollectorRegistry):
    """A CollectorRegistry whose text() writes the SpanletCollectors' families
    directly (render_text) when they are all it holds; generate_latest otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self._spanlet: list[SpanletCollector] = []
        self._others = 0

    def register(self, collector) -> None:
        super().register(collector)
        if isinstance(collector, SpanletCollector):
            self._spanlet.append(collector)
        else:
            self._others += 1

    def unregister(self, collector) -> None:
        super().unregister(collector)
        if collector in self._spanlet:
            self._spanlet.remove(collector)
        else:
            self._others -= 1

    def text(self, openmetrics: bool = False) -> bytes:
        """The exposition in the text format 0.0.4, or in OpenMetrics (with exemplars)."""
        if self._others:
            return openmetrics_latest(self) if openmetrics else generate_latest(self)
        body = b"".join(render_text(c.engine.families(), c.node, openmetrics) for c in self._spanlet)
        return body + b"# EOF\n" if openmetrics else body


def wants_openmetrics(accept: str) -> bool:
    """Whether an Accept header asks for the OpenMetrics text format (as
    prometheus_client's choose_encoder reads it, q-values aside)."""
    return any(part.split(";", 1)[0].strip() == "application/openmetrics-text"
               for part in accept.split(","))


def exposition(registry: CollectorRegistry, accept: str) -> tuple[bytes, str]:
    """The body and content type of /metrics for a scraper's Accept header:
    OpenMetrics (exemplars included) when it asks for it, else the text
    format 0.0.4, whose parsers know no exemplars."""
    openmetrics = wants_openmetrics(accept)
    if isinstance(registry, SpanletRegistry):
        body = registry.text(openmetrics)
    else:
        body = openmetrics_latest(registry) if openmetrics else generate_latest(registry)
    return body, OPENMETRICS_CONTENT_TYPE if openmetrics else CONTENT_TYPE_LATEST
