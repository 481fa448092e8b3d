"""The `spanlet run` daemon: checks the node, starts every probe (one that fails
is reported while the others run), reads their ring buffers, refreshes
discovery, and on SIGTERM/SIGINT detaches everything within the deadline."""

from __future__ import annotations

import importlib
import logging
import signal
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet import events
from spanlet.probes import node_check
from spanlet.admin import AdminServer
from spanlet.config import Config
from spanlet.join import SpanJoin
from spanlet.k8s import K8sEnricher, PodWatcher
from spanlet.metrics.engine import MetricEngine
from spanlet.metrics.serving import ServingMetrics, ServingSettings
from spanlet.scheduler import Scheduler, SchedulerThresholds, WindowInputs
from spanlet.nvml import NvmlPoller
from spanlet.probes.base import Probe, ProbeStatus
from prometheus_client import CollectorRegistry

from spanlet.exporters.otlp_export import OtlpSpanExporter
from spanlet.exporters.otlp_metrics import OtlpMetricsExporter
from spanlet.exporters.otlp_receiver import OtlpReceiver
from spanlet.exporters.prometheus import AgentHttpServer, SpanletCollector

log = logging.getLogger("spanlet")

# (config section, module, class): the order is the start order; the span
# context owner comes first so the others can share its map.
PROBES = [
    ("tc", "spanlet.probes.tc.probe", "TcProbe"),
    ("sandbox", "spanlet.probes.sandbox.probe", "SandboxProbe"),
    ("gpu", "spanlet.probes.gpu", "GpuProbe"),
]


def probe_classes(cfg: Config) -> list[type[Probe]]:
    """The probe classes enabled in the config, the span-context owner first."""
    from spanlet.probes.span_ctx import SpanCtxProbe

    classes: list[type[Probe]] = [SpanCtxProbe]
    for section, module, cls in PROBES:
        if getattr(cfg, section).enabled:
            classes.append(getattr(importlib.import_module(module), cls))
    return classes


class SpanPath:
    """OTLP spans in → k8s resource names and kernel facts joined → upstream."""

    def __init__(self, cfg: Config, on_joined: Callable[[list], None] | None = None):
        self.cfg = cfg
        self.on_joined = on_joined
        self.exporter = OtlpSpanExporter(cfg.otlp)
        self.join = SpanJoin(cfg.join, on_late=self._export_late)
        self.pods = PodWatcher(cfg.node_name)
        self.enricher = K8sEnricher(cfg.node_name, pods=self.pods)
        self.receiver = OtlpReceiver(cfg.otlp, self.on_request)

    def start(self) -> None:
        self.pods.start()
        try:
            self.receiver.start()
        except OSError as e:
            # Kernel facts are still worth having: say so loudly, keep going.
            log.error("OTLP receiver NOT started: %s; spans cannot be joined", e)
            return
        log.info("OTLP receiver on %s: gRPC %d, HTTP %d; upstream export %s",
                 self.cfg.otlp.receiver_address, self.receiver.grpc_port, self.receiver.http_port,
                 "on" if self.exporter.enabled else "off (no endpoint configured)")

    def on_request(self, request: ExportTraceServiceRequest) -> int:
        cgroups = self.join.join(request.resource_spans)
        for rs, cgroup in zip(request.resource_spans, cgroups):
            self._name_resource(rs, cgroup)
        if self.on_joined is not None:
            self.on_joined(request.resource_spans)
        self.exporter.export(request.resource_spans)
        return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)

    def _name_resource(self, rs: trace_pb2.ResourceSpans, cgroup_id: int) -> None:
        """Kubernetes names of where the kernel events came from, unless the
        resource already carries them (the SDK or a collector set them)."""
        have = {kv.key for kv in rs.resource.attributes}
        attrs = self.enricher.attributes(cgroup_id) if cgroup_id > 1 else \
            {"k8s.node.name": self.cfg.node_name}
        for key, value in attrs.items():
            if key not in have:
                rs.resource.attributes.append(KeyValue(key=key, value=AnyValue(string_value=value)))

    def _export_late(self, records: list[tuple[int, trace_pb2.ResourceSpans]]) -> None:
        for cgroup, rs in records:
            self._name_resource(rs, cgroup)
        self.exporter.export([rs for _, rs in records])

    def tick(self) -> None:
        self.join.flush_late()

    def stop(self, deadline: float) -> None:
        """Receiver first (no new spans), then what is late, then the export queue."""
        self.receiver.stop(grace=min(1.0, max(0.0, deadline - time.monotonic())))
        self.pods.stop()
        self.join.flush_late()
        remaining_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
        self.exporter.shutdown(timeout_millis=remaining_ms)


