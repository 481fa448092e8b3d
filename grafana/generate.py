"""Builds spanlet's Grafana dashboards (grafana/dashboards/*.json), one function
per dashboard: `python grafana/generate.py` writes them, `--check` says if they are stale.

Metric names, help and thresholds come from the metric catalogue
(agent/metrics/catalogue.py), so a dashboard line and its alert never disagree;
store columns come from exporters/clickhouse/schema.py and the kernel.* facts
from agent/join.py; the panel pieces are in grafana/panels.py."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for where in (ROOT, ROOT / "grafana"):  # run as a script from anywhere; panels.py beside it
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))

from panels import (CH, CH_FORMATS, CLICKHOUSE, Panel, Threshold, catalogue_thresholds,  # noqa: E402,F401
                    ch, ch_var, dashboard, describe, ds_var, prom, prom_var, row, text_var)
from opentelemetry.proto.trace.v1 import trace_pb2  # noqa: E402
from spanlet.join import BATCH_SHARES, FACT_ATTRIBUTES  # noqa: E402
from spanlet.exporters.clickhouse.queries import FINAL_READ, GPU_STALL_ATTRIBUTE, NAMESPACE_ATTRIBUTE, POD_ATTRIBUTE  # noqa: E402
from spanlet.exporters.clickhouse.rows import SPAN_KINDS  # noqa: E402
from spanlet.exporters.clickhouse.schema import KERNEL_EVENTS, TRACES, quote_string  # noqa: E402
from spanlet.metrics import catalogue  # noqa: E402
from spanlet.metrics.serving import ATTR_MODALITY, ATTR_SLO_CLASS, MODALITIES, SLO_NONE  # noqa: E402

OUT = ROOT / "grafana" / "dashboards"


DATABASE_VAR = text_var("database", "ClickHouse database", "spanlet",
                        "store.database of the agent config (SPANLET_STORE_DATABASE)")
NODE_VAR = prom_var("node", "Node", "label_values(spanlet_probe_attached, node)")


# -- (a) node overview: the 17 metrics of METRICS.md ----------------------------------

W = 'node=~"$node", namespace=~"$namespace", pod=~"$pod"'   # workload-labelled families
N = 'node=~"$node"'
RATE = "[$__rate_interval]"


@dataclass(frozen=True)
class Metric:
    """A node-overview panel of one METRICS.md metric; its name, help and
    thresholds are the catalogue's."""
    number: int               # row of METRICS.md
    meaning: str              # what the panel shows, for its title
    note: str                 # what the panel adds to the metric's help
    expr: str
    legend: str
    unit: str

    @property
    def family(self) -> str:
        return catalogue.by_number(self.number).name

    @property
    def description(self) -> str:
        help_ = catalogue.by_number(self.number).help
        return f"{self.family}: {help_}." + (f" {self.note}" if self.note else "")


def _quantile(q: float, family: str, by: str, sel: str = W) -> str:
    return (f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({family}_bucket{{{sel}}}{RATE})))")


METRICS = [
    Metric(1, "GPU kernel launches per second",
           "",
           f"sum by (node, namespace, pod, modality, api) "
           f"(rate(spanlet_gpu_kernel_launches_total{{{W}}}{RATE}))",
           "{{namespace}}/{{pod}} {{modality}} {{api}}", "ops"),
    Metric(2, "CUDA sync wait p99 (GPU stall)",
           "The GPU stall of a request; the threshold is on the p99.",
           _quantile(0.99, "spanlet_gpu_sync_wait_seconds", "node, namespace, pod, modality"),
           "{{namespace}}/{{pod}} {{modality}}", "s"),
    Metric(3, "Network bytes per second seen by TC",
           "By direction, protocol class and modality.",
           f"sum by (node, direction, protocol, modality) (rate(spanlet_network_bytes_total{{{N}}}{RATE}))",
           "{{direction}} {{protocol}} {{modality}}",
           "Bps"),
    Metric(4, "Jitter Sensitivity Score of media flows",
           "tau_plc + delta_buffer: 30 ms + 10 ms by default; RTP uses the RFC 3550 jitter.",
           f"max by (node, protocol, modality) (spanlet_jitter_sensitivity_score{{{N}}})",
           "{{protocol}} {{modality}}", "percentunit"),
    Metric(5, "mmap sandbox violations",
           "Per interval by rule (unauthorized, write_on_readonly, exec, oversize) and "
           "action (audit, kill); any violation is above the threshold. A series is born at "
           "its first violation, already at 1, which increase() cannot see: the second arm "
           "(as in the alert rule) counts a series that did not exist an interval ago.",
           f"sum by (node, namespace, pod, rule, action) "
           f"(increase(spanlet_sandbox_violations_total{{{W}}}{RATE}) or "
           f"(spanlet_sandbox_violations_total{{{W}}} unless "
           f"spanlet_sandbox_violations_total{{{W}}} offset $__rate_interval))",
           "{{namespace}}/{{pod}} {{rule}} {{action}}", "short"),
    Metric(6, "GPU SM utilisation",
           "Per GPU from NVML; feeds the schedulers.",
           f"max by (node, gpu) (spanlet_gpu_utilization_ratio{{{N}}})",
           "{{node}} {{gpu}}", "percentunit"),
    Metric(7, "GPU memory peak (used / total)",
           "Per GPU (activation memory peak). METRICS.md also asks for >= 1.2 GiB free, "
           "which is not exported as a metric.",
           f"max by (node, gpu) (spanlet_gpu_memory_peak_ratio{{{N}}})",
           "{{node}} {{gpu}}", "percentunit"),
    Metric(8, "PCIe utilisation of link capacity",
           "Per GPU and direction.",
           f"max by (node, gpu, direction) (spanlet_gpu_pcie_utilization_ratio{{{N}}})",
           "{{gpu}} {{direction}}", "percentunit"),
    Metric(9, "Request duration p95 per SLO class",
           "Each class is drawn against its target.",
           _quantile(0.95, "spanlet_request_duration_seconds", "node, namespace, modality, slo_class"),
           "{{slo_class}} {{modality}} {{namespace}} {{node}}", "s"),
    Metric(10, "Time to first token p95",
           "",
           _quantile(0.95, "spanlet_time_to_first_token_seconds",
                     "node, namespace, modality, slo_class"),
           "{{slo_class}} {{modality}} {{namespace}} {{node}}", "s"),
    Metric(11, "p99 latency volatility",
           "Over the last 12 windows by default (serving.volatility_windows).",
           f"max by (node, namespace, modality, slo_class) "
           f"(spanlet_p99_latency_volatility_ratio{{{W}}})",
           "{{slo_class}} {{modality}} {{namespace}} {{node}}", "percentunit"),
    Metric(12, "SLO compliance per class",
           "Class targets: gold 200 ms, silver 500 ms, bronze 800 ms by default "
           "(serving.slo_target_s).",
           f"min by (node, namespace, modality, slo_class) (spanlet_slo_compliance_ratio{{{W}}})",
           "{{slo_class}} {{modality}} {{namespace}} {{node}}", "percentunit"),
    Metric(13, "Throughput decay vs configured peak",
           "Label bottleneck names the cause (gpu_memory, pcie, kv_cache, none).",
           f"max by (node, namespace, pod, model, bottleneck) "
           f"(spanlet_throughput_decay_ratio{{{W}}})",
           "{{namespace}}/{{pod}} {{model}} ({{bottleneck}})", "percentunit"),
    Metric(14, "Audio/video alignment delay p95",
           "delta_sync is 16.7 ms by default; the defaults are 20 ms for frames, 120 ms for "
           "action-speech.",
           _quantile(0.95, "spanlet_modality_alignment_delay_seconds", "node, namespace"),
           "{{namespace}} {{node}}", "s"),
    Metric(15, "Modality fallbacks per second",
           "Vision -> OCR text -> plain text; the alert rule's default rate is drawn.",
           f"sum by (node, namespace, from, to) "
           f"(rate(spanlet_modality_degradations_total{{{W}}}{RATE}))",
           "{{namespace}} {{from}} -> {{to}}", "cps"),
    Metric(16, "Cross-modal embedding drift (CMSD)",
           "Over the last 3 windows by default (serving.drift_windows).",
           f"max by (node, namespace, pod, pair) (spanlet_embedding_drift_score{{{W}}})",
           "{{namespace}}/{{pod}} {{pair}}", "none"),
    Metric(17, "Span <-> kernel join coverage",
           "The health of the join.",
           f"min by (node, what) (spanlet_span_kernel_coverage_ratio{{{N}}})",
           "{{what}} {{node}}", "percentunit"),
]
LAYERS = {1: "Kernel layer (eBPF): METRICS.md #1-#5", 6: "Device layer (NVML): #6-#8",
          9: "Serving layer (spans joined with kernel events): #9-#17"}


