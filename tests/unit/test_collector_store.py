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
