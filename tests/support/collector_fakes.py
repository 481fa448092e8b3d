"""Fake metric sources for the Prometheus collector's tests: a probe's read
side and the other inputs the daemon hands the metric engine, with known values."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from spanlet import config
from spanlet.daemon import StartedProbes
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


def sources(probes, nvml_available=False):
    """The metric engine's inputs as the daemon hands them, with known values
    (set serving, scheduler, memory_peaks or nvml.snapshot before registry())."""
    cfg = config.load(env={}, overrides=["node_name=n1"])
    names = SimpleNamespace(attributes=lambda cg: {
        "k8s.namespace.name": "serving", "k8s.pod.name": f"pod-{cg}", "k8s.container.name": "c"})
    span_export = SimpleNamespace(stats=lambda: {"queue_spans": 3, "dropped_queue_full": 4})
    receiver = SimpleNamespace(stats=lambda: {
        "requests": {"grpc": {"ok": 5, "invalid": 1}},
        "spans_rejected": {"bad_span_id": 2}, "spans_accepted": 9})
    nvml = SimpleNamespace(status=SimpleNamespace(available=nvml_available),
                           snapshot=lambda: {}, errors={})
    return SimpleNamespace(cfg=cfg, probes=StartedProbes(probes), names=names, join=SpanJoin(cfg.join),
                           span_export=span_export, receiver=receiver, nvml=nvml, memory_peaks={},
                           store=None, serving=None, scheduler=None)


def registry(src):
    engine = MetricEngine(probes=src.probes, names=src.names, join=src.join,
                          span_export=src.span_export, receiver=src.receiver, nvml=src.nvml,
                          memory_peaks=lambda: src.memory_peaks, store=src.store,
                          serving=src.serving, scheduler=src.scheduler)
    reg = CollectorRegistry()
    reg.register(SpanletCollector(engine, src.cfg.node_name))
    return reg