def metric_panel(m: Metric) -> Panel:
    th = catalogue_thresholds(m.family)
    ratio = m.unit == "percentunit"
    return Panel("timeseries", f"#{m.number} {m.meaning} ({describe(th, m.unit)})",
                 [prom(m.expr, m.legend)], description=m.description,
                 unit=m.unit, thresholds=th, min=0 if ratio or m.unit == "s" else None)


def agent_health() -> list[Panel]:
    return [
        row("Agent health (self-metrics)"),
        Panel("stat", "Probes attached (1 = attached)",
              [prom(f"min by (node, probe) (spanlet_probe_attached{{{N}}})", "{{node}} {{probe}}")],
              description="spanlet_probe_attached: a probe that did not attach leaves its "
                          "metrics missing while the others run.",
              thresholds=[Threshold(1, False)], options={"graphMode": "none"}),
        Panel("timeseries", "Ring-buffer events read and dropped per second",
              [prom(f"sum by (node, probe) (rate(spanlet_events_read_total{{{N}}}{RATE}))",
                    "read {{probe}}"),
               prom(f"sum by (node, probe) (rate(spanlet_events_dropped_total{{{N}}}{RATE}))",
                    "dropped {{probe}}")],
              description="spanlet_events_read_total / spanlet_events_dropped_total.", unit="ops"),
        Panel("timeseries", "Join buffer and evictions",
              [prom(f"sum by (node) (spanlet_join_buffer_events{{{N}}})", "waiting {{node}}"),
               prom(f"sum by (node) (rate(spanlet_join_evicted_events_total{{{N}}}{RATE}))",
                    "evicted/s {{node}}")],
              description="Kernel events waiting for their span, and those whose span never came."),
        Panel("timeseries", "Upstream OTLP export: queue and drops",
              [prom(f"sum by (node) (spanlet_export_queue_spans{{{N}}})", "queued {{node}}"),
               prom(f"sum by (node, reason) (rate(spanlet_export_dropped_spans_total{{{N}}}{RATE}))",
                    "dropped/s {{reason}}")],
              description="spanlet_export_queue_spans and spanlet_export_dropped_spans_total."),
        Panel("timeseries", "Serving-metric contributions rejected per second",
              [prom(f"sum by (node, reason) (rate(spanlet_serving_rejected_total{{{N}}}{RATE}))",
                    "{{reason}}")],
              description="spanlet_serving_rejected_total: span attributes that did not count, "
                          "by reason.", unit="cps"),
        Panel("timeseries", "Scheduler batch size hints",
              [prom(f"max by (node, modality) (spanlet_scheduler_batch_size_hint{{{N}}})",
                    "{{modality}} {{node}}")],
              description="spanlet_scheduler_batch_size_hint, also served at GET /v1/hints."),
    ]


def node_overview() -> dict:
    panels: list[Panel] = []
    for m in METRICS:
        if m.number in LAYERS:
            panels.append(row(LAYERS[m.number]))
        panels.append(metric_panel(m))
    panels += agent_health()
    ns = "label_values(spanlet_request_duration_seconds_count{node=~\"$node\"}, namespace)"
    pod = ("label_values(spanlet_request_duration_seconds_count"
           "{node=~\"$node\", namespace=~\"$namespace\"}, pod)")
    return dashboard(
        "spanlet-node-overview", "spanlet / Node overview",
        "The 17 serving metrics of spanlet, one panel each with its default threshold drawn.",
        [ds_var("ds_prometheus", "prometheus", "Prometheus"), NODE_VAR,
         prom_var("namespace", "Namespace", ns), prom_var("pod", "Pod", pod)],
        panels)


