"""The store as the OpenTelemetry Collector writes it, in a real chdb store:
the Collector's own tables made first (its stable DDL) and then the agent's
store opened on them, or the agent's own; spans written the agent's way read
back with the Collector's spellings, through the trace-id lookup, the SQL
Grafana's ClickHouse plugin generates, the Collector's documented queries,
spanlet's own reads and every dashboard query; a table spanlet cannot use is
refused with one line."""

from __future__ import annotations

import logging
import time

import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

import grafana_queries as gq
from collector_ddl import collector_documented_queries, plugin_trace_id_sql, traces_ddl
from spanlet.exporters.clickhouse import BackendError, queries, rows, schema
from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend

DB = "spanlet"
NOW = time.time_ns() - 600 * 10**9
TRACE = bytes(range(1, 17))
OTHER = bytes(range(2, 18))
SERVICE = "demo-serving"


# The two requests' (server spans') anatomy: span 1 with its subtree's totals
# (kernel.request.*, more than its own) and a batched step's share of GPU sync
# wait, more than its blocked time; span 4 with only its own scheduler facts and
# a step's CPU share, more than its duration in all.
REQUEST_ATTRIBUTES = {
    1: {"mm.modality": "text", "slo.class": "gold", "kernel.sched.cpu_ns": 1_000_000,
        "kernel.request.cpu_ns": 2_000_000, "kernel.sched.runqueue_ns": 100_000,
        "kernel.request.runqueue_ns": 500_000, "kernel.request.blocked_ns": 600_000,
        "kernel.batch.gpu.sync_wait_ns": 999_000},
    4: {"kernel.sched.cpu_ns": 3_000_000, "kernel.batch.sched.cpu_ns": 500_000,
        "kernel.sched.runqueue_ns": 2_000_000, "kernel.sched.blocked_ns": 1_000_000},
}


def _set_attributes(span: trace_pb2.Span, attributes: dict) -> None:
    for k, v in attributes.items():
        value = span.attributes.add(key=k).value
        if isinstance(v, str):
            value.string_value = v
        else:
            value.int_value = v


def _spans() -> list[trace_pb2.ResourceSpans]:
    """A trace of a SERVER span (an error) with two children 3 s later, and
    one span of another trace."""
    rs = trace_pb2.ResourceSpans()
    for k, v in (("service.name", SERVICE), ("k8s.namespace.name", "prod"), ("k8s.pod.name", "web-0")):
        rs.resource.attributes.add(key=k).value.string_value = v
    ss = rs.scope_spans.add()
    for trace, sid, kind, at_s, error in ((TRACE, 1, trace_pb2.Span.SPAN_KIND_SERVER, 0, True),
                                          (TRACE, 2, trace_pb2.Span.SPAN_KIND_INTERNAL, 3, False),
                                          (TRACE, 3, trace_pb2.Span.SPAN_KIND_CLIENT, 3, False),
                                          (OTHER, 4, trace_pb2.Span.SPAN_KIND_SERVER, 1, False)):
        s = ss.spans.add(trace_id=trace, span_id=sid.to_bytes(8, "big"), name=f"step-{sid}", kind=kind,
                         start_time_unix_nano=NOW + at_s * 10**9,
                         end_time_unix_nano=NOW + at_s * 10**9 + 5_000_000)
        s.attributes.add(key="kernel.gpu.launches").value.int_value = sid * 10
        s.attributes.add(key="kernel.gpu.sync_wait_ns").value.int_value = sid * 1000
        _set_attributes(s, REQUEST_ATTRIBUTES.get(sid, {}))
        if error:
            s.status.code = trace_pb2.Status.STATUS_CODE_ERROR
    return [rs]


