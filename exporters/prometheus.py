"""Prometheus exposition: a collector that reads the BPF maps, NVML and the
join at scrape time (ebpf_exporter style), and the agent's HTTP port serving
/metrics, /healthz and /readyz. A source that fails is counted in
spanlet_scrape_errors_total{source} and left out; the scrape still answers."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)

# Upper bounds (seconds) of the sync-wait histogram: the kernel's log2 µs
# buckets (bucket i holds waits below 2^i µs), every second one, up to ~67 s.
SYNC_WAIT_BOUNDS_US = [2 ** i for i in range(0, 27, 2)]
WORKLOAD_LABELS = ("namespace", "pod", "container")


class SpanletCollector:
    """Collects from a running Daemon (probes by name, nvml, spans)."""

    def __init__(self, daemon):
        self.daemon = daemon
        self.scrape_errors: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def describe(self) -> Iterable[Metric]:
        # Registration must not read maps: families without samples.
        return []

    # -- helpers -------------------------------------------------------------------
    def _probe(self, name: str):
        for p in self.daemon.probes:
            if p.name == name and p.status.attached:
                return p
        return None

    def _workload(self, cgroup_id: int) -> tuple[str, str, str]:
        attrs = self.daemon.spans.enricher.attributes(cgroup_id) if cgroup_id else {}
        return (attrs.get("k8s.namespace.name", ""), attrs.get("k8s.pod.name", ""),
                attrs.get("k8s.container.name", ""))

    def _guard(self, source: str, fn: Callable[[], Iterable[Metric]]) -> list[Metric]:
        try:
            return list(fn())
        except Exception as e:  # a partial failure never fails the scrape
            with self._lock:
                self.scrape_errors[source] += 1
            log.warning("scrape: source %s failed: %s", source, e)
            return []

    def collect(self) -> Iterable[Metric]:
        node = self.daemon.cfg.node_name
        out: list[Metric] = []
        out += self._guard("gpu_launch", lambda: self._gpu(node))
        out += self._guard("tc_classify", lambda: self._network(node))
        out += self._guard("mmap_sandbox", lambda: self._sandbox(node))
        out += self._guard("nvml", lambda: self._device(node))
        out += self._guard("join", lambda: self._join(node))
        out += self._guard("self", lambda: self._self(node))
        yield from out
        errors = CounterMetricFamily("spanlet_scrape_errors", "Scrape sources that failed",
                                     labels=["node", "source"])
        with self._lock:
            for source, n in sorted(self.scrape_errors.items()):
                errors.add_metric([node, source], n)
        yield errors

    # -- kernel layer --------------------------------------------------------------
    def _gpu(self, node: str) -> list[Metric]:
        probe = self._probe("gpu_launch")
        if probe is None:
            return []
        launches = CounterMetricFamily(
            "spanlet_gpu_kernel_launches", "GPU kernel launches seen by the launch uprobes "
            "(nested runtime->driver calls once)",
            labels=["node", *WORKLOAD_LABELS, "modality", "api"])
        sums: dict[tuple, int] = defaultdict(int)
        for (cgroup, modality, api), n in probe.launches().items():
            sums[(*self._workload(cgroup), modality.name, api.name)] += n
        for key, n in sorted(sums.items()):
            launches.add_metric([node, *key], n)
        wait = HistogramMetricFamily(
            "spanlet_gpu_sync_wait_seconds", "Time threads spent inside CUDA synchronisation calls",
            labels=["node", *WORKLOAD_LABELS, "modality", "api"])
        hist: dict[tuple, list] = {}
        stats = probe.sync_wait()
        for key, buckets in probe.sync_wait_buckets().items():
            cgroup, modality, api = key
            labels = (*self._workload(cgroup), modality.name, api.name)
            count, total_ns = stats.get(key, (0, 0))
            acc = hist.setdefault(labels, [[0] * len(buckets), 0, 0])
            acc[0] = [a + b for a, b in zip(acc[0], buckets)]
            acc[1] += count
            acc[2] += total_ns
        for labels, (buckets, count, total_ns) in sorted(hist.items()):
            cumulative, rows = 0, []
            for i, n in enumerate(buckets):
                cumulative += n
                bound = 2 ** i
                if bound in SYNC_WAIT_BOUNDS_US:
                    rows.append((repr(bound / 1e6), cumulative))
            rows.append(("+Inf", count))
            wait.add_metric([node, *labels], rows, total_ns / 1e9)
        return [launches, wait]

    def _network(self, node: str) -> list[Metric]:
        probe = self._probe("tc_classify")
        if probe is None:
            return []
        nbytes = CounterMetricFamily("spanlet_network_bytes", "Bytes seen by the TC classifier",
                                     labels=["node", "direction", "protocol", "modality"])
        packets = CounterMetricFamily("spanlet_network_packets", "Packets seen by the TC classifier",
                                      labels=["node", "direction", "protocol", "modality"])
        for (direction, proto, modality), (p, b) in sorted(probe.totals().items()):
            nbytes.add_metric([node, direction, proto, modality], b)
            packets.add_metric([node, direction, proto, modality], p)
        jss = GaugeMetricFamily(
            "spanlet_jitter_sensitivity_score", "Share of media packets in the window whose "
            "inter-arrival deviation exceeds tau_plc + delta_buffer",
            labels=["node", "protocol", "modality"])
        for (proto, modality), st in sorted(probe.jitter().items()):
            jss.add_metric([node, proto, modality], st.jss)
        return [nbytes, packets, jss]

    def _sandbox(self, node: str) -> list[Metric]:
        probe = self._probe("mmap_sandbox")
        if probe is None:
            return []
        fam = CounterMetricFamily("spanlet_sandbox_violations", "mmap sandbox violations",
                                  labels=["node", *WORKLOAD_LABELS, "rule", "action"])
        sums: dict[tuple, int] = defaultdict(int)
        for (cgroup, rule, action), n in probe.violations().items():
            sums[(*self._workload(cgroup), rule, action)] += n
        for key, n in sorted(sums.items()):
            fam.add_metric([node, *key], n)
        return [fam]

    # -- device layer --------------------------------------------------------------
    def _device(self, node: str) -> list[Metric]:
        nvml = self.daemon.nvml
        if not nvml.status.available:
            return []
        util = GaugeMetricFamily("spanlet_gpu_utilization_ratio", "SM utilisation 0..1",
                                 labels=["node", "gpu"])
        peak = GaugeMetricFamily("spanlet_gpu_memory_peak_ratio",
                                 "Peak of used/total GPU memory over the window", labels=["node", "gpu"])
        pcie = GaugeMetricFamily("spanlet_gpu_pcie_utilization_ratio",
                                 "PCIe throughput / link capacity", labels=["node", "gpu", "direction"])
        for gpu, s in sorted(nvml.snapshot().items()):
            if s.sm_utilization_ratio is not None:
                util.add_metric([node, gpu], s.sm_utilization_ratio)
            if s.pcie_tx_ratio is not None:
                pcie.add_metric([node, gpu, "tx"], s.pcie_tx_ratio)
            if s.pcie_rx_ratio is not None:
                pcie.add_metric([node, gpu, "rx"], s.pcie_rx_ratio)
        for gpu, ratio in sorted(self.daemon.memory_peaks.items()):
            peak.add_metric([node, gpu], ratio)
        return [util, peak, pcie]

    # -- span join -----------------------------------------------------------------
    def _join(self, node: str) -> list[Metric]:
        join = self.daemon.spans.join
        spans, evs = join.coverage()
        cov = GaugeMetricFamily("spanlet_span_kernel_coverage_ratio",
                                "Share of spans joined to a kernel event (what=spans) and of "
                                "kernel events that found their span (what=events)",
                                labels=["node", "what"])
        if spans is not None:
            cov.add_metric([node, "spans"], spans)
        if evs is not None:
            cov.add_metric([node, "events"], evs)
        buf = GaugeMetricFamily("spanlet_join_buffer_events", "Kernel events waiting for their span",
                                labels=["node"])
        buf.add_metric([node], join.pending_events())
        st = join.stats
        evicted = CounterMetricFamily("spanlet_join_evicted_events",
                                      "Kernel events whose span never came (TTL or size bound)",
                                      labels=["node"])
        evicted.add_metric([node], st.events_evicted)
        late = CounterMetricFamily("spanlet_join_late_records",
                                   "Spans emitted for events that came after their span",
                                   labels=["node"])
        late.add_metric([node], st.late_records)
        return [cov, buf, evicted, late]

    # -- the agent itself ----------------------------------------------------------
    def _self(self, node: str) -> list[Metric]:
        attached = GaugeMetricFamily("spanlet_probe_attached", "1 if the probe is attached",
                                     labels=["node", "probe"])
        failed = GaugeMetricFamily("spanlet_probe_failed_attachments",
                                   "Attachments of the probe that failed", labels=["node", "probe"])
        read = CounterMetricFamily("spanlet_events_read", "Ring-buffer records decoded",
                                   labels=["node", "probe"])
        dropped = CounterMetricFamily("spanlet_events_dropped",
                                      "Ring-buffer records that found no room", labels=["node", "probe"])
        for p in self.daemon.probes:
            attached.add_metric([node, p.name], 1 if p.status.attached else 0)
            failed.add_metric([node, p.name], len(p.status.failed_attachments))
            read.add_metric([node, p.name], p.events_read)
            dropped.add_metric([node, p.name], p.events_dropped())
        exp = self.daemon.spans.exporter.stats()
        queue = GaugeMetricFamily("spanlet_export_queue_spans", "Spans waiting for upstream export",
                                  labels=["node"])
        queue.add_metric([node], exp.get("queue_spans", 0))
        drops = CounterMetricFamily("spanlet_export_dropped_spans", "Spans not exported",
                                    labels=["node", "reason"])
        for reason in ("queue_full", "failed", "shutdown"):
            drops.add_metric([node, reason], exp.get(f"dropped_{reason}", 0))
        nvml_up = GaugeMetricFamily("spanlet_nvml_available", "1 if NVML answers", labels=["node"])
        nvml_up.add_metric([node], 1 if self.daemon.nvml.status.available else 0)
        return [attached, failed, read, dropped, queue, drops, nvml_up]


class _Handler(BaseHTTPRequestHandler):
    server: "AgentHttpServer"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, status, ctype = generate_latest(self.server.registry), 200, CONTENT_TYPE_LATEST
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
                 ready: Callable[[], bool]):
        super().__init__((address, port), _Handler)
        self.registry = registry
        self.ready = ready
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self.server_close()
            self._thread = None