# -- (b) GPU ------------------------------------------------------------------------------

G = 'node=~"$node", gpu=~"$gpu"'
SYNC = "spanlet_gpu_sync_wait_seconds"
LAUNCHES = "spanlet_gpu_kernel_launches_total"


def gpu() -> dict:
    sync_th = catalogue_thresholds(SYNC)
    panels = [
        row("Kernel launches (uprobes on libcuda / libcudart)"),
        Panel("timeseries", "Kernel launches per second by pod and modality",
              [prom(f"sum by (namespace, pod, modality) (rate({LAUNCHES}{{{W}}}{RATE}))",
                    "{{namespace}}/{{pod}} {{modality}}")],
              description=f"{LAUNCHES}, nested runtime->driver calls counted once.",
              unit="ops", stack=True, w=12),
        Panel("timeseries", "Kernel launches per second by API (driver / runtime)",
              [prom(f"sum by (node, api) (rate({LAUNCHES}{{{W}}}{RATE}))", "{{node}} {{api}}")],
              description=f"{LAUNCHES} by the API the application called.", unit="ops", w=6),
        Panel("bargauge", "Top pods by launches in the time range",
              [prom(f"topk(10, sum by (namespace, pod) (increase({LAUNCHES}{{{W}}}[$__range])))",
                    "{{namespace}}/{{pod}}", instant=True)],
              description=f"increase({LAUNCHES}) over the dashboard's time range.", w=6),
        row("Synchronisation stalls (time inside CUDA sync calls)"),
        Panel("timeseries", f"CUDA sync wait p50 / p90 / p99 per node ({describe(sync_th, 's')})",
              [prom(_quantile(q, SYNC, "node"), f"p{round(q * 100)} {{{{node}}}}")
               for q in (0.5, 0.9, 0.99)],
              description=f"{SYNC}: the GPU stall of a request; the threshold is on the p99.",
              unit="s", thresholds=sync_th, min=0),
        Panel("timeseries", f"CUDA sync wait p99 by pod and modality ({describe(sync_th, 's')})",
              [prom(_quantile(0.99, SYNC, "namespace, pod, modality"),
                    "{{namespace}}/{{pod}} {{modality}}")],
              description=f"{SYNC} p99 per workload.", unit="s", thresholds=sync_th, min=0),
        Panel("heatmap", "Sync wait distribution",
              [prom(f"sum by (le) (increase({SYNC}_bucket{{{W}}}{RATE}))", "{{le}}",
                    fmt="heatmap")],
              description=f"{SYNC}_bucket: waits per bucket per interval (buckets 1 us x 4^n).",
              unit="s"),
        Panel("timeseries", "Time stalled in sync per second, by pod",
              [prom(f"sum by (namespace, pod) (rate({SYNC}_sum{{{W}}}{RATE}))",
                    "{{namespace}}/{{pod}}")],
              description=f"rate({SYNC}_sum): seconds spent waiting for the GPU per second "
                          "(1 = one thread always waiting).", unit="s", stack=True, w=12),
        Panel("timeseries", "Sync calls per second by API",
              [prom(f"sum by (node, api) (rate({SYNC}_count{{{W}}}{RATE}))", "{{node}} {{api}}")],
              description=f"rate({SYNC}_count).", unit="ops", w=12),
        row("Device (NVML)"),
    ]
    for m in METRICS:
        if m.number in (6, 7, 8):
            p = metric_panel(m)
            for t in p.targets:
                t["expr"] = t["expr"].replace(N, G)
            panels.append(p)
    panels.append(Panel("stat", "NVML answering (1 = yes)",
                        [prom(f"min by (node) (spanlet_nvml_available{{{N}}})", "{{node}}")],
                        description="spanlet_nvml_available: without NVML the device metrics "
                                    "are absent.", thresholds=[Threshold(1, False)], w=6, h=6,
                        options={"graphMode": "none"}))
    panels.append(row("Span join and model throughput"))
    panels += [metric_panel(m) for m in METRICS if m.number in (17, 13)]
    return dashboard(
        "spanlet-gpu", "spanlet / GPU",
        "GPU kernel launches and synchronisation stalls per workload (eBPF uprobes), NVML "
        "utilisation, memory peak and PCIe, and how well kernel events join their spans.",
        [ds_var("ds_prometheus", "prometheus", "Prometheus"), NODE_VAR,
         prom_var("namespace", "Namespace",
                  'label_values(spanlet_gpu_kernel_launches_total{node=~"$node"}, namespace)'),
         prom_var("pod", "Pod", 'label_values(spanlet_gpu_kernel_launches_total'
                                '{node=~"$node", namespace=~"$namespace"}, pod)'),
         prom_var("gpu", "GPU", 'label_values(spanlet_gpu_utilization_ratio{node=~"$node"}, gpu)')],
        panels)


# -- (c) network and jitter -------------------------------------------------------------------

F = 'node=~"$node", protocol=~"$protocol", modality=~"$modality"'
BYTES = "spanlet_network_bytes_total"
PACKETS = "spanlet_network_packets_total"
WEB = "http1|http2|websocket"