def _open(tmp_path, collector_first: bool, caplog=None) -> ChdbBackend:
    b = ChdbBackend(str(tmp_path / "store"), database=DB)
    if collector_first:
        for stmt in traces_ddl(DB):
            b.query(stmt)
    if caplog is not None:
        caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spanlet") if caplog is not None else _nothing():
        assert b.ensure_schema() == schema.SCHEMA_VERSION
    spans = _spans()
    b.insert(schema.TRACES, rows.SPAN_PROTO_COLUMNS, rows.span_proto_rows(spans))     # the agent's way
    return b


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture(params=["collector first", "spanlet alone"])
def store(request, tmp_path, caplog):
    b = _open(tmp_path, request.param == "collector first", caplog)
    try:
        yield request.param, b, [r.getMessage() for r in caplog.records]
    finally:
        b.close()


def test_a_collector_made_table_is_reported_once_and_worked_with(store):
    which, _, messages = store
    mine = [m for m in messages if m.startswith("store: table")]
    if which == "spanlet alone":
        assert mine == []
        return
    assert mine == [
        "store: table otel_traces: engine MergeTree, not spanlet's ReplacingMergeTree: a span or event "
        "sent twice (a retried insert) is stored twice; reads work",
        "store: table otel_traces: sorting key (ServiceName, SpanName, toDateTime(Timestamp)), not "
        "spanlet's (TraceId, SpanId): reads by trace id may scan more of it"]


def test_spans_read_back_with_the_collectors_spellings(store):
    _, b, _ = store
    got = b.query("SELECT SpanId, SpanKind, StatusCode FROM spanlet.otel_traces ORDER BY SpanId")
    assert got == [("0000000000000001", "Server", "Error"), ("0000000000000002", "Internal", "Unset"),
                   ("0000000000000003", "Client", "Unset"), ("0000000000000004", "Server", "Unset")]
    docs = collector_documented_queries(DB, TRACE.hex(), SERVICE)
    assert b.query(docs["server spans of a service"]) == [(2,)]
    assert b.query(docs["errors of a service"]) == [(1,)]
    assert [r[2] for r in b.query(docs["trace by id (lookup)"])] == ["0000000000000001", "0000000000000002",
                                                                    "0000000000000003"]


