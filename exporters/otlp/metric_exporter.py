"""Upstream OTLP export of the metric engine's Families: every interval one ExportMetricsServiceRequest
(cumulative sums, gauges, explicit-bucket histograms with their buckets' exemplars), collected and
sent by the batching worker."""

from __future__ import annotations

import importlib.metadata
import logging
import math
import os
import threading
import time
from typing import Callable, Iterable, Mapping, Sequence

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1.metrics_pb2 import AGGREGATION_TEMPORALITY_CUMULATIVE

from spanlet.config import OtlpConfig
from spanlet.metrics import Family, HistogramSample
from spanlet.exporters.batching import EXPORTED, BatchWorker, ExportResult
from spanlet.exporters.otlp.transport import (INITIAL_BACKOFF_S, MAX_BACKOFF_S, OtlpBatch, OtlpSender,
                                              _Counters)
from spanlet.exporters.otlp.upstream import resolve_metrics_upstream
from spanlet.exporters.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0      # the metric window (Config.window_s)
SERVICE_NAME = "spanlet"
SCOPE_NAME = "spanlet"
NODE_LABEL = "node"

# Family.unit (Prometheus words, base units) -> UCUM as OTel writes it. The
# OTel Prometheus-compatibility spec: words become abbreviations, "ratio"
# becomes "1", "foo_per_bar" becomes "foo/bar"; a plain count has no unit.
UNITS = {"seconds": "s", "bytes": "By", "ratio": "1", "": ""}

try:
    _VERSION = importlib.metadata.version("spanlet")
except importlib.metadata.PackageNotFoundError:   # running from a bare checkout
    _VERSION = ""


def otlp_unit(unit: str) -> str:
    return "/".join(UNITS.get(part, part) for part in unit.split("_per_"))


# ---------------------------------------------------------------------------
# Families -> ExportMetricsServiceRequest

def _set_attributes(target, pairs: Iterable[tuple[str, str]]) -> None:
    for key, value in pairs:
        target.add(key=key).value.string_value = value


def _node_of(families: Sequence[Family]) -> str:
    for fam in families:
        for s in fam.samples:
            for key, value in s.labels:
                if key == NODE_LABEL and value:
                    return value
    return ""


def families_to_request(families: Sequence[Family], *, start_ns: int, now_ns: int,
                        node: str = "") -> tuple[ExportMetricsServiceRequest, int]:
    """One ResourceMetrics (service spanlet on `node`) holding every Family;
    returns the request and its number of data points. Counters become
    monotonic cumulative Sums starting at `start_ns`, gauges Gauges,
    histograms cumulative explicit-bucket Histograms. Names stay as the
    engine gives them (counters keep _total), labels become attributes, and
    every point carries `node` as every scraped series does. Families
    without samples and malformed histogram samples are left out."""
    node = node or _node_of(families)
    request = ExportMetricsServiceRequest()
    scope = _scope_metrics(request, node)
    points = sum(_add_metric(scope, fam, node, start_ns, now_ns) for fam in families)
    return request, points


def _scope_metrics(request: ExportMetricsServiceRequest, node: str):
    """The request's one ResourceMetrics, service spanlet on `node`, and the
    ScopeMetrics in it that holds every metric."""
    rm = request.resource_metrics.add()
    resource = [("service.name", SERVICE_NAME)]
    if node:
        # service.instance.id keeps the nodes' series apart where a backend
        # maps resources to Prometheus job/instance.
        resource += [("service.instance.id", node), ("host.name", node), ("k8s.node.name", node)]
    _set_attributes(rm.resource.attributes, resource)
    sm = rm.scope_metrics.add()
    sm.scope.name, sm.scope.version = SCOPE_NAME, _VERSION
    return sm


def _add_metric(sm, fam: Family, node: str, start_ns: int, now_ns: int) -> int:
    """Adds `fam` to the ScopeMetrics `sm` as one metric and returns its number
    of data points; a family without samples, of a type that is not exported,
    or whose samples are all left out adds nothing."""
    if not fam.samples:
        return 0
    if fam.type not in ("counter", "gauge", "histogram"):
        log.warning("%s: metric type %r is not exported", fam.name, fam.type)
        return 0
    metric = sm.metrics.add(name=fam.name, description=fam.help, unit=otlp_unit(fam.unit))
    data = _metric_data(metric, fam.type)
    for s in fam.samples:
        _add_point(data, fam, s, node, start_ns, now_ns)
    points = len(data.data_points)
    if not points:
        del sm.metrics[-1]
    return points