def network() -> dict:
    jss = next(m for m in METRICS if m.number == 4)
    jss_th = catalogue_thresholds(jss.family)
    panels = [
        row("Traffic seen by the TC classifier (never dropped or altered)"),
        Panel("timeseries", "Bytes per second by direction",
              [prom(f"sum by (node, direction) (rate({BYTES}{{{F}}}{RATE}))", "{{node}} {{direction}}")],
              description=f"{BYTES} by direction (ingress / egress).", unit="Bps", stack=True),
        Panel("timeseries", "Bytes per second by protocol class",
              [prom(f"sum by (protocol) (rate({BYTES}{{{F}}}{RATE}))", "{{protocol}}")],
              description=f"{BYTES}: http1, http2 (gRPC), websocket, rtp, tcp, udp.",
              unit="Bps", stack=True),
        Panel("timeseries", "Bytes per second by modality",
              [prom(f"sum by (modality) (rate({BYTES}{{{F}}}{RATE}))", "{{modality}}")],
              description=f"{BYTES} by modality (port map, RTP payload type, HTTP content type).",
              unit="Bps", stack=True),
        Panel("timeseries", "Packets per second by protocol class",
              [prom(f"sum by (protocol) (rate({PACKETS}{{{F}}}{RATE}))", "{{protocol}}")],
              description=f"{PACKETS}.", unit="pps"),
        Panel("timeseries", "Mean packet size by protocol class",
              [prom(f"sum by (protocol) (rate({BYTES}{{{F}}}{RATE})) / "
                    f"sum by (protocol) (rate({PACKETS}{{{F}}}{RATE}))", "{{protocol}}")],
              description=f"rate({BYTES}) / rate({PACKETS}).", unit="bytes"),
        Panel("stat", "HTTP / gRPC / WebSocket share of bytes",
              [prom(f"(sum(rate({BYTES}{{node=~\"$node\", protocol=~\"{WEB}\"}}{RATE})) or vector(0))"
                    f" / sum(rate({BYTES}{{node=~\"$node\"}}{RATE}))", "share")],
              description=f"Bytes of HTTP/1.x, HTTP/2 (gRPC) and WebSocket over all bytes ({BYTES}).",
              unit="percentunit", min=0, max=1, options={"colorMode": "value"}),
        Panel("table", "Traffic mix in the time range",
              [prom(f"sum by (direction, protocol, modality) (increase({BYTES}{{{F}}}[$__range]))",
                    instant=True, fmt="table")],
              description=f"increase({BYTES}) over the dashboard's time range.", unit="bytes",
              w=24, h=8, overrides=[{"matcher": {"id": "byName", "options": "Time"},
                                     "properties": [{"id": "custom.hidden", "value": True}]}]),
        row("Media jitter"),
        Panel("timeseries", f"Jitter Sensitivity Score ({describe(jss_th, jss.unit)})",
              [prom(f"max by (node, protocol, modality) ({jss.family}{{{F}}})",
                    "{{node}} {{protocol}} {{modality}}")],
              description=jss.description, unit="percentunit",
              thresholds=jss_th, min=0, w=16),
        Panel("bargauge", f"JSS now by flow class ({describe(jss_th, jss.unit)})",
              [prom(f"max by (protocol, modality) ({jss.family}{{{F}}})", "{{protocol}} {{modality}}",
                    instant=True)],
              description=f"{jss.family}, latest value.", unit="percentunit",
              thresholds=jss_th, min=0, max=1),
    ]
    return dashboard(
        "spanlet-network", "spanlet / Network and jitter",
        "Bytes and packets the TC classifier saw by direction, protocol class and modality, "
        "and the Jitter Sensitivity Score of media flows.",
        [ds_var("ds_prometheus", "prometheus", "Prometheus"), NODE_VAR,
         prom_var("protocol", "Protocol", f'label_values({BYTES}{{node=~"$node"}}, protocol)'),
         prom_var("modality", "Modality", f'label_values({BYTES}{{node=~"$node"}}, modality)')],
        panels)


# -- ClickHouse pieces (store schema: exporters/clickhouse/schema.py) -------------------------

DB = "${database}"
SANDBOX_KIND = "SANDBOX"     # agent.events.Kind.SANDBOX.name, the Kind column of kernel_events


def ch_in(column: str, var: str) -> str:
    """Filter on a multi-value variable; All (the plugin's $__conditionalAll) is 1=1."""
    return f"$__conditionalAll({column} IN (${{{var}:sqlstring}}), ${var})"


def trace_filter(column: str = "TraceId") -> str:
    """The trace_id text box: empty means every trace."""
    return f"(${{trace_id:sqlstring}} = '' OR {column} = ${{trace_id:sqlstring}})"


def span_filters() -> str:
    return " AND ".join([
        "$__timeFilter(Timestamp)",
        ch_in(f"ResourceAttributes['{NAMESPACE_ATTRIBUTE}']", "namespace"),
        ch_in(f"ResourceAttributes['{POD_ATTRIBUTE}']", "pod"),
        ch_in("ServiceName", "service"),
        trace_filter()])


def fact_columns() -> str:
    """One numeric column per kernel.* fact a span can carry (agent/join.py)."""
    return ", ".join(f"toUInt64OrZero(SpanAttributes['{attr}']) AS {attr.replace('.', '_')}"
                     for attr, _ in FACT_ATTRIBUTES)


# The trace view the ClickHouse plugin draws (Query type Traces), in the column
# names its documentation gives for the OpenTelemetry schema.
TRACE_VIEW_SQL = (
    "SELECT TraceId AS traceID, SpanId AS spanID, SpanName AS operationName, "
    "ParentSpanId AS parentSpanID, ServiceName AS serviceName, Duration / 1000000 AS duration, "
    "Timestamp AS startTime, "
    "arrayMap(key -> map('key', key, 'value', SpanAttributes[key]), mapKeys(SpanAttributes)) AS tags, "
    "arrayMap(key -> map('key', key, 'value', ResourceAttributes[key]), mapKeys(ResourceAttributes)) "
    "AS serviceTags, if(StatusCode IN ('Error', 'STATUS_CODE_ERROR'), 2, 0) AS statusCode "
    f"FROM {DB}.{TRACES} WHERE TraceId = '${{__value.raw}}' ORDER BY startTime ASC {FINAL_READ}")


def _explore(pane: dict) -> str:
    # Explore's URL state; no '&', '#', '+' or '%' inside, so the JSON needs no escaping.
    return "/explore?schemaVersion=1&panes=" + json.dumps({"trace": pane}, separators=(",", ":"))