def test_the_lookup_table_holds_each_trace_once_filled_by_the_view(store):
    _, b, _ = store
    got = b.query("SELECT TraceId, toUnixTimestamp(min(Start)), toUnixTimestamp(max(End)) "
                  "FROM spanlet.otel_traces_trace_id_ts GROUP BY TraceId ORDER BY TraceId")
    assert got == [(TRACE.hex(), NOW // 10**9, NOW // 10**9 + 3), (OTHER.hex(), NOW // 10**9 + 1, NOW // 10**9 + 1)]


@pytest.mark.parametrize("lookup", [True, False], ids=["lookup table", "fallback"])
def test_the_plugins_trace_view_sql_returns_the_trace(store, lookup):
    _, b, _ = store
    got = b.query(plugin_trace_id_sql(DB, TRACE.hex(), lookup))
    assert [(r[0], r[1], r[4]) for r in got] == [(TRACE.hex(), f"{i:016x}", f"step-{i}") for i in (1, 2, 3)]
    assert got[0][6] == pytest.approx(5.0)          # duration in ms, from Duration in ns
    assert [r[1] for r in b.query(plugin_trace_id_sql(DB, "00" * 16, lookup))] == []


# Kernel events the dashboards' tests store beside the spans: two sandbox
# violations of pool 7 by two pods (one inside span 1 of TRACE) and a launch.
EVENT_COLUMNS = ["Timestamp", "Kind", "Pid", "Tid", "TraceId", "SpanId", "K8sNamespace", "K8sPodName",
                 "Rule", "Action", "PoolId", "Len", "PoolMaxBytes"]
EVENTS = [
    [NOW + 2 * 10**9, "SANDBOX", 40, 41, TRACE.hex(), f"{1:016x}", "prod", "web-0", "unauthorized", "audit",
     7, 8192, 1 << 20],
    [NOW + 4 * 10**9, "SANDBOX", 50, 51, "", "", "prod", "web-1", "unauthorized", "audit", 7, 4096, 1 << 20],
    [NOW + 5 * 10**9, "GPU_LAUNCH", 40, 42, OTHER.hex(), f"{4:016x}", "prod", "web-0", "", "", 0, 0, 0],
]
INTERVAL_S = 30


def _bucket(at_s: int) -> str:
    """toStartOfInterval(toDateTime(NOW + at_s), 30 s) as the store prints it (UTC)."""
    t = (NOW // 10**9 + at_s) // INTERVAL_S * INTERVAL_S
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def _by_bucket(items) -> list[tuple]:
    """[(at_s, key, value)] summed per (30 s bucket, key), in the panels' order."""
    out: dict[tuple[str, str], float] = {}
    for at_s, key, value in items:
        out[(_bucket(at_s), key)] = out.get((_bucket(at_s), key), 0) + value
    return sorted((b, k, v) for (b, k), v in out.items())


def _cols(*idx):
    return lambda got: [tuple(r[i] for i in idx) for r in got]


# What every dashboard query answers on the store's four spans and three events,
# by (dashboard, panel): (a projection of the rows, the rows it must give).
_ALL = lambda got: [tuple(r) for r in got]  # noqa: E731
_SORTED = lambda got: sorted(tuple(r) for r in got)  # noqa: E731   (ORDER BY time only: keys in any order)
SID = [f"{i:016x}" for i in range(5)]
TRACE_VIEW = (_cols(0, 1, 2, 3, 4, 5, 9), [(TRACE.hex(), SID[i], f"step-{i}", "", SERVICE, 5.0, 2 if i == 1 else 0)
                                         for i in (1, 2, 3)])
DASHBOARD_ANSWERS = {
    ("spanlet / Request drill-down", "variable namespace"): (_ALL, [("prod",)]),
    ("spanlet / Request drill-down", "variable pod"): (_ALL, [("web-0",)]),
    ("spanlet / Request drill-down", "variable service"): (_ALL, [(SERVICE,)]),
    ("spanlet / Request drill-down", "variable modality"): (_ALL, [("other",), ("text",)]),
    ("spanlet / Request drill-down", "variable slo_class"): (_ALL, [("gold",), ("none",)]),
    ("spanlet / Request drill-down", "Spans in range"): (_ALL, [(4,)]),
    ("spanlet / Request drill-down", "Spans with kernel facts"): (_ALL, [(1,)]),
    ("spanlet / Request drill-down", "GPU stall time in range"): (_ALL, [(10_000 / 1e9,)]),
    ("spanlet / Request drill-down", "Kernel events in range"): (_ALL, [(3,)]),
    ("spanlet / Request drill-down", "Spans and their kernel facts (newest first)"): (
        _cols(1, 2, 6, 8, 10, 11, 15), [(TRACE.hex(), SID[2], "Internal", "Unset", "web-0", 20, 2000),
                                        (TRACE.hex(), SID[3], "Client", "Unset", "web-0", 30, 3000),
                                        (OTHER.hex(), SID[4], "Server", "Unset", "web-0", 40, 4000),
                                        (TRACE.hex(), SID[1], "Server", "Error", "web-0", 10, 1000)]),
    ("spanlet / Request drill-down",
     "Spans and their kernel facts (newest first) / link: Trace view (ClickHouse store)"): TRACE_VIEW,
    ("spanlet / Request drill-down", "Slowest GPU stalls"): (
        _cols(2, 6, 7), [(SID[4], 4000, 4000 / 5_000_000), (SID[3], 3000, 3000 / 5_000_000),
                         (SID[2], 2000, 2000 / 5_000_000), (SID[1], 1000, 1000 / 5_000_000)]),
    ("spanlet / Request drill-down", "GPU stall per interval by service"): (
        _SORTED, [(b, k, v / 1e9) for b, k, v in _by_bucket(
            [(0, SERVICE, 1000), (3, SERVICE, 2000), (3, SERVICE, 3000), (1, SERVICE, 4000)])]),
    ("spanlet / Request drill-down", "Sandbox violations"): (
        _cols(1, 2, 4, 5, 6, 7, 8, 9, 10, 11), [("prod", "web-1", 50, 51, "unauthorized", "audit", 7, 4096, "", ""),
                                                ("prod", "web-0", 40, 41, "unauthorized", "audit", 7, 8192,
                                                 TRACE.hex(), SID[1])]),
    ("spanlet / Request drill-down", "Kernel events (newest first)"): (
        _cols(1, 3, 4, 5, 6, 7), [("GPU_LAUNCH", "web-0", 40, 42, OTHER.hex(), SID[4]),
                                  ("SANDBOX", "web-1", 50, 51, "", ""),
                                  ("SANDBOX", "web-0", 40, 41, TRACE.hex(), SID[1])]),
    ("spanlet / Request drill-down", "Kernel events per interval by kind"): (
        _SORTED, _by_bucket([(2, "SANDBOX", 1), (4, "SANDBOX", 1), (5, "GPU_LAUNCH", 1)])),
    # span 1: the GPU sync wait (1 ms) takes all of blocked (0.6 ms) and 0.4 ms of CPU (2 ms);
    # span 4: 4 us of blocked (1 ms); its parts (6.5 ms) exceed its 5 ms: other is 0
    ("spanlet / Request drill-down", "Where the time of a request went, at p50/p95/p99 of its duration"): (
        _ALL, [(f"other none p{q}", 0.0035, 0.002, 0.000996, 0.000004, 0.0) for q in (50, 95, 99)]
        + [(f"text gold p{q}", 0.0016, 0.0005, 0.0, 0.001, 0.0019) for q in (50, 95, 99)]),
    ("spanlet / Request drill-down", "Slowest requests' anatomy (the 20 slowest)"): (
        _cols(1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13),
        [(TRACE.hex(), SID[1], "web-0", "text", "gold", 5_000_000, 1_600_000, 500_000, 0, 1_000_000, 1_900_000),
         (OTHER.hex(), SID[4], "web-0", "other", "none", 5_000_000, 3_500_000, 2_000_000, 996_000, 4000, 0)]),
    ("spanlet / Sandbox", "By pool, rule and action in the time range"): (
        _cols(0, 1, 2, 3, 4, 5, 6, 7), [(7, "unauthorized", "audit", 2, 2, 2, 8192, 1 << 20)]),
    ("spanlet / Sandbox", "Violations per interval by pool"): (
        _SORTED, _by_bucket([(2, "pool 7", 1), (4, "pool 7", 1)])),
    ("spanlet / Sandbox", "Recent violations"): (
        _cols(3, 5, 6, 7, 8, 9, 10, 11, 14, 15), [("web-1", 50, 51, "unauthorized", "audit", 7, 4096, 1 << 20, "", ""),
                                                  ("web-0", 40, 41, "unauthorized", "audit", 7, 8192, 1 << 20,
                                                   TRACE.hex(), SID[1])]),
    ("spanlet / Sandbox", "Recent violations / link: Trace view (ClickHouse store)"): TRACE_VIEW,
}


def _numbers(rows: list[tuple]) -> list[tuple]:
    """JSON numbers as the store prints them (UInt64 as text, floats rounded)."""
    def one(v):
        if isinstance(v, str) and v.isdigit():
            return int(v)
        return round(v, 12) if isinstance(v, float) else v
    return [tuple(one(v) for v in r) for r in rows]


def test_spanlets_reads_and_every_dashboard_query_answer_exactly(store):
    _, b, _ = store
    spans = queries.recent_pod_spans(b, DB, "web-0", "prod", limit=10)
    assert {r["span_id"] for r in spans} == {f"{i:016x}" for i in (1, 2, 3, 4)}
    stalls = queries.slowest_gpu_stall_spans(b, DB, limit=2)
    assert [r["gpu_sync_wait_ns"] for r in stalls] == [4000, 3000]
    assert queries.sandbox_violations(b, DB) == []
    b.insert(schema.KERNEL_EVENTS, EVENT_COLUMNS, EVENTS)
    answered = set()
    for dash, panel, sql in gq.clickhouse_queries(DB, since_ns=NOW - 3600 * 10**9, until_ns=NOW + 60 * 10**9,
                                                  interval_s=INTERVAL_S, trace_id=TRACE.hex()):
        assert (dash, panel) in DASHBOARD_ANSWERS, f"no known answer for {dash} / {panel}: {sql}"
        project, want = DASHBOARD_ANSWERS[dash, panel]
        assert _numbers(project(b.query(sql))) == _numbers(want), f"{dash} / {panel}: {sql}"
        answered.add((dash, panel))
    assert answered == set(DASHBOARD_ANSWERS)


ANATOMY = "spanlet / Request drill-down"
AT_QUANTILES = "Where the time of a request went, at p50/p95/p99 of its duration"
SLOWEST = "Slowest requests' anatomy (the 20 slowest)"


def _request(rank: int) -> dict:
    """The facts of the request of this rank in its group: CPU growing as the
    square of the rank, so that a mean over ranks differs from its middle one."""
    return {"kernel.sched.cpu_ns": rank * rank * 10, "kernel.request.runqueue_ns": rank * 1000}


def _group(trace: bytes, modality: str, slo_class: str, durations_ms: list[int]) -> trace_pb2.ResourceSpans:
    """Server spans of one modality and class, their span ids in an order other than by duration."""
    rs = trace_pb2.ResourceSpans()
    rs.resource.attributes.add(key="service.name").value.string_value = SERVICE
    ss = rs.scope_spans.add()
    for i in range(len(durations_ms)):
        start = NOW + i * 10**6
        span_id = (i * 37) % len(durations_ms) + 1
        s = ss.spans.add(trace_id=trace, span_id=span_id.to_bytes(8, "big"), name="infer",
                         kind=trace_pb2.Span.SPAN_KIND_SERVER, start_time_unix_nano=start,
                         end_time_unix_nano=start + durations_ms[i] * 10**6)
        _set_attributes(s, {"mm.modality": modality, "slo.class": slo_class, **_request(i + 1)})
    return rs


def test_request_anatomy_averages_the_requests_at_each_quantile(store):
    """Ranked by duration in their modality and class, p50/p95/p99 take the
    requests within half a percentile of the quantile, and always the one at
    its nearest rank ceil(q n); only the modalities and classes chosen."""
    _, b, _ = store
    audio, video, silver = bytes([0xA0] * 16), bytes([0xB0] * 16), bytes([0xC0] * 16)
    groups = [_group(audio, "audio", "bronze", list(range(1, 201))),          # rank = i + 1
              _group(video, "video", "bronze", [1000 + i for i in range(1, 8)]),
              _group(silver, "video", "silver", [5000] * 3)]                  # another class: left out
    b.insert(schema.TRACES, rows.SPAN_PROTO_COLUMNS, rows.span_proto_rows(groups))
    got = {panel: b.query(sql) for _, panel, sql in gq.clickhouse_queries(
        DB, since_ns=NOW - 3600 * 10**9, until_ns=NOW + 60 * 10**9,
        selected={"modality": ["audio", "video"], "slo_class": ["bronze"]}) if panel in (AT_QUANTILES, SLOWEST)}

    def anatomy(ranks: tuple[int, ...], duration_ms) -> tuple:
        cpu = sum(_request(r)["kernel.sched.cpu_ns"] for r in ranks) / len(ranks)
        run_queue = sum(_request(r)["kernel.request.runqueue_ns"] for r in ranks) / len(ranks)
        duration = sum(duration_ms(r) * 10**6 for r in ranks) / len(ranks)
        return tuple(round(v / 1e9, 12) for v in (cpu, run_queue, 0, 0, duration - cpu - run_queue))

    # n = 200: a band of three ranks; n = 7: no rank is within half a percentile, the nearest only
    want = [(f"audio bronze p{q}", *anatomy(ranks, lambda r: r)) for q, ranks in
            ((50, (99, 100, 101)), (95, (189, 190, 191)), (99, (197, 198, 199)))]
    want += [(f"video bronze p{q}", *anatomy(ranks, lambda r: 1000 + r)) for q, ranks in
             ((50, (4,)), (95, (7,)), (99, (7,)))]
    assert _numbers(got[AT_QUANTILES]) == want

    slowest = [(r[1], r[6], r[8]) for r in got[SLOWEST]]
    assert slowest == [(video.hex(), "video", (1000 + i) * 10**6) for i in range(7, 0, -1)] + \
        [(audio.hex(), "audio", i * 10**6) for i in range(200, 187, -1)]
    top = got[SLOWEST][0]
    assert _numbers([top[9:]]) == [(490, 7000, 0, 0, 1007 * 10**6 - 7490)]


def test_a_table_without_a_column_spanlet_writes_is_refused_in_one_line(tmp_path, caplog):
    b = ChdbBackend(str(tmp_path / "store"), database=DB)
    try:
        b.query(f"CREATE DATABASE {DB}")
        b.query(f"CREATE TABLE {DB}.otel_traces (Timestamp DateTime64(9), TraceId String, SpanId String) "
                "ENGINE = MergeTree ORDER BY Timestamp")
        with caplog.at_level(logging.WARNING, logger="spanlet"), pytest.raises(BackendError) as e:
            b.ensure_schema()
        assert "\n" not in str(e.value)
        assert str(e.value).startswith("store refused: table otel_traces: no column ParentSpanId, TraceState, ")
        assert "Links.Attributes, which spanlet writes" in str(e.value)
    finally:
        b.close()


def _system(tables: dict[str, tuple[str, str]], columns: dict[str, list[str]]):
    """A query function answering the two system-table reads of table_differences."""
    def query(sql: str) -> list[tuple]:
        if "system.tables" in sql:
            return [(name, engine, key) for name, (engine, key) in tables.items()]
        return [(table, c, "String") for table, cols in columns.items() for c in cols]
    return query


def test_the_collectors_json_table_form_is_refused_in_one_line(tmp_path):
    b = ChdbBackend(str(tmp_path / "store"), database=DB)
    try:
        for stmt in traces_ddl(DB)[:1]:
            b.query(stmt)
        b.query(traces_ddl(DB)[1].replace("SpanAttributes Map(LowCardinality(String), String)",
                                          "SpanAttributes JSON").replace(
            "    INDEX idx_span_attr_key mapKeys(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,\n"
            "    INDEX idx_span_attr_value mapValues(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,\n", ""))
        with pytest.raises(BackendError, match=r"^store refused: table otel_traces: column SpanAttributes of "
                                               r"type JSON, where spanlet writes a Map"):
            b.ensure_schema()
    finally:
        b.close()


def test_cluster_mode_refuses_a_plain_table_where_the_distributed_one_goes():
    """What one chdb cannot run (a cluster): the check against the system
    tables a cluster node shows, Collector first (a plain otel_traces) and
    spanlet first (its Distributed table over Replicated local ones)."""
    t = schema.Target(cluster="prod")
    expected = schema._expected(t)
    cols = {name: exp[2] for name, exp in expected.items()}
    cols.update({f"{name}_local": exp[2] for name, exp in expected.items()})
    collector_first = _system({"otel_traces": ("MergeTree", "ServiceName, SpanName, toDateTime(Timestamp)")}, cols)
    (d,) = schema.table_differences(collector_first, t)
    assert d.fatal and str(d) == ("table otel_traces: engine MergeTree, not the Distributed table over "
                                  "otel_traces_local that cluster mode writes through")
    spanlet_first = _system({**{name: ("Distributed", "") for name in expected},
                             **{f"{name}_local": (exp[0], exp[1]) for name, exp in expected.items()}}, cols)
    assert schema.table_differences(spanlet_first, t) == []