def _in_parallel(fns: list[Callable[[], None]], timeout_s: float) -> None:
    threads = [threading.Thread(target=fn, name="stop", daemon=True) for fn in fns]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))


class StorePath:
    """Spans, kernel events and metric samples into ClickHouse (embedded chdb
    by default) through one sink: batched, retried, spooled to disk."""

    def __init__(self, cfg: Config, enricher: K8sEnricher):
        self.cfg = cfg
        self.enricher = enricher
        self.sink = None
        # decoded events wait here (reader threads append) until the next refresh
        self._events: deque = deque(maxlen=cfg.store.queue_rows)
        self.events_overflow = 0

    def start(self) -> None:
        from spanlet.exporters.clickhouse import rows
        from spanlet.exporters.clickhouse.sink import ClickHouseSink

        st, data = self.cfg.store, Path(self.cfg.data_dir)
        self.rows = rows
        try:
            if st.backend == "chdb":
                from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend
                (data / "chdb").mkdir(parents=True, exist_ok=True)
                backend = ChdbBackend(str(data / "chdb"), database=st.database, ttl_days=st.ttl_days)
                where = f"embedded chdb in {data / 'chdb'}"
            else:
                from spanlet.exporters.clickhouse.http_backend import HttpBackend
                backend = HttpBackend(st.url, database=st.database, user=st.user or None,
                                      password_file=st.password_file or None,
                                      ca_file=st.ca_file or None, ttl_days=st.ttl_days,
                                      cluster=st.cluster or None)
                where = f"ClickHouse at {st.url}" + (f" (cluster {st.cluster})" if st.cluster else "")
            self.sink = ClickHouseSink(backend, batch_rows=st.batch_rows,
                                       batch_interval_s=st.batch_interval_s, queue_rows=st.queue_rows,
                                       spool_dir=data / "spool", spool_max_bytes=st.spool_max_bytes)
        except Exception as e:  # the store is one consumer: the agent runs without it
            log.error("store NOT started: %s", e)
            return
        log.info("store: %s, database %s", where, st.database)

    def _resolve(self, cgroup_id: int) -> tuple[str, str, str]:
        a = self.enricher.attributes(cgroup_id) if cgroup_id else {}
        return (a.get("k8s.namespace.name", ""), a.get("k8s.pod.name", ""),
                a.get("k8s.container.name", ""))

    def add_event(self, ev: events._Event) -> None:
        if self.sink is not None:
            if len(self._events) == self._events.maxlen:
                self.events_overflow += 1
            self._events.append(ev)

    def add_spans(self, resource_spans) -> None:
        if self.sink is not None:
            self.sink.write("otel_traces", self.rows.TRACE_COLUMNS, self.rows.span_rows(resource_spans))

    def add_metrics(self, families) -> None:
        if self.sink is not None:
            self.sink.write("metric_samples", self.rows.METRIC_COLUMNS,
                            self.rows.metric_rows(families, time.time_ns()))

    def tick(self) -> None:
        if self.sink is None or not self._events:
            return
        batch = []
        while self._events:
            batch.append(self._events.popleft())
        self.sink.write("kernel_events", self.rows.KERNEL_EVENT_COLUMNS,
                        self.rows.kernel_event_rows(batch, self._resolve, self.cfg.node_name))

    def stop(self, deadline: float) -> None:
        if self.sink is not None:
            self.tick()
            self.sink.shutdown(max(0.1, deadline - time.monotonic()))