def trace_links() -> list[dict]:
    """Data links of a trace id column: the trace in the store (the ClickHouse
    plugin's trace view), in the trace backend (Tempo), and this dashboard filtered."""
    rng = {"from": "${__from}", "to": "${__to}"}
    store = _explore({"datasource": "${ds_clickhouse}", "range": rng, "queries": [{
        "refId": "A", "datasource": CH, "editorType": "sql", "queryType": "traces",
        "format": CH_FORMATS["traces"], "rawSql": TRACE_VIEW_SQL}]})
    tempo = _explore({"datasource": "${ds_traces}", "range": rng, "queries": [{
        "refId": "A", "datasource": {"type": "tempo", "uid": "${ds_traces}"},
        "queryType": "traceql", "query": "${__value.raw}"}]})
    return [
        {"title": "Trace view (ClickHouse store)", "url": store, "targetBlank": True},
        {"title": "Trace view (Tempo)", "url": tempo, "targetBlank": True},
        {"title": "Drill down into this trace",
         "url": "/d/spanlet-request-drilldown?var-trace_id=${__value.raw}&${__url_time_range}"
                "&var-database=${database}"},
    ]


def trace_link_override(column: str = "trace_id") -> dict:
    return {"matcher": {"id": "byName", "options": column},
            "properties": [{"id": "links", "value": trace_links()}]}


def table_units(**units: str) -> list[dict]:
    return [{"matcher": {"id": "byName", "options": col}, "properties": [{"id": "unit", "value": u}]}
            for col, u in units.items()]


def trace_table(title: str, sql: str, description: str, *, h: int, w: int = 24, **units: str) -> Panel:
    """A table from the store whose trace_id opens the trace; `units` by column name."""
    return Panel("table", title, [ch(sql)], description=description, w=w, h=h,
                 overrides=[trace_link_override(), *table_units(**units)])


# -- (d) sandbox ----------------------------------------------------------------------------

S = 'node=~"$node", namespace=~"$namespace", pod=~"$pod", rule=~"$rule", action=~"$action"'
VIOLATIONS = "spanlet_sandbox_violations_total"


def sandbox_filters() -> str:
    return " AND ".join([f"Kind = '{SANDBOX_KIND}'", "$__timeFilter(Timestamp)",
                         ch_in("Node", "node"), ch_in("K8sNamespace", "namespace"),
                         ch_in("K8sPodName", "pod"), ch_in("Rule", "rule"),
                         ch_in("Action", "action")])


def sandbox() -> dict:
    # Integer counts: the default "any violation" (> 0) is drawn as >= 1.
    any_violation = [Threshold(1, True)]
    step = {"lineInterpolation": "stepAfter"}
    where = sandbox_filters()
    panels = [
        row("Violations (Prometheus, counted in the kernel)"),
        Panel("stat", "Violations since the agent started (threshold: any)",
              [prom(f"sum({VIOLATIONS}{{{S}}}) or vector(0)", "violations")],
              description=f"sum of {VIOLATIONS}; METRICS.md's default threshold is 0.",
              thresholds=any_violation, w=6, h=6),
        Panel("stat", "Offenders killed (action kill)",
              [prom(f'sum({VIOLATIONS}{{{S}, action="kill"}}) or vector(0)', "kills")],
              description=f"{VIOLATIONS} with action=kill: the mode enforce sent SIGKILL.",
              thresholds=any_violation, w=6, h=6),
        Panel("bargauge", "Violations by workload",
              [prom(f"sum by (namespace, pod, container) ({VIOLATIONS}{{{S}}})",
                    "{{namespace}}/{{pod}} {{container}}", instant=True)],
              description=f"{VIOLATIONS} per container since the agent started.",
              thresholds=any_violation, w=12, h=6),
        Panel("timeseries", "Violations by rule (cumulative; a step is a new violation)",
              [prom(f"sum by (rule) ({VIOLATIONS}{{{S}}})", "{{rule}}")],
              description=f"{VIOLATIONS} by rule: unauthorized, write_on_readonly, exec, oversize.",
              custom=step, w=12),
        Panel("timeseries", "Violations by action (cumulative)",
              [prom(f"sum by (action) ({VIOLATIONS}{{{S}}})", "{{action}}")],
              description=f"{VIOLATIONS} by action: audit reports, kill also ends the process.",
              custom=step, w=12),
        Panel("table", "Violations by rule, action and workload",
              [prom(f"sum by (node, namespace, pod, container, rule, action) ({VIOLATIONS}{{{S}}})",
                    instant=True, fmt="table")],
              description=f"{VIOLATIONS}, one row per series.", w=24, h=7,
              overrides=[{"matcher": {"id": "byName", "options": "Time"},
                          "properties": [{"id": "custom.hidden", "value": True}]}]),
        row("Violations by tensor pool (ClickHouse store, kernel_events)"),
        Panel("table", "By pool, rule and action in the time range",
              [ch(f"SELECT PoolId AS pool_id, Rule AS rule, Action AS action, count() AS violations, "
                  f"uniqExact(K8sNamespace, K8sPodName) AS pods, uniqExact(Pid) AS processes, "
                  f"max(Len) AS largest_mapping, max(PoolMaxBytes) AS pool_max_bytes, "
                  f"max(Timestamp) AS last_seen "
                  f"FROM {DB}.{KERNEL_EVENTS} WHERE {where} "
                  f"GROUP BY pool_id, rule, action ORDER BY violations DESC, pool_id")],
              description="Pool ids number the pools of the agent's sandbox config; "
                          "`spanlet inspect sandbox` names their paths.", w=12,
              overrides=table_units(largest_mapping="bytes", pool_max_bytes="bytes")),
        Panel("timeseries", "Violations per interval by pool",
              [ch(f"SELECT $__timeInterval(Timestamp) AS time, concat('pool ', toString(PoolId)) AS pool, "
                  f"count() AS violations FROM {DB}.{KERNEL_EVENTS} WHERE {where} "
                  f"GROUP BY time, pool ORDER BY time", "timeSeries")],
              description="Sandbox events in the store per interval.", stack=True,
              custom={"drawStyle": "bars", "fillOpacity": 80}, w=12),
        trace_table("Recent violations",
                    f"SELECT Timestamp AS time, Node AS node, K8sNamespace AS namespace, K8sPodName AS pod, "
                    f"K8sContainerName AS container, Pid AS pid, Tid AS tid, Rule AS rule, "
                    f"Action AS action, PoolId AS pool_id, Len AS length, PoolMaxBytes AS pool_max_bytes, "
                    f"Prot AS prot, Fd AS fd, TraceId AS trace_id, SpanId AS span_id "
                    f"FROM {DB}.{KERNEL_EVENTS} WHERE {where} "
                    f"ORDER BY Timestamp DESC, Tid LIMIT 200",
                    "Newest first (the query of exporters/clickhouse/queries.py "
                    "sandbox_violations); a trace id opens its trace.", h=9,
                    length="bytes", pool_max_bytes="bytes"),
    ]
    pv = f'label_values({VIOLATIONS}{{node=~"$node"}}, '
    return dashboard(
        "spanlet-sandbox", "spanlet / Sandbox",
        "mmap sandbox violations of the tensor pools by rule, action, pool and workload.",
        [ds_var("ds_prometheus", "prometheus", "Prometheus"),
         ds_var("ds_clickhouse", CLICKHOUSE, "ClickHouse"), DATABASE_VAR, NODE_VAR,
         prom_var("namespace", "Namespace", pv + "namespace)"),
         prom_var("pod", "Pod", f'label_values({VIOLATIONS}{{node=~"$node", namespace=~"$namespace"}}, pod)'),
         prom_var("rule", "Rule", pv + "rule)"), prom_var("action", "Action", pv + "action)")],
        panels)


