"""The `spanlet run` daemon: checks the node, starts every probe (one that fails
is reported while the others run), reads their ring buffers, refreshes
discovery, and on SIGTERM/SIGINT detaches everything within the deadline."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from spanlet import events, modality
from spanlet.probes import node_check
from spanlet.admin import AdminServer
from spanlet.config import Config, SchedulerThresholds, ServingSettings
from spanlet.metrics.engine import MetricEngine
from spanlet.metrics.serving import ServingMetrics
from spanlet.pipeline.spans import SpanPath
from spanlet.pipeline.store import StorePath
from spanlet.scheduler import Scheduler, WindowInputs
from spanlet.nvml import NvmlPoller
from spanlet.memory import release_startup_memory, trim_heap
from spanlet.probes.base import Probe, ProbeStatus
from spanlet.probes.starter import ProbeStarter, check_node, probe_classes  # noqa: F401 (probe_classes: cli)

from spanlet.exporters.otlp.metric_exporter import OtlpMetricsExporter
from spanlet.exporters.http import AgentHttpServer
from spanlet.exporters.prometheus import SpanletCollector, SpanletRegistry

log = logging.getLogger("spanlet")

class _Attached:
    """A StartedProbes attribute: the started probe of that name while it is
    attached, else None (a detached probe's maps are gone)."""

    def __init__(self, probe_name: str) -> None:
        self.probe_name = probe_name

    def __get__(self, probes: "StartedProbes | None", owner=None):
        if probes is None:
            return self
        return next((p for p in probes if p.name == self.probe_name and p.status.attached), None)


class StartedProbes(list):
    """The probes the daemon started, in start order; the metric engine and
    the admin API read the four whose maps they show while each is attached."""

    gpu = _Attached("gpu_launch")
    tc = _Attached("tc_classify")
    sandbox = _Attached("mmap_sandbox")
    span_ctx = _Attached("span_ctx")


def _drain(probes) -> None:
    """Before a join: every record of these probes' rings that their read
    loops have not taken yet, handed on now (Probe.drain)."""
    for probe in probes:
        try:
            probe.drain()
        except Exception:  # its read loop logs what fails in the ring
            pass


def _guarded(what: str, fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:
        log.exception("%s failed", what)


def _in_parallel(fns: list[Callable[[], None]], timeout_s: float) -> None:
    threads = [threading.Thread(target=fn, name="stop", daemon=True) for fn in fns]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))


