"""The one catalogue of the metric families the agent exports: name, type, unit,
help, labels, what produces each one, and the default alert thresholds of METRICS.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from spanlet.metrics import Family


@dataclass(frozen=True)
class Threshold:
    """A default of METRICS.md. `alert` names its rule in
    daemonset/prometheus-rules.yaml ("" for a default no rule can carry)."""
    alert: str
    op: Literal[">", "<"]             # the side that fires: above (">") or below ("<")
    value: float
    quantile: float | None = None     # histograms: the quantile compared
    slo_class: str = ""               # per-class defaults (#9, #12)
    rate: bool = False                # compared as a per-second rate, not a reading

    def breached(self, value: float | None) -> bool:
        return value is not None and (value > self.value if self.op == ">" else value < self.value)


@dataclass(frozen=True)
class Source:
    """What produces a family: the module that reads or computes it and, for a
    kernel-backed one, the BPF map it is read from (named after the family)."""
    module: str
    bpf_map: str = ""


@dataclass(frozen=True)
class Metric:
    name: str
    type: Literal["counter", "gauge", "histogram"]
    unit: str                         # "seconds", "bytes", "ratio", "" (a count)
    help: str
    labels: tuple[str, ...]           # besides `node`, which the exporters add
    source: Source
    number: int = 0                   # row of METRICS.md; 0: a self-metric
    thresholds: tuple[Threshold, ...] = ()


WORKLOAD = ("namespace", "pod", "container")
REQUEST = ("namespace", "pod", "modality", "slo_class")
FLOW = ("direction", "protocol", "modality")
VIOLATION = (*WORKLOAD, "rule", "action")
CLASSES = ("gold", "silver", "bronze")


def _per_class(stem: str, op, values, quantile=None) -> tuple[Threshold, ...]:
    return tuple(Threshold(f"{stem}{c.title()}", op, v, quantile, c) for c, v in zip(CLASSES, values))


def _gpu(bpf_map: str = "") -> Source:
    return Source("spanlet.probes.gpu", bpf_map)


def _tc(bpf_map: str = "") -> Source:
    return Source("spanlet.probes.tc.probe", bpf_map)


def _sandbox(bpf_map: str = "") -> Source:
    return Source("spanlet.probes.sandbox.probe", bpf_map)


NVML = Source("spanlet.nvml")
SERVING = Source("spanlet.metrics.serving")
JOIN = Source("spanlet.join")
ENGINE = Source("spanlet.metrics.engine")
EXPORT = Source("spanlet.exporters.otlp.span_exporter")
RECEIVER = Source("spanlet.exporters.otlp.receiver")
STORE = Source("spanlet.exporters.clickhouse.sink")

KERNEL = (
    Metric("spanlet_gpu_kernel_launches_total", "counter", "",
           "GPU kernel launches: api=driver|runtime: launch calls (attempts, counted at entry "
           "whether they succeed or fail; a runtime call and the driver call it makes count "
           "once); api=graph: kernels run by graph replays, for graphs whose capture or "
           "building the agent saw; launches recorded during a stream capture are not counted",
           (*WORKLOAD, "modality", "api"), _gpu("spanlet_gpu_kernel_launches_total"), 1),
    Metric("spanlet_gpu_sync_wait_seconds", "histogram", "seconds",
           "Time threads spent inside CUDA synchronisation calls",
           (*WORKLOAD, "modality", "api"), _gpu("spanlet_gpu_sync_wait_seconds"), 2,
           (Threshold("SpanletGpuSyncWaitP99High", ">", 0.05, 0.99),)),
    Metric("spanlet_network_bytes_total", "counter", "bytes", "Bytes seen by the TC classifier",
           FLOW, _tc("spanlet_network_bytes_total"), 3),
    Metric("spanlet_jitter_sensitivity_score", "gauge", "ratio",
           "Share of media packets in the window whose inter-arrival deviation exceeds "
           "tau_plc + delta_buffer", ("protocol", "modality"),
           _tc("spanlet_jitter_sensitivity_score"), 4,
           (Threshold("SpanletJitterSensitivityHigh", ">", 0.08),)),
    Metric("spanlet_sandbox_violations_total", "counter", "", "mmap sandbox violations",
           VIOLATION, _sandbox("spanlet_sandbox_violations_total"), 5,
           (Threshold("SpanletSandboxViolation", ">", 0),)),
)

DEVICE = (
    Metric("spanlet_gpu_utilization_ratio", "gauge", "ratio", "SM utilisation 0..1", ("gpu",), NVML, 6),
    Metric("spanlet_gpu_memory_peak_ratio", "gauge", "ratio",
           "Peak of used/total GPU memory over the last window", ("gpu",), NVML, 7,
           (Threshold("SpanletGpuMemoryPeakHigh", ">", 0.87),)),
    Metric("spanlet_gpu_pcie_utilization_ratio", "gauge", "ratio",
           "PCIe throughput / link capacity (generation x width)", ("gpu", "direction"), NVML, 8,
           (Threshold("SpanletGpuPcieSaturated", ">", 0.85),)),
)

SERVING_LAYER = (
    Metric("spanlet_request_duration_seconds", "histogram", "seconds",
           "Duration of server-kind root spans (requests)", REQUEST, SERVING, 9,
           _per_class("SpanletRequestLatency", ">", (0.2, 0.5, 0.8), 0.95)),
    Metric("spanlet_time_to_first_token_seconds", "histogram", "seconds",
           "Span start to the first_token event (or gen_ai.server.time_to_first_token)",
           REQUEST, SERVING, 10, (Threshold("SpanletTimeToFirstTokenHigh", ">", 0.4, 0.95),)),
    Metric("spanlet_p99_latency_volatility_ratio", "gauge", "ratio",
           "Stddev / mean of the per-window p99 request duration over the last windows",
           REQUEST, SERVING, 11, (Threshold("SpanletLatencyVolatilityHigh", ">", 0.032),)),
    # Bronze has no objective in METRICS.md: 0.75 is this project's choice.
    Metric("spanlet_slo_compliance_ratio", "gauge", "ratio",
           "Share of the window's requests that met their SLO class target", REQUEST, SERVING, 12,
           _per_class("SpanletSloComplianceLow", "<", (0.95, 0.85, 0.75))),
    Metric("spanlet_throughput_decay_ratio", "gauge", "ratio",
           "1 - observed output tokens/s / configured peak tokens/s of the model",
           ("namespace", "pod", "model", "bottleneck"), SERVING, 13,
           (Threshold("SpanletThroughputDecayHigh", ">", 0.45),)),
    # The second default (action-speech) has no rule: no label tells it from frames.
    Metric("spanlet_modality_alignment_delay_seconds", "histogram", "seconds",
           "max(0, |pts_audio - pts_video| - delta_sync) per trace", ("namespace", "pod"),
           SERVING, 14, (Threshold("SpanletModalityAlignmentDelayHigh", ">", 0.02, 0.95),
                         Threshold("", ">", 0.12, 0.95))),
    # "rate alert" without a number in METRICS.md: 0.05/s is this project's choice.
    Metric("spanlet_modality_degradations_total", "counter", "",
           "Modality fallbacks reported by spans (mm.degraded_from -> mm.degraded_to)",
           ("namespace", "pod", "from", "to"), SERVING, 15,
           (Threshold("SpanletModalityDegradationRateHigh", ">", 0.05, rate=True),)),
    Metric("spanlet_embedding_drift_score", "gauge", "",
           "CMSD: stddev over the last windows of the cosine distance between two "
           "modalities' mean embeddings", ("namespace", "pod", "pair"), SERVING, 16,
           (Threshold("SpanletEmbeddingDriftHigh", ">", 0.018),)),
    Metric("spanlet_span_kernel_coverage_ratio", "gauge", "ratio",
           "Share of spans joined to a kernel event (what=spans) and of kernel events that "
           "found their span (what=events)", ("what",), JOIN, 17,
           (Threshold("SpanletSpanKernelCoverageLow", "<", 0.95),)),
)

# Request anatomy (METRICS.md, beyond the 17).
ANATOMY = (
    Metric("spanlet_request_cpu_seconds", "histogram", "seconds",
           "CPU time of server-kind root spans' requests: their in-process span subtree's "
           "kernel.sched.cpu_ns (kernel.request.cpu_ns); exemplars carry a recent request's "
           "trace id", REQUEST, SERVING),
    Metric("spanlet_request_runqueue_seconds", "histogram", "seconds",
           "Run-queue time of server-kind root spans' requests (runnable, waiting for a CPU; "
           "includes CFS quota throttling): kernel.request.runqueue_ns; exemplars carry a "
           "recent request's trace id", REQUEST, SERVING),
    Metric("spanlet_gpu_memcpy_bytes_total", "counter", "bytes",
           "Bytes copied by the CUDA driver's copy calls, by the direction the call states "
           "(h2d, d2h, d2d; other: unified-address copies whose direction the call does not say)",
           (*WORKLOAD, "direction"), _gpu("spanlet_gpu_memcpy_bytes_total")),
    Metric("spanlet_pod_cpu_throttled_seconds_total", "counter", "seconds",
           "CFS throttled time of the pod's cgroup (cpu.stat throttled_usec on cgroup v2, "
           "throttled_time on v1)", WORKLOAD[:2], Source("spanlet.cpu_throttle")),
)

PROBES = Source("spanlet.probes.base")

SELF = (
    Metric("spanlet_network_packets_total", "counter", "", "Packets seen by the TC classifier",
           FLOW, _tc("spanlet_network_bytes_total")),
    Metric("spanlet_tc_rejected_total", "counter", "",
           "Headers and datagrams refused (invalid, truncated or duplicate traceparent, invalid "
           "RTP, unknown RTP payload type, impossible headers)", ("reason",),
           _tc("spanlet_tc_rejected_total")),
    Metric("spanlet_tc_uncounted_packets_total", "counter", "",
           "TCP/UDP packets not counted (IP fragments, headers outside linear data)", ("reason",),
           _tc("tc_uncounted_packets_total")),
    Metric("spanlet_sandbox_sweep_violations_total", "counter", "",
           "Violations of #5 found by the /proc sweep, not at the mmap call (links, relative "
           "paths, inherited or dup'd fds, mprotect)", VIOLATION, _sandbox()),
    Metric("spanlet_sandbox_unresolved_opens_total", "counter", "",
           "Opens under a prefix with a '..' component, left to the sweep", (),
           _sandbox("spanlet_sandbox_unresolved_opens_total")),
    Metric("spanlet_sandbox_untracked_fds_total", "counter", "",
           "Pool fds the kernel could not remember (its pool fd table was full)", (),
           _sandbox("spanlet_sandbox_untracked_fds_total")),
    Metric("spanlet_sandbox_adopted_fds_total", "counter", "",
           "Pool fds the sweep found and handed to the kernel", (), _sandbox()),
    Metric("spanlet_sandbox_sweep_seconds", "gauge", "seconds", "Duration of the last /proc sweep",
           (), _sandbox()),
    Metric("spanlet_gpu_graph_launches_total", "counter", "",
           "CUDA graph replays (cuGraphLaunch calls; #1's companion), known graphs or not",
           (*WORKLOAD, "modality"), _gpu("spanlet_gpu_graph_launches_total")),
    Metric("spanlet_gpu_unknown_graph_launches_total", "counter", "",
           "Graph replays whose graph the agent did not see made (made before it attached, or "
           "pushed out of its bounded maps): their kernels are not in #1",
           (*WORKLOAD, "modality"), _gpu("spanlet_gpu_unknown_graph_launches_total")),
    Metric("spanlet_request_totals_dropped_subtrees_total", "counter", "",
           "Span subtrees that waited for their server span's request totals (kernel.request.*) "
           "and were dropped: age (past join.request_totals_ttl_s), traces or subtrees (the bounds "
           "of what waits), trace_full (join.request_totals_max_subtrees_per_trace)", ("reason",), Source("spanlet.request_totals")),
    Metric("spanlet_span_marks_total", "counter", "",
           "Span marker calls seen (span starts and ends of instrumented threads)", (),
           Source("spanlet.probes.span_ctx", "spanlet_span_marks_total")),
    Metric("spanlet_span_marks_invalid_total", "counter", "",
           "Span marker calls with a span id and an all-zero trace id (no span has it): "
           "the thread is taken out of its span", (),
           Source("spanlet.probes.span_ctx", "spanlet_span_marks_invalid_total")),
    Metric("spanlet_client_thread_only_processes", "gauge", "",
           "Instrumented processes whose spans are followed per thread only, not per coroutine, "
           "by what their requests run on (trio, gevent, eventlet, loop: an event loop whose tasks "
           "could not be followed): kernel facts of requests sharing a thread may land on each "
           "other's spans", ("runtime",),
           Source("spanlet.probes.span_ctx", "spanlet_client_thread_only_processes")),
    Metric("spanlet_probe_attached", "gauge", "", "1 if the probe is attached", ("probe",), PROBES),
    Metric("spanlet_probe_failed_attachments", "gauge", "", "Attachments of the probe that failed",
           ("probe",), PROBES),
    Metric("spanlet_events_read_total", "counter", "", "Ring-buffer records decoded", ("probe",),
           PROBES),
    Metric("spanlet_events_dropped_total", "counter", "", "Ring-buffer records that found no room",
           ("probe",), Source("spanlet.probes.base", "spanlet_events_dropped_total")),
    Metric("spanlet_events_cgroup_limited_total", "counter", "",
           "Ring-buffer records not sent because their cgroup had sent "
           "ringbuf_records_per_cgroup_s records that second (sampled GPU stream, sandbox "
           "records); the counts in the kernel maps and span facts are unaffected",
           ("probe", *WORKLOAD), Source("spanlet.probes.base", "cgroup_record_budget")),
    Metric("spanlet_export_dropped_spans_total", "counter", "", "Spans not exported upstream",
           ("reason",), EXPORT),
    Metric("spanlet_export_queue_spans", "gauge", "", "Spans waiting for upstream export", (), EXPORT),
    Metric("spanlet_export_queue_bytes", "gauge", "bytes",
           "Serialized bytes of spans waiting for upstream export", (), EXPORT),
    Metric("spanlet_otlp_receiver_requests_total", "counter", "",
           "OTLP export requests by transport and outcome (ok, partial, invalid, too_large, "
           "not_received, timeout, malformed_http, unauthenticated, rate_limited, "
           "tls_handshake_failed, ...)", ("transport", "outcome"), RECEIVER),
    Metric("spanlet_otlp_receiver_rejected_spans_total", "counter", "",
           "Spans the OTLP receiver refused, by reason", ("reason",), RECEIVER),
    Metric("spanlet_otlp_receiver_accepted_spans_total", "counter", "",
           "Spans the OTLP receiver passed on", (), RECEIVER),
    Metric("spanlet_otlp_receiver_sender_origins_total", "counter", "",
           "OTLP export requests by how their sender was established from the connection: "
           "socket (the kernel saw the connecting process), pod_ip (the peer address is a "
           "pod's own), unknown (neither: the spans get no kernel facts)", ("reason",),
           Source("spanlet.pipeline.senders")),
    Metric("spanlet_join_buffer_events", "gauge", "",
           "Sampled kernel events (span events) waiting for their span", (), JOIN),
    Metric("spanlet_join_evicted_events_total", "counter", "",
           "Sampled kernel events never put on a span (span never came or came first, "
           "or the buffer was full)", (), JOIN),
    Metric("spanlet_join_late_records_total", "counter", "",
           "Records emitted for kernel facts that came after their span", (), JOIN),
    Metric("spanlet_join_batch_steps_total", "counter", "",
           "Step spans (spans with links to requests) whose facts were shared among their requests",
           (), JOIN),
    Metric("spanlet_join_batch_held_spans", "gauge", "",
           "Request spans held back now for the steps that served them (join.batch_wait_s)", (),
           JOIN),
    Metric("spanlet_join_batch_pending_shares", "gauge", "",
           "Requests whose step shares wait for their request span", (), JOIN),
    Metric("spanlet_join_batch_late_shares_total", "counter", "",
           "Request shares of steps that came after their request span went out (late records)",
           (), JOIN),
    Metric("spanlet_join_batch_expired_shares_total", "counter", "",
           "Request shares dropped because their request span did not come (join.ttl_s or "
           "join.batch_max_pending)", (), JOIN),
    Metric("spanlet_join_batch_dropped_links_total", "counter", "",
           "Step links given no share (past join.batch_max_links, or no valid span ids)", (), JOIN),
    Metric("spanlet_join_batch_pod_dropped_total", "counter", "",
           "Batch waiting room entries a sender's own bounds refused, by the sender's pod: "
           "what=shares dropped (join.batch_max_pending_per_pod), what=held: request spans not "
           "held (join.batch_max_held_per_pod)", (*WORKLOAD, "what"), JOIN),
    Metric("spanlet_join_foreign_facts_total", "counter", "",
           "Kernel facts rows for a span's ids that the span did not get: reason=other_pod, made "
           "in a cgroup not of the sender's pod; reason=conflict, sender unknown and another "
           "cgroup did more for the span", ("reason",), JOIN),
    Metric("spanlet_join_foreign_facts_by_pod_total", "counter", "",
           "Foreign kernel facts rows (spanlet_join_foreign_facts_total) by the pod whose cgroup "
           "made them", WORKLOAD, JOIN),
    Metric("spanlet_span_facts_refused_total", "counter", "",
           "Kernel events that got no span facts row because their pod's cgroup held "
           "join.span_facts_max_per_cgroup live rows, by pod", WORKLOAD,
           Source("spanlet.probes.span_ctx", "span_facts")),
    Metric("spanlet_span_facts_rows", "gauge", "",
           "Rows of the kernel's span facts map waiting for their span", (),
           Source("spanlet.probes.span_ctx", "span_facts")),
    Metric("spanlet_span_facts_evicted_total", "counter", "",
           "Span facts rows pushed out of the map by its bound before their span came", (),
           Source("spanlet.probes.span_ctx", "span_facts")),
    Metric("spanlet_span_facts_expired_total", "counter", "",
           "Span facts rows deleted because their span did not come within join.ttl_s", (), JOIN),
    Metric("spanlet_store_dropped_rows_total", "counter", "",
           "Rows that never reached the store (spool_full: memory queue and spool at their "
           "bounds; rejected: refused by the store)", ("table", "reason"), STORE),
    Metric("spanlet_store_queue_rows", "gauge", "", "Rows waiting in memory for the store", (), STORE),
    Metric("spanlet_store_spool_bytes", "gauge", "bytes", "Bytes spooled on disk for the store", (),
           STORE),
    Metric("spanlet_store_events_overflow_total", "counter", "",
           "Kernel events dropped before the store's queue", (), STORE),
    Metric("spanlet_store_engine_resident_bytes", "gauge", "bytes",
           "Resident memory of the embedded store's engine process (store.engine_process)", (), STORE),
    Metric("spanlet_store_engine_restarts_total", "counter", "",
           "Starts of the embedded store's engine process after it ended", (), STORE),
    Metric("spanlet_serving_rejected_total", "counter", "",
           "Span contributions to the serving metrics that did not count, by reason", ("reason",),
           SERVING),
    Metric("spanlet_serving_label_overflow_total", "counter", "",
           "Label values folded into 'overflow' by the cardinality limit", ("label",), SERVING),
    Metric("spanlet_nvml_available", "gauge", "", "1 if NVML answers", (), NVML),
    Metric("spanlet_scheduler_batch_size_hint", "gauge", "",
           "Batch size hint per modality for the serving stack's schedulers", ("modality",),
           Source("spanlet.scheduler")),
    Metric("spanlet_scrape_errors_total", "counter", "", "Metric sources that failed", ("source",),
           ENGINE),
)

CATALOGUE: tuple[Metric, ...] = (*KERNEL, *DEVICE, *SERVING_LAYER, *ANATOMY, *SELF)
BY_NAME: dict[str, Metric] = {m.name: m for m in CATALOGUE}
# The 17 of METRICS.md, in its order.
SERVING_METRICS: tuple[Metric, ...] = tuple(sorted((m for m in CATALOGUE if m.number),
                                                   key=lambda m: m.number))


def family(name: str, samples: list | None = None) -> Family:
    """An empty (or filled) Family with the catalogue's type, help and unit;
    KeyError for a name the catalogue does not hold."""
    m = BY_NAME[name]
    return Family(m.name, m.type, m.help, m.unit, [] if samples is None else samples)


def breached(name: str, value: float | None) -> bool:
    """Whether one reading is past the metric's first default (the one without
    a label, for the metrics `spanlet inspect` colours)."""
    return BY_NAME[name].thresholds[0].breached(value)


def by_number(number: int) -> Metric:
    return SERVING_METRICS[number - 1]