# -- (e) request drill-down (ClickHouse) -----------------------------------------------------------

# Request anatomy (DESIGN.md): where a request's time went. A request is a span
# of kind Server, as spanlet_request_duration_seconds counts them (the store
# keeps no span flags, so a server span under a local parent counts too); its
# modality and class are the labels of that metric: mm.modality folded into
# MODALITIES ("other" otherwise), slo.class as the span names it, "none" without.
SERVER_KIND = SPAN_KINDS[trace_pb2.Span.SPAN_KIND_SERVER]
OTHER_MODALITY = "other"          # serving._modality's fallback
REQUEST_TOTALS = "kernel.request."  # + a kernel.sched.* field: the server span's in-process subtree total
MODALITY_SQL = (f"if(SpanAttributes['{ATTR_MODALITY}'] IN ({', '.join(map(quote_string, MODALITIES))}), "
                f"SpanAttributes['{ATTR_MODALITY}'], '{OTHER_MODALITY}')")
SLO_CLASS_SQL = (f"if(mapContains(SpanAttributes, '{ATTR_SLO_CLASS}'), "
                 f"SpanAttributes['{ATTR_SLO_CLASS}'], '{SLO_NONE}')")
ANATOMY_QUANTILES = (50, 95, 99)
SLOWEST_REQUESTS = 20
_OWN_FACT = {field: attr for attr, field in FACT_ATTRIBUTES}
_BATCH_SHARE = {field: attr for attr, field in BATCH_SHARES}
ANATOMY_HOW = (
    "CPU, run queue and blocked (which holds the uninterruptible, I/O, wait) are the request's "
    f"{REQUEST_TOTALS}* totals (its in-process span subtree) where the server span carries them, "
    "else its own kernel.sched.* (the greater of the two: a subtree never has less than its root), "
    "plus its share of batched steps (kernel.batch.sched.*). GPU sync wait is the server span's own "
    f"{GPU_STALL_ATTRIBUTE} plus its batched steps' share (kernel.batch.gpu.sync_wait_ns); the sync "
    "waits of child spans have no subtree total and stay in CPU or blocked. A thread waiting for the "
    "GPU is blocked (blocking sync) or on a CPU (spin), so the GPU sync wait is taken out of blocked "
    "first, then CPU: nothing is counted twice. Other = duration - the rest, floored at 0 (time "
    "outside the request's spans: queues, awaiting other tasks).")


def _attr_ns(attr: str) -> str:
    return f"toUInt64OrZero(SpanAttributes['{attr}'])"


def _thread_state_ns(field: str) -> str:
    """A request's time in one scheduler state (ANATOMY_HOW)."""
    total, own = _attr_ns(REQUEST_TOTALS + field), _attr_ns(_OWN_FACT[field])
    return f"greatest({total}, {own}) + {_attr_ns(_BATCH_SHARE[field])}"


def anatomy_requests() -> str:
    """The requests in the range, one row each with its anatomy in ns
    (cpu_ns, run_queue_ns, blocked_ns, gpu_sync_wait_ns, other_ns)."""
    where = " AND ".join([f"SpanKind = '{SERVER_KIND}'", span_filters(),
                          ch_in(MODALITY_SQL, "modality"), ch_in(SLO_CLASS_SQL, "slo_class")])
    return ("SELECT Timestamp, TraceId, SpanId, ServiceName, SpanName, "
            f"ResourceAttributes['{POD_ATTRIBUTE}'] AS pod, Duration, "
            f"{MODALITY_SQL} AS modality, {SLO_CLASS_SQL} AS slo_class, "
            f"{_thread_state_ns('cpu_ns')} AS cpu_all_ns, {_thread_state_ns('runqueue_ns')} AS run_queue_ns, "
            f"{_thread_state_ns('blocked_ns')} AS blocked_all_ns, "
            f"{_attr_ns(GPU_STALL_ATTRIBUTE)} + {_attr_ns(_BATCH_SHARE['sync_wait_ns'])} AS gpu_sync_wait_ns, "
            "least(blocked_all_ns, gpu_sync_wait_ns) AS sync_when_blocked_ns, "
            "blocked_all_ns - sync_when_blocked_ns AS blocked_ns, "
            "cpu_all_ns - least(cpu_all_ns, gpu_sync_wait_ns - sync_when_blocked_ns) AS cpu_ns, "
            "toUInt64(greatest(toInt64(Duration) - toInt64(cpu_ns + run_queue_ns + blocked_ns + "
            "gpu_sync_wait_ns), 0)) AS other_ns "
            f"FROM {DB}.{TRACES} WHERE {where}")


