"""The metric engine: every metric of METRICS.md and the self-metrics, as
Families, gathered from their sources when asked (scrape or export time).
A source that fails is left out and counted; the others are still served."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import Callable, Iterable, Protocol

from spanlet.cpu_throttle import PodCpuThrottle
from spanlet.request_totals import DROP_REASONS
from spanlet.metrics import Family, Sample, device, kernel, labels
from spanlet.metrics.catalogue import family

log = logging.getLogger(__name__)


def spanlet_span_kernel_coverage_ratio(join) -> Family:
    fam = family("spanlet_span_kernel_coverage_ratio")
    spans, evs = join.coverage()
    if spans is not None:
        fam.samples.append(Sample(labels(what="spans"), spans))
    if evs is not None:
        fam.samples.append(Sample(labels(what="events"), evs))
    return fam


def _single(name: str, value: float) -> Family:
    return family(name, [Sample((), value)])


def self_metrics(src: MetricEngine) -> list[Family]:
    """Probes, join and export queues of the agent itself."""
    attached = family("spanlet_probe_attached")
    failed = family("spanlet_probe_failed_attachments")
    read = family("spanlet_events_read_total")
    dropped = family("spanlet_events_dropped_total")
    limited = family("spanlet_events_cgroup_limited_total")
    for p in src.probes:
        lab = labels(probe=p.name)
        attached.samples.append(Sample(lab, 1 if p.status.attached else 0))
        failed.samples.append(Sample(lab, len(p.status.failed_attachments)))
        read.samples.append(Sample(lab, p.events_read))
        dropped.samples.append(Sample(lab, p.events_dropped()))
        by_pod: dict = defaultdict(int)
        for cgroup, n in p.cgroup_limited().items():
            by_pod[labels(probe=p.name, **src._workload(cgroup))] += n
        limited.samples += [Sample(k, v) for k, v in sorted(by_pod.items())]
    join = src.join
    exp = src.span_export.stats()
    drops = family("spanlet_export_dropped_spans_total")
    drops.samples = [Sample(labels(reason=r), exp.get(f"dropped_{r}", 0))
                     for r in ("queue_full", "failed", "shutdown")]
    rx = src.receiver.stats()
    otlp_req = family("spanlet_otlp_receiver_requests_total")
    otlp_req.samples = [Sample(labels(transport=t, outcome=o), n)
                        for t, by in sorted(rx["requests"].items()) for o, n in sorted(by.items())]
    otlp_rej = family("spanlet_otlp_receiver_rejected_spans_total")
    otlp_rej.samples = [Sample(labels(reason=r), n) for r, n in sorted(rx["spans_rejected"].items())]
    origins = family("spanlet_otlp_receiver_sender_origins_total")
    origins.samples = [Sample(labels(reason=r), n) for r, n in rx.get("origins", {}).items()]
    return [attached, failed, read, dropped, limited, drops, *store_metrics(src.store), otlp_req, otlp_rej,
            origins,
            _single("spanlet_otlp_receiver_accepted_spans_total", rx["spans_accepted"]),
            _single("spanlet_export_queue_bytes", exp.get("queue_bytes", 0)),
            _single("spanlet_join_buffer_events", join.pending_events()),
            _single("spanlet_join_evicted_events_total", join.stats.events_evicted),
            _single("spanlet_join_late_records_total", join.stats.late_records),
            *batch_metrics(join, src._workload),
            *foreign_metrics(join, src._workload),
            *span_facts_metrics(join, src._workload),
            *request_totals_metrics(src.request_totals),
            _single("spanlet_export_queue_spans", exp.get("queue_spans", 0)),
            _single("spanlet_nvml_available", 1 if src.nvml.status.available else 0)]


def request_totals_metrics(totals: RequestTotalsSource | None) -> list[Family]:
    """The waiting subtrees the request totals dropped, by reason (none
    without a span path: the family stays empty)."""
    fam = family("spanlet_request_totals_dropped_subtrees_total")
    if totals is not None:
        fam.samples = [Sample(labels(reason=r), totals.stats.dropped[r]) for r in DROP_REASONS]
    return [fam]


def _by_workload(fam: Family, counts: dict[int, int], workload, **extra: str) -> Family:
    """Counts by cgroup id summed by the pod labels of the cgroup (pods with
    several containers, or cgroups the enricher does not know: one sample)."""
    sums: dict = defaultdict(int)
    for cgroup, n in counts.items():
        sums[labels(**workload(cgroup), **extra)] += n
    fam.samples += [Sample(k, v) for k, v in sorted(sums.items())]
    return fam


def spanlet_pod_cpu_throttled_seconds_total(throttle: ThrottleSource, workload) -> Family:
    """Each pod cgroup's CFS throttled time, labelled by its pod (pod cgroups
    whose pod the enricher does not know: one sample, with empty labels)."""
    def pod(cgroup: int) -> dict[str, str]:
        w = workload(cgroup)
        return {"namespace": w["namespace"], "pod": w["pod"]}
    return _by_workload(family("spanlet_pod_cpu_throttled_seconds_total"), throttle.throttled(), pod)


def foreign_metrics(join, workload) -> list[Family]:
    """Kernel facts rows for a span's ids not added to it (DESIGN.md, Span
    context): by reason, and by the pod whose cgroup made them."""
    st = join.stats
    by_reason = family("spanlet_join_foreign_facts_total")
    by_reason.samples = [Sample(labels(reason="other_pod"), st.foreign_other_pod),
                         Sample(labels(reason="conflict"), st.foreign_conflict)]
    return [by_reason,
            _by_workload(family("spanlet_join_foreign_facts_by_pod_total"), join.foreign(),
                         workload)]


def batch_metrics(join, workload) -> list[Family]:
    """Batched steps: steps joined, request spans held back and shares waiting
    for their request now, shares that went late, expired or were dropped,
    and what each sender's own bounds dropped (labelled by its pod)."""
    held, pending = join.batch_pending()
    st = join.stats
    by_pod = family("spanlet_join_batch_pod_dropped_total")
    _by_workload(by_pod, join.batch_dropped_by_owner, workload, what="shares")
    _by_workload(by_pod, join.batch_hold_full_by_owner, workload, what="held")
    return [_single("spanlet_join_batch_steps_total", st.batch_steps),
            _single("spanlet_join_batch_held_spans", held),
            _single("spanlet_join_batch_pending_shares", pending),
            _single("spanlet_join_batch_late_shares_total", st.batch_late),
            _single("spanlet_join_batch_expired_shares_total", st.batch_expired),
            _single("spanlet_join_batch_dropped_links_total", st.batch_links_dropped), by_pod]


