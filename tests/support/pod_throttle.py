"""What the pod CPU throttling tests share: the agent's own pod naming (cgroup
index, pod watcher, enricher) over a given cgroup v2 root with pods known by
uid, and a Prometheus registry whose engine reads a given throttling source."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from collector_fakes import sources
from spanlet.cgroups import CgroupIndex
from spanlet.exporters.prometheus import SpanletCollector
from spanlet.k8s import K8sEnricher, PodInfo, PodWatcher
from spanlet.metrics.engine import MetricEngine

NAME = "spanlet_pod_cpu_throttled_seconds_total"


def pod_names(cgroup2: Path | None, pods: dict[str, tuple[str, str]]) -> K8sEnricher:
    """The enricher the daemon uses, its watcher holding these pods
    (uid → (namespace, name)) as the API server would have listed them."""
    watcher = PodWatcher("n1", api=object())
    watcher.pods = {uid: PodInfo(name, ns) for uid, (ns, name) in pods.items()}
    return K8sEnricher("n1", CgroupIndex(root=cgroup2, rescan_s=0), watcher)


def throttle_engine(throttle, names) -> MetricEngine:
    """A metric engine whose pod names and throttling are these, its other
    sources stood in."""
    src = sources([])
    return MetricEngine(probes=src.probes, names=names, join=src.join, span_export=src.span_export,
                        receiver=src.receiver, nvml=src.nvml, memory_peaks=dict,
                        cpu_throttle=throttle)


def registry(engine: MetricEngine) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(SpanletCollector(engine, "n1"))
    return reg


def throttled(reg: CollectorRegistry, namespace: str, pod: str) -> float | None:
    """The scrape's sample of that pod; None where it has none."""
    return reg.get_sample_value(NAME, {"node": "n1", "namespace": namespace, "pod": pod})


def samples(engine: MetricEngine) -> dict[tuple, float]:
    """Every sample of the family in one collect: labels → value."""
    (fam,) = [f for f in engine.families() if f.name == NAME]
    return {s.labels: s.value for s in fam.samples}