def _metric_data(metric, kind: str):
    """The part of `metric` that holds the points of a family of type `kind`: a
    monotonic cumulative Sum for a counter, a Gauge for a gauge, a cumulative
    Histogram for a histogram."""
    if kind == "counter":
        data = metric.sum
        data.is_monotonic = True
    elif kind == "gauge":
        return metric.gauge
    else:
        data = metric.histogram
    data.aggregation_temporality = AGGREGATION_TEMPORALITY_CUMULATIVE
    return data


def _add_point(data, fam: Family, sample, node: str, start_ns: int, now_ns: int) -> None:
    """Adds `sample` to `data` as one data point, its labels and `node` as
    attributes; a sample that does not fit its family is left out."""
    if not _fits(fam, sample):
        return
    if isinstance(sample, HistogramSample):
        dp = data.data_points.add(start_time_unix_nano=start_ns, time_unix_nano=now_ns,
                                  count=sample.count, sum=sample.sum)
        dp.explicit_bounds.extend(sample.bounds)
        dp.bucket_counts.extend(sample.bucket_counts)
        for e in sample.exemplars:
            if e is not None:
                dp.exemplars.add(time_unix_nano=round(e.time_s * 1e9), as_double=e.value,
                                 trace_id=e.trace_id, span_id=e.span_id)
    else:
        dp = data.data_points.add(time_unix_nano=now_ns, as_double=float(sample.value))
        if fam.type == "counter":
            dp.start_time_unix_nano = start_ns
    attrs = list(sample.labels)
    if node and all(k != NODE_LABEL for k, _ in attrs):
        attrs.append((NODE_LABEL, node))
    _set_attributes(dp.attributes, sorted(attrs))


def _fits(fam: Family, sample) -> bool:
    """Whether `sample` can be exported in `fam`, with a warning where not: a
    histogram sample only in a histogram family and the reverse, and a
    histogram's buckets one more than its bounds."""
    if isinstance(sample, HistogramSample) != (fam.type == "histogram"):
        log.warning("%s: a %s sample in a %s family left out",
                    fam.name, type(sample).__name__, fam.type)
        return False
    if isinstance(sample, HistogramSample) and len(sample.bucket_counts) != len(sample.bounds) + 1:
        log.warning("%s: histogram with %d bounds and %d buckets left out",
                    fam.name, len(sample.bounds), len(sample.bucket_counts))
        return False
    return True


# ---------------------------------------------------------------------------

class _Collections:
    """The batching worker's queue for metrics: nothing waits in it. At every
    interval, flush and shutdown one collection falls due; the batch taken is
    a placeholder that the export fills from the source."""

    def __init__(self, sender: OtlpSender) -> None:
        self._sender = sender
        self._due = False

    def ready(self) -> bool:
        return self._due

    def seal(self) -> None:
        self._due = True

    def take(self) -> OtlpBatch | None:
        if not self._due:
            return None
        self._due = False
        return OtlpBatch(None)

    def idle(self) -> bool:
        return not self._due

    def settle(self, batch: OtlpBatch, outcome: str, result: ExportResult | None) -> None:
        if batch.n:                     # nothing collected, or nothing to send: nothing to count
            self._sender.settle(batch, outcome, result)

    def close(self) -> None:
        self._due = False