def span_facts_metrics(join, workload) -> list[Family]:
    """The kernel's span facts map: rows waiting, rows the LRU pushed out,
    rows the sweep expired, events refused a row by their pod's bound;
    nothing without the map (span_ctx not attached)."""
    st = join.facts_stats()
    if st is None:
        return []
    return [_single("spanlet_span_facts_rows", st.present),
            _single("spanlet_span_facts_evicted_total", st.evicted),
            _single("spanlet_span_facts_expired_total", join.stats.rows_expired),
            _by_workload(family("spanlet_span_facts_refused_total"), st.refused_by_cgroup,
                         workload)]


STORE_TABLES = ("otel_traces", "kernel_events", "metric_samples")
STORE_DROP_REASONS = ("spool_full", "rejected")


def store_metrics(store: StoreStats | None) -> list[Family]:
    """The store's queue, spool and drops; nothing when the store is off."""
    st = store.stats() if store is not None else None
    if st is None:
        return []
    by_table = st["dropped_rows_by_table"]
    keys = {(t, r) for t in STORE_TABLES for r in STORE_DROP_REASONS}
    keys |= {(t, r) for t, reasons in by_table.items() for r in reasons}
    drops = family("spanlet_store_dropped_rows_total")
    drops.samples = [Sample(labels(table=t, reason=r), by_table.get(t, {}).get(r, 0))
                     for t, r in sorted(keys)]
    out = [drops,
           _single("spanlet_store_queue_rows", st["queued_rows"]),
           _single("spanlet_store_spool_bytes", st["spooled_bytes"]),
           _single("spanlet_store_events_overflow_total", store.events_overflow)]
    if "engine_rss_bytes" in st:        # the embedded engine in its own process
        out += [_single("spanlet_store_engine_resident_bytes", st["engine_rss_bytes"]),
                _single("spanlet_store_engine_restarts_total", st["engine_restarts"])]
    return out


