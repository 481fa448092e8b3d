"""Prometheus exposition of the metric engine (agent/metrics), and the agent's
one HTTP port: /metrics, /v1/hints, /healthz and /readyz."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
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


class _Handler(BaseHTTPRequestHandler):
    server: "AgentHttpServer"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, status, ctype = generate_latest(self.server.registry), 200, CONTENT_TYPE_LATEST
        elif path == "/v1/hints" and self.server.hints is not None:
            body = (json.dumps(self.server.hints(), indent=1) + "\n").encode()
            status, ctype = 200, "application/json"
        elif path == "/healthz":
            body, status, ctype = b"ok\n", 200, "text/plain"
        elif path == "/readyz":
            ready = self.server.ready()
            body, status = (b"ready\n", 200) if ready else (b"starting\n", 503)
            ctype = "text/plain"
        else:
            body, status, ctype = b"not found\n", 404, "text/plain"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class AgentHttpServer(ThreadingHTTPServer):
    """The agent's one HTTP port for people and scrapers."""

    daemon_threads = True

    def __init__(self, address: str, port: int, registry: CollectorRegistry,
                 ready: Callable[[], bool], hints: Callable[[], dict] | None = None):
        super().__init__((address, port), _Handler)
        self.registry = registry
        self.ready = ready
        self.hints = hints
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self.server_close()
            self._thread = None
