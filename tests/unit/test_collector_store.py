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


def test_spanlets_reads_and_every_dashboard_query_answer(store):
    _, b, _ = store
    spans = queries.recent_pod_spans(b, DB, "web-0", "prod", limit=10)
    assert {r["span_id"] for r in spans} == {f"{i:016x}" for i in (1, 2, 3, 4)}
    stalls = queries.slowest_gpu_stall_spans(b, DB, limit=2)
    assert [r["gpu_sync_wait_ns"] for r in stalls] == [4000, 3000]
    assert queries.sandbox_violations(b, DB) == []
    for dash, panel, sql in gq.clickhouse_queries(DB, since_ns=NOW - 3600 * 10**9, until_ns=NOW + 60 * 10**9,
                                                  interval_s=30, trace_id=TRACE.hex()):
        b.query(sql)                                # answers (no ILLEGAL_FINAL, no unknown table)


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