class MetricEngine:
    """Reads the sources the daemon hands it, each when asked (scrape or
    export time): the probes' maps, the join, the export queues, NVML, the
    pods' cgroups (cpu_throttle: by default this node's cgroup file system)."""

    def __init__(self, *, probes: ProbeSources, names: CgroupNames, join: JoinStats,
                 span_export: Stats, receiver: Stats, nvml: NvmlSource,
                 memory_peaks: Callable[[], dict[str, float]], store: StoreStats | None = None,
                 serving: FamilySource | None = None, scheduler: HintSource | None = None,
                 cpu_throttle: ThrottleSource | None = None, request_totals: RequestTotalsSource | None = None):
        self.probes, self.names, self.join = probes, names, join
        self.span_export, self.receiver, self.store = span_export, receiver, store
        self.nvml, self.memory_peaks = nvml, memory_peaks
        self.serving, self.scheduler = serving, scheduler
        self.cpu_throttle = cpu_throttle if cpu_throttle is not None else PodCpuThrottle()
        self.request_totals = request_totals
        self.scrape_errors: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def _workload(self, cgroup_id: int) -> dict[str, str]:
        attrs = self.names.attributes(cgroup_id) if cgroup_id else {}
        return {"namespace": attrs.get("k8s.namespace.name", ""),
                "pod": attrs.get("k8s.pod.name", ""),
                "container": attrs.get("k8s.container.name", "")}

    def _guard(self, source: str, fn: Callable[[], list[Family]]) -> list[Family]:
        try:
            return fn()
        except Exception as e:  # a partial failure never fails a scrape
            with self._lock:
                self.scrape_errors[source] += 1
            log.warning("metrics: source %s failed: %s", source, e)
            return []

    def families(self) -> list[Family]:
        out: list[Family] = []
        gpu, tc, sb = self.probes.gpu, self.probes.tc, self.probes.sandbox
        if gpu is not None:
            out += self._guard("gpu_launch", lambda: [
                kernel.spanlet_gpu_kernel_launches_total(gpu, self._workload),
                *kernel.spanlet_gpu_graph_launches_total(gpu, self._workload),
                kernel.spanlet_gpu_sync_wait_seconds(gpu, self._workload),
                kernel.spanlet_gpu_memcpy_bytes_total(gpu, self._workload)])
        if tc is not None:
            out += self._guard("tc_classify", lambda: [
                *kernel.spanlet_network_bytes_total(tc), kernel.spanlet_jitter_sensitivity_score(tc),
                *kernel.tc_self_metrics(tc)])
        if sb is not None:
            out += self._guard("mmap_sandbox", lambda: [
                kernel.spanlet_sandbox_violations_total(sb, self._workload),
                *kernel.sandbox_self_metrics(sb, self._workload)])
        span_ctx = self.probes.span_ctx
        if span_ctx is not None:
            out += self._guard("span_ctx", lambda: [*kernel.spanlet_span_marks_total(span_ctx),
                                                    kernel.spanlet_client_thread_only_processes(span_ctx)])
        if self.nvml.status.available:
            out += self._guard("nvml", lambda: [
                device.spanlet_gpu_utilization_ratio(self.nvml),
                device.spanlet_gpu_memory_peak_ratio(self.memory_peaks()),
                device.spanlet_gpu_pcie_utilization_ratio(self.nvml)])
        if self.serving is not None:
            out += self._guard("serving", self.serving.families)
        out += self._guard("join", lambda: [spanlet_span_kernel_coverage_ratio(self.join)])
        out += self._guard("cpu_throttle", lambda: [
            spanlet_pod_cpu_throttled_seconds_total(self.cpu_throttle, self._workload)])
        if self.scheduler is not None:
            out += self._guard("scheduler", lambda: [scheduler_batch_size_hint(self.scheduler)])
        out += self._guard("self", lambda: self_metrics(self))
        errors = family("spanlet_scrape_errors_total")
        with self._lock:
            errors.samples = [Sample(labels(source=s), n) for s, n in sorted(self.scrape_errors.items())]
        out.append(errors)
        return out


def scheduler_batch_size_hint(scheduler) -> Family:
    fam = family("spanlet_scheduler_batch_size_hint")
    for modality, hint in sorted(scheduler.hints()["hints"].items()):
        fam.samples.append(Sample(labels(modality=modality), hint["batch_size"]))
    return fam


# -- the sources, as the engine reads them (the daemon passes the real parts) --

class ProbeCounters(Protocol):
    """Any started probe: its status and its ring-buffer counters."""
    name: str
    status: object            # ProbeStatus: attached, failed_attachments
    events_read: int

    def events_dropped(self) -> int: ...


class ProbeSources(Iterable[ProbeCounters], Protocol):
    """Every started probe, and the three whose maps feed metrics, each None
    unless attached now (a detached probe's maps are gone)."""
    gpu: object | None        # launches(), sync_waits()
    tc: object | None         # totals(), jitter(), rejected(), uncounted()
    sandbox: object | None    # violations(), sweep_violations(), unresolved_opens(), ...
    span_ctx: object | None   # marks()


class CgroupNames(Protocol):
    def attributes(self, cgroup_id: int) -> dict[str, str]: ...


class JoinStats(Protocol):
    stats: object             # events_evicted, late_records, rows_expired, batch_*

    def coverage(self) -> tuple[float | None, float | None]: ...
    def pending_events(self) -> int: ...
    def batch_pending(self) -> tuple[int, int]: ...   # (held request spans, shares waiting)
    def foreign(self) -> dict[int, int]: ...          # foreign rows by the cgroup that made them
    batch_dropped_by_owner: dict                      # sender cgroup → shares dropped by its bound
    batch_hold_full_by_owner: dict                    # sender cgroup → spans not held by its bound
    def facts_stats(self) -> object | None: ...   # SpanFactsStats: present, evicted


class Stats(Protocol):
    def stats(self) -> dict: ...


class StoreStats(Protocol):
    events_overflow: int

    def stats(self) -> dict | None: ...


class NvmlSource(Protocol):
    status: object            # available

    def snapshot(self) -> dict: ...


class FamilySource(Protocol):
    def families(self) -> list[Family]: ...


class HintSource(Protocol):
    def hints(self) -> dict: ...


class ThrottleSource(Protocol):
    def throttled(self) -> dict[int, float]: ...   # pod cgroup id → CFS throttled seconds


class RequestTotalsSource(Protocol):
    stats: object        # .dropped: Counter by request_totals.DROP_REASONS