def anatomy_at_quantiles() -> str:
    """Per modality, class and quantile q: the mean anatomy in seconds of the
    requests ranked by duration within half a percentile of q, and always the
    one at q's nearest rank ceil(q n)."""
    qs = ", ".join(str(q) for q in ANATOMY_QUANTILES)
    group = "modality, slo_class"
    return ("SELECT concat(modality, ' ', slo_class, ' p', toString(q)) AS requests, "
            "avg(cpu_ns) / 1e9 AS `CPU`, avg(run_queue_ns) / 1e9 AS `run queue`, "
            "avg(blocked_ns) / 1e9 AS `blocked`, avg(gpu_sync_wait_ns) / 1e9 AS `GPU sync wait`, "
            "avg(other_ns) / 1e9 AS `other` "
            "FROM (SELECT *, row_number() OVER by_duration AS duration_rank, "
            f"count() OVER (PARTITION BY {group}) AS in_group "
            f"FROM ({anatomy_requests()}) "
            f"WINDOW by_duration AS (PARTITION BY {group} ORDER BY Duration, TraceId, SpanId)) "
            f"ARRAY JOIN [{qs}] AS q "
            "WHERE duration_rank = intDiv(q * in_group + 99, 100) "
            "OR 2 * abs(100 * toInt64(duration_rank) - q * toInt64(in_group)) <= in_group "
            f"GROUP BY {group}, q ORDER BY {group}, q")


def request_anatomy() -> list[Panel]:
    quantiles = "/".join(f"p{q}" for q in ANATOMY_QUANTILES)
    return [
        row("Request anatomy"),
        Panel("barchart", f"Where the time of a request went, at {quantiles} of its duration",
              [ch(anatomy_at_quantiles())],
              description=(
                  "Server spans (requests) per modality and SLO class, in the modality and class "
                  f"variables. At each of {quantiles}: the requests whose rank by duration is within "
                  "half a percentile of it (at least the one at its nearest rank), their components "
                  "averaged: a bar is made of whole requests, its parts add up to their mean "
                  "duration, close to the quantile. (The quantiles of each component "
                  "would not add up to a duration: the p99 of CPU and the p99 of the run queue are "
                  "other requests.) " + ANATOMY_HOW),
              unit="s", stack=True, min=0, w=24, h=9, options={"xField": "requests"}),
        trace_table(f"Slowest requests' anatomy (the {SLOWEST_REQUESTS} slowest)",
                    "SELECT Timestamp AS time, TraceId AS trace_id, SpanId AS span_id, "
                    "ServiceName AS service, SpanName AS span, pod, modality, slo_class, "
                    "Duration AS duration, cpu_ns AS cpu, run_queue_ns AS run_queue, "
                    "blocked_ns AS blocked, gpu_sync_wait_ns AS gpu_sync_wait, other_ns AS other "
                    f"FROM ({anatomy_requests()}) "
                    f"ORDER BY duration DESC, trace_id, span_id LIMIT {SLOWEST_REQUESTS}",
                    "The slowest server spans in the range, in the modality and class variables, "
                    "split as in the chart above; a trace id opens its trace. " + ANATOMY_HOW, h=9,
                    duration="ns", cpu="ns", run_queue="ns", blocked="ns", gpu_sync_wait="ns",
                    other="ns"),
    ]


