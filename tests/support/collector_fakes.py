"""Fake metric sources for the Prometheus collector's tests: a probe's read
side and the daemon parts the metric engine reads, with known values."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from spanlet import config
from spanlet.exporters.prometheus import SpanletCollector
from spanlet.join import SpanJoin
from spanlet.metrics.engine import MetricEngine
from spanlet.probes.base import ProbeStatus


class FakeProbe:
    """A probe's read side: the methods the metric engine calls, as given
    (the sandbox's and classifier's self-metric sources default to nothing)."""

    def __init__(self, name, **methods):
        self.name = name
        self.status = ProbeStatus(name, attached=True)
        self.events_read = 7
        self.adopted_fds = 0
        self.sweep_seconds = 0.0
        self.sweep_violations = dict
        self.unresolved_opens = int
        self.rejected = dict
        self.uncounted = dict
        for k, v in methods.items():
            setattr(self, k, v)

    def events_dropped(self):
        return 2


def daemon(probes, nvml_available=False):
    cfg = config.load(env={}, overrides=["node_name=n1"])
    enricher = SimpleNamespace(attributes=lambda cg: {
        "k8s.namespace.name": "serving", "k8s.pod.name": f"pod-{cg}", "k8s.container.name": "c"})
    spans = SimpleNamespace(join=SpanJoin(cfg.join), enricher=enricher,
                            exporter=SimpleNamespace(stats=lambda: {"queue_spans": 3,
                                                                    "dropped_queue_full": 4}),
                            receiver=SimpleNamespace(stats=lambda: {
                                "requests": {"grpc": {"ok": 5, "invalid": 1}},
                                "spans_rejected": {"bad_span_id": 2}, "spans_accepted": 9}))
    nvml = SimpleNamespace(status=SimpleNamespace(available=nvml_available),
                           snapshot=lambda: {}, errors={})
    return SimpleNamespace(cfg=cfg, probes=probes, spans=spans, nvml=nvml, memory_peaks={})


def registry(d):
    reg = CollectorRegistry()
    reg.register(SpanletCollector(MetricEngine(d), d.cfg.node_name))
    return reg