class Daemon:
    """Builds the parts, hands each only what it reads (never itself), starts
    them in order and stops them against one deadline."""

    def __init__(self, cfg: Config, sink: Callable[[events._Event], None] | None = None,
                 starter: ProbeStarter | None = None, stopping: threading.Event | None = None):
        """starter: the probes' start begun before the daemon was built (the
        node checked first); by default start() begins it. stopping: the
        event SIGTERM and SIGINT set (cli.stop_on_signals)."""
        self.cfg = cfg
        self._starter = starter
        self.clock = starter.clock if starter is not None else events.MonotonicClock()
        self.serving = ServingMetrics(ServingSettings(window_s=cfg.window_s,
                                                      **cfg.serving.model_dump()),
                                      start=time.monotonic())
        self.scheduler = Scheduler(SchedulerThresholds(**cfg.scheduler.model_dump()),
                                   window_s=cfg.window_s)
        self.spans = SpanPath(cfg, on_joined=self._on_joined)
        self.store = StorePath(cfg, self.spans.enricher) if cfg.store.enabled else None
        printer = sink

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
        self.probes = StartedProbes()
        self.metrics = MetricEngine(**self._sources(), serving=self.serving,
                                    scheduler=self.scheduler, request_totals=self.spans.request_totals)
        self.admin = AdminServer(cfg, **self._sources(), families=self.metrics.families,
                                 hints=self.scheduler.hints)
        self.registry = SpanletRegistry()
        self.registry.register(SpanletCollector(self.metrics, cfg.node_name))
        self.http: AgentHttpServer | None = None
        self.metrics_exporter: OtlpMetricsExporter | None = None
        self.stopping = stopping if stopping is not None else threading.Event()
        self._threads: list[threading.Thread] = []
        self._stopped = False

    def _sources(self) -> dict:
        """What the metric engine and the admin API read, each when asked."""
        return dict(probes=self.probes, names=self.spans.enricher, join=self.spans.join,
                    span_export=self.spans.exporter, receiver=self.spans.receiver,
                    store=self.store, nvml=self.nvml, memory_peaks=lambda: self.memory_peaks)

    def _on_joined(self, resource_spans, blobs=None) -> None:
        self.serving.observe(resource_spans, time.monotonic(), blobs)
        if self.store is not None:
            self.store.add_spans(resource_spans, blobs)
        self.admin.on_joined(resource_spans)

    # -- start-up ----------------------------------------------------------------
    def check_node(self) -> node_check.Headers:
        """Root, mounts and headers; raises node_check.EnvironmentProblem."""
        return check_node(self.cfg)

    def start(self) -> list[ProbeStatus]:
        # Probes first: after a restart the node is unobserved until they are
        # attached. Their records wait in the ring buffers until the readers
        # start, below, once the store and the span path are up to take them.
        # The store (its engine's library loaded, its schema checked) starts
        # in a thread once the compiles are done (the engine's start changes
        # the process's directory, which a BCC compile then works in), beside
        # the attaches: it takes no record before the readers start.
        t0 = time.monotonic()
        self.nvml.start()                    # its own thread (NVML may hang in the driver)
        starter = self._starter or ProbeStarter(self.cfg, self.clock)
        store_start = None
        if self.store is not None:
            def start_store(store=self.store, done=starter.compiles_done) -> None:
                done.wait()
                t = time.monotonic()
                store.start()
                log.info("store started in %.2f s, beside the probes' attaches", time.monotonic() - t)
            store_start = ThreadPoolExecutor(1, thread_name_prefix="store-start")
            started = store_start.submit(start_store)
        try:
            starter.finish(sink=self.sink)
        finally:
            self.probes.extend(starter.probes)   # what was started, for stop() to detach
            if store_start is not None:
                store_start.shutdown()
                started.result()                 # what it raised, raised here
        statuses = starter.statuses()
        t1 = time.monotonic()
        log.info("probes compiled and attached %.2f s after the daemon's start (%s)", t1 - t0, "; ".join(
            f"{st.name} compile {st.compile_s:.2f} s{' (cached)' if st.cached else ''}, attach {st.attach_s:.2f} s" for st in statuses))
        self.spans.start()
        log.info("span path started in %.2f s", time.monotonic() - t1)
        for st in statuses:
            if st.attached:
                extra = f" ({len(st.failed_attachments)} failed: " \
                        f"{'; '.join(st.failed_attachments)})" if st.failed_attachments else ""
                log.info("probe %s attached: %d attachment(s)%s", st.name, len(st.attachments), extra)
            else:
                log.error("probe %s NOT attached: %s", st.name, st.reason)
        if self.probes.tc is not None:
            self.spans.join.http_bytes_reader = self.probes.tc.request_bytes
        if self.probes.span_ctx is not None:
            self.spans.join.facts = self.probes.span_ctx.facts
            if self.spans.receiver.running:
                self.spans.watch_senders(self.probes.span_ctx)
        readers = [probe for probe in self.probes if probe.status.attached and probe.sends_records()]
        for probe in readers:
            t = threading.Thread(target=self._read_loop, args=(probe,),
                                 name=f"reader-{probe.name}", daemon=True)
            t.start()
            self._threads.append(t)
        self.spans.before_join = lambda: _drain(readers)
        t = threading.Thread(target=self._refresh_loop, name="refresh", daemon=True)
        t.start()
        self._threads.append(t)
        self._start_http()
        self.admin.start()
        self.metrics_exporter = OtlpMetricsExporter(self.cfg.otlp, source=self.metrics.families,
                                                    node=self.cfg.node_name,
                                                    interval_s=self.cfg.window_s)
        # once the agent serves (/readyz answers meanwhile): 0.1 s of a start
        released = release_startup_memory()
        if self.store is not None:
            released += self.store.release_memory()     # the engine's process, where it has one
        log.info("start-up memory given back: %.0f MB of LLVM/clang/chdb mappings paged out, heap trimmed",
                 released / 2**20)
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
    # (the read loops wait up to 100 ms for a wake-up, and the programs wake
    # them once per batch of records: the span path drains the rings itself
    # before each join, _drain)
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
            # One step that fails is logged; the loop (discovery, windows, late records) goes on.
            _guarded("span path tick", self.spans.tick)
            if self.store is not None:
                _guarded("store tick", self.store.tick)
            if time.monotonic() - last_window >= self.cfg.window_s:
                last_window = time.monotonic()
                self._close_window()
            for probe in self.probes:
                if probe.status.attached:
                    _guarded(f"probe {probe.name}: refresh", probe.refresh)
            _guarded("admin history", self.admin.sample)
            if time.monotonic() - last_stats >= 60:
                last_stats = time.monotonic()
                self.log_stats()
                _guarded("heap trim", trim_heap)

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
                                              for m in modality.NAMED},
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
        # Facts that came late are read before their map goes.
        phases.append(("span facts sweep", lambda: self.spans.join.sweep(force=True)))
        # Detaching waits on the kernel (RCU grace periods per tracepoint and
        # uprobe): the probes detach side by side, the span-context owner last.
        owner, rest = self.probes[:1], self.probes[1:]
        phases.append(("probes", lambda: _in_parallel([p.stop for p in rest], left(4.0))))
        phases += [(f"probe {p.name}", p.stop) for p in owner]
        phases.append(("NVML", lambda: self.nvml.stop(timeout_s=max(0.1, left(1.0)))))
        phases.append(("span path", lambda: self.spans.stop(deadline)))
        if self.store is not None:
            phases.append(("store", lambda: self.store.stop(deadline)))
        for name, fn in phases:   # a phase that fails never keeps the next ones from running
            t0 = time.monotonic()
            _guarded(f"stopping {name}", fn)
            log.debug("stopped %s in %.0f ms", name, (time.monotonic() - t0) * 1000)
        log.info("stopped: all probes detached, exporters flushed")
        log.debug("threads left: %s", [t.name for t in threading.enumerate()
                                      if t is not threading.current_thread()])

    def run_until_signal(self) -> None:
        """Until `stopping` is set, then stop(). `spanlet run` has SIGTERM and
        SIGINT set it from before the start (cli.stop_on_signals): a signal
        during the start ends the agent right after it."""
        # The handler's set() ends the wait at once; the timeout only bounds it.
        while not self.stopping.wait(5.0):
            pass
        self.stop()