class OtlpMetricsExporter:
    """Exports the metric engine's Families to an upstream OTLP collector.

    Where to send: resolve_metrics_upstream(cfg, environ). With no endpoint
    the exporter is disabled: `enabled` is False, no thread runs, export()
    and force_flush() do nothing and return True.

    With a `source` (a callable returning the current Families) the batching
    worker's thread collects and exports every `interval_s`, on
    force_flush(), and once more at shutdown. export(families, now_ns) sends
    given Families at once on the caller's thread. A retryable failure is
    retried with the span exporter's backoff for at most
    min(cfg.max_retry_s, interval_s): sums and histograms are cumulative, so
    the next collection carries everything a dropped one had."""

    def __init__(self, cfg: OtlpConfig, environ: Mapping[str, str] = os.environ, *,
                 source: Callable[[], list[Family]] | None = None, node: str = "",
                 interval_s: float = DEFAULT_INTERVAL_S,
                 initial_backoff_s: float = INITIAL_BACKOFF_S,
                 max_backoff_s: float = MAX_BACKOFF_S) -> None:
        if not (interval_s > 0 and math.isfinite(interval_s)):
            raise ValueError(f"interval_s must be a positive number of seconds, not {interval_s!r}")
        self.source, self.node, self.interval_s = source, node, interval_s
        self.start_time_unix_nano = time.time_ns()   # start of every cumulative stream
        self.upstream = resolve_metrics_upstream(cfg, environ)
        self.enabled = self.upstream is not None
        self._cond = threading.Condition()
        self._source_errors = 0
        self._ratelog = RateLimitedLog(log)
        self._sender: OtlpSender | None = None
        self._worker: BatchWorker[OtlpBatch] | None = None
        if not self.enabled:
            log.info("no OTLP upstream configured (upstream_endpoint, "
                     "OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT): metric export is off")
            return
        up = self.upstream
        self._sender = OtlpSender(up, "metrics", initial_backoff_s=initial_backoff_s,
                                  max_backoff_s=max_backoff_s, unit="data points",
                                  what="OTLP metrics export", logger=log)
        self._worker = BatchWorker(_Collections(self._sender), self._export,
                                   self._sender.backoff(min(cfg.max_retry_s, interval_s)),
                                   schedule_delay_s=interval_s, name="otlp-metrics-export", ticks_when_idle=True,
                                   cond=self._cond, logger=log)
        if source is not None:
            self._worker.start()
        log.info("exporting metrics over OTLP %s to %s every %g s", up.protocol, up.endpoint,
                 interval_s)

    # ---- the OTel exporter shape ----

    def export(self, families: Sequence[Family], now_ns: int | None = None) -> bool:
        """Send these Families now (time `now_ns`, default the current time);
        True when the upstream took them (or there was nothing to send)."""
        if self._worker is None:
            return True
        with self._cond:
            if self._worker.closing:
                self._ratelog(logging.WARNING, "closed", "OTLP metrics exporter is shut down")
                return False
        batch = self._request(families, now_ns)
        return not batch.n or self._worker.deliver(batch) == EXPORTED

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Collect from the source and export now; True when that export got
        a final answer within the timeout."""
        if self._worker is None:
            return True
        return self._worker.force_flush(timeout_millis / 1000.0)

    def shutdown(self, timeout_millis: int = 30000) -> None:
        """Export once more from the source, within the deadline, stop the
        worker and close the connection. Safe to call twice."""
        if self._worker is not None and self._worker.shutdown(timeout_millis / 1000.0):
            self._sender.close()

    def stats(self) -> dict:
        """Counts in data points (exported, failed, ...) and requests."""
        with self._cond:
            c = self._sender.counters if self._sender is not None else _Counters()
            return {
                "enabled": self.enabled,
                "exported": c.exported,
                "rejected_upstream": c.rejected_upstream,
                "failed": c.dropped_failed,
                "dropped_shutdown": c.dropped_shutdown,
                "retries": self._worker.retries if self._worker is not None else 0,
                "requests_exported": c.requests_exported,
                "requests_failed": c.requests_failed,
                "source_errors": self._source_errors,
            }

    @property
    def retry_delays(self) -> list[float]:
        """The last planned retry delays in seconds, oldest first."""
        with self._cond:
            return list(self._worker.retry_delays) if self._worker is not None else []

    # ---- internals ----

    def _request(self, families: Sequence[Family], now_ns: int | None) -> OtlpBatch:
        request, points = families_to_request(
            families, start_ns=self.start_time_unix_nano,
            now_ns=time.time_ns() if now_ns is None else now_ns, node=self.node)
        return OtlpBatch(request, points)

    def _export(self, batch: OtlpBatch, timeout_s: float | None) -> ExportResult:
        """The worker's export: the first try collects from the source."""
        if batch.request is None:
            try:
                collected = self._request(self.source(), None)
            except Exception as e:  # a failing source (or a bug) costs one export, not the worker
                with self._cond:
                    self._source_errors += 1
                self._ratelog(logging.WARNING, "source", "metrics collection failed: %s", e,
                              exc_info=True)
                return ExportResult(True)
            batch.request, batch.n = collected.request, collected.n
        if not batch.n:
            return ExportResult(True)
        return self._sender.export(batch, timeout_s)