def drilldown() -> dict:
    spans_where = span_filters()
    ev_where = " AND ".join(["$__timeFilter(Timestamp)", ch_in("K8sNamespace", "namespace"),
                             ch_in("K8sPodName", "pod"), trace_filter()])
    stall = f"toUInt64OrZero(SpanAttributes['{GPU_STALL_ATTRIBUTE}'])"
    pod_col = f"ResourceAttributes['{POD_ATTRIBUTE}']"
    ns_col = f"ResourceAttributes['{NAMESPACE_ATTRIBUTE}']"
    facts = fact_columns()
    has_facts = "mapExists((k, v) -> startsWith(k, 'kernel.'), SpanAttributes)"
    panels = [
        Panel("stat", "Spans in range",
              [ch(f"SELECT count() AS spans FROM {DB}.{TRACES} WHERE {spans_where}")],
              description="Spans stored in otel_traces.", w=6, h=4, options={"graphMode": "none"}),
        Panel("stat", "Spans with kernel facts",
              [ch(f"SELECT countIf({has_facts}) / greatest(count(), 1) AS joined "
                  f"FROM {DB}.{TRACES} WHERE {spans_where}")],
              description="Share of the spans that carry kernel.* attributes from the join.",
              unit="percentunit", w=6, h=4, options={"graphMode": "none", "colorMode": "value"}),
        Panel("stat", "GPU stall time in range",
              [ch(f"SELECT sum({stall}) / 1e9 AS stalled FROM {DB}.{TRACES} WHERE {spans_where}")],
              description=f"Sum of {GPU_STALL_ATTRIBUTE} over the spans.", unit="s", w=6, h=4,
              options={"graphMode": "none", "colorMode": "value"}),
        Panel("stat", "Kernel events in range",
              [ch(f"SELECT count() AS events FROM {DB}.{KERNEL_EVENTS} WHERE {ev_where}")],
              description="Rows of kernel_events.", w=6, h=4, options={"graphMode": "none"}),
        trace_table("Spans and their kernel facts (newest first)",
                    f"SELECT Timestamp AS time, TraceId AS trace_id, SpanId AS span_id, "
                    f"ParentSpanId AS parent_span_id, ServiceName AS service, SpanName AS span, "
                    f"SpanKind AS kind, Duration AS duration, StatusCode AS status, "
                    f"{ns_col} AS namespace, {pod_col} AS pod, {facts} "
                    f"FROM {DB}.{TRACES} WHERE {spans_where} "
                    f"ORDER BY Timestamp DESC, SpanId LIMIT 500",
                    "otel_traces with the kernel.* facts the join added (GPU launches and "
                    "their time, sync wait, wire bytes, sandbox violations); a trace id "
                    "opens its trace.", h=10,
                    duration="ns", kernel_gpu_launch_ns="ns", kernel_gpu_sync_wait_ns="ns",
                    kernel_net_rx_bytes="bytes", kernel_net_tx_bytes="bytes"),
        trace_table("Slowest GPU stalls",
                    f"SELECT Timestamp AS time, TraceId AS trace_id, SpanId AS span_id, "
                    f"ServiceName AS service, SpanName AS span, Duration AS duration, "
                    f"{stall} AS gpu_sync_wait, {stall} / greatest(Duration, 1) AS stalled_share, "
                    f"{pod_col} AS pod FROM {DB}.{TRACES} WHERE {stall} > 0 AND {spans_where} "
                    f"ORDER BY gpu_sync_wait DESC, Timestamp DESC, SpanId LIMIT 20",
                    "Spans with the longest CUDA synchronisation wait (the query of "
                    "exporters/clickhouse/queries.py slowest_gpu_stall_spans).", w=14, h=9,
                    duration="ns", gpu_sync_wait="ns", stalled_share="percentunit"),
        Panel("timeseries", "GPU stall per interval by service",
              [ch(f"SELECT $__timeInterval(Timestamp) AS time, ServiceName AS service, "
                  f"sum({stall}) / 1e9 AS stalled FROM {DB}.{TRACES} WHERE {spans_where} "
                  f"GROUP BY time, service ORDER BY time", "timeSeries")],
              description=f"Sum of {GPU_STALL_ATTRIBUTE} per interval.", unit="s", w=10, h=9),
        trace_table("Sandbox violations",
                    f"SELECT Timestamp AS time, K8sNamespace AS namespace, K8sPodName AS pod, "
                    f"K8sContainerName AS container, Pid AS pid, Tid AS tid, Rule AS rule, "
                    f"Action AS action, PoolId AS pool_id, Len AS length, TraceId AS trace_id, "
                    f"SpanId AS span_id FROM {DB}.{KERNEL_EVENTS} "
                    f"WHERE Kind = '{SANDBOX_KIND}' AND {ev_where} ORDER BY Timestamp DESC, Tid LIMIT 100",
                    "mmap sandbox violations, with the span that was running.", h=7,
                    length="bytes"),
        trace_table("Kernel events (newest first)",
                    f"SELECT Timestamp AS time, Kind AS kind, Node AS node, K8sPodName AS pod, "
                    f"Pid AS pid, Tid AS tid, TraceId AS trace_id, SpanId AS span_id, "
                    f"Modality AS modality, Api AS api, Entry AS entry, DurationNs AS duration, "
                    f"Rule AS rule, Action AS action, "
                    f"if(SrcAddr = '', '', concat(SrcAddr, ':', toString(SrcPort), ' -> ', DstAddr, ':', "
                    f"toString(DstPort))) AS flow, Direction AS direction, ProtoClass AS protocol, "
                    f"RequestBytes AS request_bytes, ResponseBytes AS response_bytes "
                    f"FROM {DB}.{KERNEL_EVENTS} WHERE {ev_where} "
                    f"ORDER BY Timestamp DESC, Tid LIMIT 500",
                    "kernel_events: GPU launches and syncs, sandbox violations, HTTP "
                    "requests and flows seen on the wire.", h=10,
                    duration="ns", request_bytes="bytes", response_bytes="bytes"),
        Panel("timeseries", "Kernel events per interval by kind",
              [ch(f"SELECT $__timeInterval(Timestamp) AS time, Kind AS kind, count() AS events "
                  f"FROM {DB}.{KERNEL_EVENTS} WHERE {ev_where} "
                  f"GROUP BY time, kind ORDER BY time", "timeSeries")],
              description="Rows of kernel_events per interval.", stack=True, w=24, h=7),
        *request_anatomy(),
    ]
    attr = f"FROM {DB}.{TRACES} WHERE $__timeFilter(Timestamp) ORDER BY 1"
    requests = f"FROM {DB}.{TRACES} WHERE SpanKind = '{SERVER_KIND}' AND $__timeFilter(Timestamp) ORDER BY 1"
    return dashboard(
        "spanlet-request-drilldown", "spanlet / Request drill-down",
        "Spans with the kernel facts the agent joined to them, the slowest GPU stalls, sandbox "
        "violations and raw kernel events, from the ClickHouse store; trace ids open the trace.",
        [ds_var("ds_clickhouse", CLICKHOUSE, "ClickHouse"),
         ds_var("ds_traces", "tempo", "Trace backend (Tempo)"), DATABASE_VAR,
         ch_var("namespace", "Namespace", f"SELECT DISTINCT {ns_col} {attr}"),
         ch_var("pod", "Pod", f"SELECT DISTINCT {pod_col} {attr}"),
         ch_var("service", "Service", f"SELECT DISTINCT ServiceName {attr}"),
         ch_var("modality", "Modality (request anatomy)", f"SELECT DISTINCT {MODALITY_SQL} {requests}"),
         ch_var("slo_class", "SLO class (request anatomy)", f"SELECT DISTINCT {SLO_CLASS_SQL} {requests}"),
         text_var("trace_id", "Trace id", "", "32 hex digits; empty: every trace")],
        panels)


# -- output -------------------------------------------------------------------------------

BUILDERS = {"node-overview.json": node_overview, "gpu.json": gpu, "network.json": network,
            "sandbox.json": sandbox, "request-drilldown.json": drilldown}


def build() -> dict[str, dict]:
    """file name -> dashboard JSON."""
    return {name: fn() for name, fn in BUILDERS.items()}


def render(d: dict) -> str:
    return json.dumps(d, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a dashboard file is stale")
    args = ap.parse_args(argv)
    stale = []
    for name, d in build().items():
        path = OUT / name
        text = render(d)
        if path.exists() and path.read_text() == text:
            continue
        stale.append(name)
        if not args.check:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(("stale: " if args.check else "wrote: ") + ", ".join(stale))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