class Daemon:
    def __init__(self, cfg: Config, sink: Callable[[events._Event], None] | None = None):
        self.cfg = cfg
        self.clock = events.MonotonicClock()
        self.serving = ServingMetrics(ServingSettings(window_s=cfg.window_s,
                                                      **cfg.serving.model_dump()),
                                      start=time.monotonic())
        self.scheduler = Scheduler(SchedulerThresholds(**cfg.scheduler.model_dump()),
                                   window_s=cfg.window_s)
        self.spans = SpanPath(cfg, on_joined=self._on_joined)
        self.store = StorePath(cfg, self.spans.enricher) if cfg.store.enabled else None
        printer = sink

        self.admin = AdminServer(self)

        def on_event(ev: events._Event) -> None:
            self.spans.join.add_event(ev)
            self.admin.on_event(ev)
            if self.store is not None:
                self.store.add_event(ev)
            if printer is not None:
                printer(ev)

        self.sink = on_event
        self.nvml = NvmlPoller(cfg.nvml)
        self.memory_peaks: dict[str, float] = {}   # per GPU, of the last window
        self.probes: list[Probe] = []
        self.metrics = MetricEngine(self)
        self.registry = CollectorRegistry()
        self.registry.register(SpanletCollector(self.metrics, cfg.node_name))
        self.http: AgentHttpServer | None = None
        self.metrics_exporter: OtlpMetricsExporter | None = None
        self.stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stopped = False

    def _on_joined(self, resource_spans) -> None:
        self.serving.observe(resource_spans, time.monotonic())
        if self.store is not None:
            self.store.add_spans(resource_spans)

    # -- start-up ----------------------------------------------------------------
    def check_node(self) -> node_check.Headers:
        """Root, mounts and headers; raises node_check.EnvironmentProblem."""
        node_check.require_root()
        node_check.require_mounts()
        headers = node_check.find_headers(self.cfg.kernel_headers)
        node_check.apply_headers(headers)
        log.info("kernel headers: %s", headers.resolved)
        return headers

    def start(self) -> list[ProbeStatus]:
        # Probes first: after a restart the node is unobserved until they are
        # attached. Their records wait in the ring buffers until the readers
        # start, below, once the store and the span path are up to take them.
        t0 = time.monotonic()
        self.nvml.start()                    # its own thread (NVML may hang in the driver)
        owner, *rest = [cls(self.cfg, sink=self.sink, clock=self.clock)
                        for cls in probe_classes(self.cfg)]
        statuses = [owner.start()]
        self.probes.append(owner)
        for probe in rest:
            statuses.append(probe.start(span_ctx_pin=owner.shared_pin()))
            self.probes.append(probe)
        log.info("probes compiled and attached in %.2f s", time.monotonic() - t0)
        if self.store is not None:
            self.store.start()
        self.spans.start()
        for st in statuses:
            if st.attached:
                extra = f" ({len(st.failed_attachments)} failed: " \
                        f"{'; '.join(st.failed_attachments)})" if st.failed_attachments else ""
                log.info("probe %s attached: %d attachment(s)%s", st.name, len(st.attachments), extra)
            else:
                log.error("probe %s NOT attached: %s", st.name, st.reason)
        tc = next((p for p in self.probes if p.name == "tc_classify" and p.status.attached), None)
        if tc is not None:
            self.spans.join.http_bytes_reader = tc.request_bytes
        for probe in self.probes:
            if probe.status.attached:
                t = threading.Thread(target=self._read_loop, args=(probe,),
                                     name=f"reader-{probe.name}", daemon=True)
                t.start()
                self._threads.append(t)
        t = threading.Thread(target=self._refresh_loop, name="refresh", daemon=True)
        t.start()
        self._threads.append(t)
        self._start_http()
        self.admin.start()
        self.metrics_exporter = OtlpMetricsExporter(self.cfg.otlp, source=self.metrics.families,
                                                    node=self.cfg.node_name,
                                                    interval_s=self.cfg.window_s)
        return statuses

    def _start_http(self) -> None:
        try:
            self.http = AgentHttpServer(self.cfg.http_address, self.cfg.http_port, self.registry,
                                        ready=lambda: bool(self._threads) and not self._stopped,
                                        hints=self.scheduler.hints)
        except OSError as e:
            log.error("HTTP port %s:%d NOT open: %s; no /metrics", self.cfg.http_address,
                      self.cfg.http_port, e)
            return
        self.http.start()
        log.info("serving /metrics, /healthz, /readyz on %s:%d", self.cfg.http_address,
                 self.http.server_port)

    # -- loops -------------------------------------------------------------------
    def _read_loop(self, probe: Probe) -> None:
        while not self.stopping.is_set():
            try:
                probe.poll(100)
            except Exception:
                log.exception("probe %s: reading its ring buffer failed", probe.name)
                self.stopping.wait(1.0)

    def _refresh_loop(self) -> None:
        interval = self.cfg.discovery.interval_s
        last_stats = last_window = time.monotonic()
        while not self.stopping.wait(interval):
            self.spans.tick()
            if self.store is not None:
                self.store.tick()
            if time.monotonic() - last_window >= self.cfg.window_s:
                last_window = time.monotonic()
                self._close_window()
            for probe in self.probes:
                if probe.status.attached:
                    try:
                        probe.refresh()
                    except Exception:
                        log.exception("probe %s: refresh failed", probe.name)
            if time.monotonic() - last_stats >= 60:
                last_stats = time.monotonic()
                self.log_stats()

    def _close_window(self) -> None:
        """End of a metric window: GPU memory peaks, serving metrics, hints."""
        try:
            self.memory_peaks = self.nvml.window()
            gpus = self.nvml.snapshot()
            pcie = [r for g in gpus.values() for r in (g.pcie_tx_ratio, g.pcie_rx_ratio)
                    if r is not None]
            self.serving.roll(time.monotonic(), {
                "memory_used_ratio_max": max(self.memory_peaks.values(), default=None),
                "pcie_ratio_max": max(pcie, default=None)})
            self.scheduler.update(WindowInputs(
                request_duration_p95_seconds={m: self.serving.window_quantile(m, 0.95)
                                              for m in ("text", "image", "audio", "video")},
                gpu_utilization_ratio={g: s.sm_utilization_ratio for g, s in gpus.items()},
                gpu_memory_peak_ratio=dict(self.memory_peaks),
                gpu_memory_free_bytes={g: s.memory_free_bytes for g, s in gpus.items()}),
                time.time())
            if self.store is not None:
                self.store.add_metrics(self.metrics.families())
        except Exception:
            log.exception("closing the metric window failed")

    def log_stats(self) -> None:
        spans, evs = self.spans.join.coverage()
        log.info("join: %s; coverage spans=%s events=%s; export: %s",
                 self.spans.join.stats.as_dict(), spans, evs, self.spans.exporter.stats())
        for p in self.probes:
            if p.status.attached:
                log.info("probe %s: %d events read, %d dropped, %d undecodable",
                         p.name, p.events_read, p.events_dropped(), p.decode_errors)

    # -- shutdown ----------------------------------------------------------------
    def stop(self) -> None:
        """Stop polling, detach every probe (span-context owner last), flush
        the exporters with the time that remains; safe twice."""
        if self._stopped:
            return
        self._stopped = True
        self.stopping.set()
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s

        def left(cap: float) -> float:
            return max(0.0, min(cap, deadline - time.monotonic()))

        phases = [("admin API", self.admin.stop)]
        if self.http is not None:
            phases.append(("HTTP port", self.http.stop))
        phases.append(("readers", lambda: [t.join(timeout=left(1.0)) for t in self._threads]))
        if self.metrics_exporter is not None:   # its last export reads the maps: before detach
            phases.append(("metrics export", lambda: self.metrics_exporter.shutdown(
                timeout_millis=int(left(1.0) * 1000))))
        # Detaching waits on the kernel (RCU grace periods per tracepoint and
        # uprobe): the probes detach side by side, the span-context owner last.
        owner, rest = self.probes[:1], self.probes[1:]
        phases.append(("probes", lambda: _in_parallel([p.stop for p in rest], left(4.0))))
        phases += [(f"probe {p.name}", p.stop) for p in owner]
        phases.append(("NVML", lambda: self.nvml.stop(timeout_s=max(0.1, left(1.0)))))
        phases.append(("span path", lambda: self.spans.stop(deadline)))
        if self.store is not None:
            phases.append(("store", lambda: self.store.stop(deadline)))
        for name, fn in phases:
            t0 = time.monotonic()
            fn()
            log.debug("stopped %s in %.0f ms", name, (time.monotonic() - t0) * 1000)
        log.info("stopped: all probes detached, exporters flushed")
        log.debug("threads left: %s", [t.name for t in threading.enumerate()
                                      if t is not threading.current_thread()])

    def run_until_signal(self) -> None:
        def on_signal(signum, _frame):
            log.info("received %s, shutting down", signal.Signals(signum).name)
            self.stopping.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        while not self.stopping.wait(0.1):
            pass
        self.stop()
