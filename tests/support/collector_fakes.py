"""Fake metric sources for the Prometheus collector's tests: a probe's read
side and the other inputs the daemon hands the metric engine, with known
values; and inputs with every source at once, real serving metrics,
scheduler and join."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client import CollectorRegistry

from spanlet import config, events
from spanlet.config import ServingSettings
from spanlet.daemon import StartedProbes
from spanlet.exporters.prometheus import SpanletCollector
from spanlet.join import SpanJoin
from facts_fakes import FakeFacts
from spanlet.metrics.engine import MetricEngine
from spanlet.metrics.serving import ServingMetrics
from spanlet.nvml import GpuSample
from spanlet.probes.base import ProbeStatus
from spanlet.probes.tc.flows import JitterStats
from spanlet.request_totals import RequestTotals
from spanlet.scheduler import Scheduler, WindowInputs


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
        self.untracked_fds = int
        self.marks = int
        self.invalid_marks = int
        self.thread_only_processes = lambda: {4242: 2, 4343: 3}   # gevent; trio and gevent
        self.cgroup_limited = lambda: {42: 3}
        self.rejected = dict
        self.uncounted = dict
        self.graph_launches = dict
        self.unknown_graph_launches = dict
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
        "spans_rejected": {"bad_span_id": 2}, "spans_accepted": 9,
        "origins": {"socket": 5, "pod_ip": 0, "unknown": 3}})
    nvml = SimpleNamespace(status=SimpleNamespace(available=nvml_available),
                           snapshot=lambda: {}, errors={})
    return SimpleNamespace(cfg=cfg, probes=StartedProbes(probes), names=names, join=SpanJoin(cfg.join, facts=FakeFacts()),
                           span_export=span_export, receiver=receiver, nvml=nvml, memory_peaks={},
                           store=None, serving=None, scheduler=None,
                           cpu_throttle=SimpleNamespace(throttled=lambda: {}), request_totals=RequestTotals())


def engine(src) -> MetricEngine:
    return MetricEngine(probes=src.probes, names=src.names, join=src.join,
                        span_export=src.span_export, receiver=src.receiver, nvml=src.nvml,
                        memory_peaks=lambda: src.memory_peaks, store=src.store,
                        serving=src.serving, scheduler=src.scheduler, cpu_throttle=src.cpu_throttle,
                        request_totals=src.request_totals)


def registry(src):
    reg = CollectorRegistry()
    reg.register(SpanletCollector(engine(src), src.cfg.node_name))
    return reg


def every_source():
    """Every source the metric engine reads, each with at least one series:
    kernel probes and NVML stood in, a store's stats, real serving metrics
    after three windows, a scheduler after one update, a span joined."""
    gpu_buckets = [0] * 32
    gpu_buckets[12] = 2
    key = (11, events.Modality.image, events.Api.driver)
    gpu = FakeProbe("gpu_launch", launches=lambda: {key: 5}, sync_waits=lambda: {key: (2, 5_000_000, gpu_buckets)},
                    graph_launches=lambda: {key: 3}, unknown_graph_launches=lambda: {key: 1},
                    memcpy_bytes=lambda: {(11, "h2d"): 4096})
    tc = FakeProbe("tc_classify", totals=lambda: {("ingress", "rtp", "audio"): (10, 1420)},
                   jitter=lambda: {("rtp", "audio"): JitterStats(100, 10, 0.1, 100, 10)},
                   rejected=lambda: {"rtp_invalid": 1}, uncounted=lambda: {"fragment": 1})
    sb = FakeProbe("mmap_sandbox", violations=lambda: {(11, "exec", "kill"): 1},
                   sweep_violations=lambda: {(11, "exec", "audit"): 1})
    span_ctx = FakeProbe("span_ctx", marks=lambda: 4)
    d = sources([gpu, tc, sb, span_ctx], nvml_available=True)
    sample = GpuSample("GPU-0", 0, sm_utilization_ratio=0.5, memory_used_bytes=1, memory_total_bytes=2,
                       memory_free_bytes=1, pcie_tx_ratio=0.1, pcie_rx_ratio=0.2)
    d.nvml.snapshot = lambda: {"GPU-0": sample}
    d.memory_peaks = {"GPU-0": 0.5}
    d.cpu_throttle = SimpleNamespace(throttled=lambda: {11: 1.5})
    d.serving = serving_with_every_metric()
    d.scheduler = Scheduler()
    d.scheduler.update(WindowInputs(), time.time())
    d.store = SimpleNamespace(events_overflow=1, stats=lambda: {
        "dropped_rows_by_table": {}, "queued_rows": 2, "spooled_bytes": 3,
        "engine_rss_bytes": 4 << 20, "engine_restarts": 1})
    join_one_span(d.join)
    return d


def _attr(span, key, value):
    kv = span.attributes.add(key=key)
    if isinstance(value, str):
        kv.value.string_value = value
    elif isinstance(value, list):
        for x in value:
            kv.value.array_value.values.add().double_value = x
    else:
        kv.value.int_value = value


def serving_with_every_metric() -> ServingMetrics:
    """Real serving metrics after three windows of spans that carry every trigger."""
    s = ServingMetrics(ServingSettings(peak_tokens_per_s={"m": 1000.0}), start=0.0)
    rnd = random.Random(1)
    for w in range(3):
        rs = trace_pb2.ResourceSpans()
        for k, v in (("k8s.namespace.name", "ns"), ("k8s.pod.name", "pod")):
            rs.resource.attributes.add(key=k).value.string_value = v
        ss = rs.scope_spans.add()
        trace = rnd.randbytes(16)
        for i, modality in enumerate(("audio", "video")):
            span = ss.spans.add(trace_id=trace, span_id=rnd.randbytes(8), name="infer",
                                kind=trace_pb2.Span.SPAN_KIND_SERVER,
                                start_time_unix_nano=10**18, end_time_unix_nano=10**18 + (w + 1) * 10**7)
            span.events.add(name="first_token", time_unix_nano=10**18 + 10**6)
            for key, value in (("mm.modality", modality), ("slo.class", "gold"),
                               ("gen_ai.request.model", "m"), ("gen_ai.usage.output_tokens", 100),
                               ("mm.pts_ns", 10**9 + i * 50_000_000), ("mm.degraded_from", "image"),
                               ("mm.degraded_to", "text"), ("mm.embedding", [1.0, w + i + 0.5]),
                               ("kernel.request.cpu_ns", 3_000_000), ("kernel.request.runqueue_ns", 200_000)):
                _attr(span, key, value)
        s.observe([rs], now=w * 10.0 + 1)
        s.roll(now=(w + 1) * 10.0)
    return s


def join_one_span(join: SpanJoin) -> None:
    """One span joined to its kernel row and one sampled sync event."""
    trace_id = bytes(range(16))
    join.facts.add(trace_id, 7, driver=3, syncs=1, sync_wait_ns=500)
    ev = events.GpuSync()
    ev.hdr.kind, ev.hdr.span_id = events.Kind.GPU_SYNC, 7
    ev.hdr.trace_id[:] = list(trace_id)
    join.add_event(ev)
    join.facts.add(trace_id, 7, driver=5, cgroup_id=99)       # another pod's row, same ids
    join.join([trace_pb2.ResourceSpans(scope_spans=[trace_pb2.ScopeSpans(spans=[
        trace_pb2.Span(trace_id=trace_id, span_id=(7).to_bytes(8, "big"))])])],
        origin=frozenset({0}))
    join.facts.st.refused_by_cgroup = {99: 4}                 # the kernel refused that pod rows
    # steps whose links are one past their sender's bound of waiting shares
    links, per_step = join.cfg.batch_max_pending_per_pod + 1, join.cfg.batch_max_links
    for first in range(0, links, per_step):
        step = trace_pb2.Span(trace_id=bytes(range(1, 17)), span_id=(8 + first).to_bytes(8, "big"))
        for i in range(first, min(links, first + per_step)):
            step.links.add(trace_id=trace_id, span_id=(100 + i).to_bytes(8, "big"))
        join.join([trace_pb2.ResourceSpans(scope_spans=[trace_pb2.ScopeSpans(spans=[step])])],
                  origin=frozenset({99}))