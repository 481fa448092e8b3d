"""The store's DDL and migrations: every statement (single node and cluster
mode) is accepted by ClickHouse's own parser; a fresh database gets the exact
collector column set; a database at schema v1 with rows in it is brought to the
current version without losing them; names and literals cannot inject SQL."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from spanlet.exporters.clickhouse import BackendError
from spanlet.exporters.clickhouse import schema
from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend

# The collector exporter's otel_traces columns (traces_table.sql), in order.
COLLECTOR_TRACE_COLUMNS = [
    ("Timestamp", "DateTime64(9)"), ("TraceId", "String"), ("SpanId", "String"),
    ("ParentSpanId", "String"), ("TraceState", "String"),
    ("SpanName", "LowCardinality(String)"), ("SpanKind", "LowCardinality(String)"),
    ("ServiceName", "LowCardinality(String)"),
    ("ResourceAttributes", "Map(LowCardinality(String), String)"),
    ("ScopeName", "String"), ("ScopeVersion", "String"),
    ("SpanAttributes", "Map(LowCardinality(String), String)"),
    ("Duration", "UInt64"), ("StatusCode", "LowCardinality(String)"),
    ("StatusMessage", "String"),
    ("Events.Timestamp", "Array(DateTime64(9))"),
    ("Events.Name", "Array(LowCardinality(String))"),
    ("Events.Attributes", "Array(Map(LowCardinality(String), String))"),
    ("Links.TraceId", "Array(String)"), ("Links.SpanId", "Array(String)"),
    ("Links.TraceState", "Array(String)"),
    ("Links.Attributes", "Array(Map(LowCardinality(String), String))"),
]


@pytest.fixture
def backend(tmp_path):
    b = ChdbBackend(str(tmp_path / "db"), database="spanlet", ttl_days=3)
    try:
        yield b
    finally:
        b.close()


def _columns(b, table):
    return b.query("SELECT name, type FROM system.columns WHERE database = 'spanlet' "
                   f"AND table = '{table}' ORDER BY position")


def test_cluster_ddl_each_statement_parses(backend):
    t = schema.Target(database="obs", ttl_days=30, cluster="prod_cluster")
    stmts = schema.all_statements(t)
    # database, schema_version, 3 x (local + Distributed), v2: 2 ALTERs, v4: 1 ALTER,
    # v5: the lookup's local table, its Distributed table and the view
    assert len(stmts) == 1 + 1 + 6 + 2 + 1 + 3
    for stmt in stmts:
        formatted = backend.query(f"SELECT formatQuery({schema.quote_string(stmt)})")[0][0]
        assert "ON CLUSTER prod_cluster" in formatted, stmt
    text = "\n".join(stmts)
    for table in schema.DATA_TABLES:
        assert f"CREATE TABLE IF NOT EXISTS obs.{table}_local ON CLUSTER prod_cluster" in text
        assert (f"ENGINE = Distributed(prod_cluster, obs, {table}_local, "
                f"{schema.SHARDING_KEYS[table]})") in text
    assert text.count("ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/obs/") == 3
    assert "ReplicatedReplacingMergeTree('/clickhouse/tables/obs/schema_version', '{replica}')" in text
    assert "toIntervalDay(30)" in text
    assert "ALTER TABLE obs.kernel_events_local ON CLUSTER prod_cluster ADD COLUMN" in text
    assert "ALTER TABLE obs.otel_traces_local ON CLUSTER prod_cluster UPDATE SpanKind" in text
    # each node's view fills its own lookup table; the Distributed one reads them all
    assert ("CREATE MATERIALIZED VIEW IF NOT EXISTS obs.otel_traces_trace_id_ts_mv ON CLUSTER prod_cluster "
            "TO obs.otel_traces_trace_id_ts_local AS SELECT TraceId, min(Timestamp) AS Start, "
            "max(Timestamp) AS End FROM obs.otel_traces_local") in text
    assert "ENGINE = Distributed(prod_cluster, obs, otel_traces_trace_id_ts_local, cityHash64(TraceId))" in text
    assert "ReplicatedMergeTree('/clickhouse/tables/{shard}/obs/otel_traces_trace_id_ts_local'" in text


def test_single_node_ddl_parses_and_has_no_cluster(backend):
    for stmt in schema.all_statements(schema.Target()):
        backend.query(f"SELECT formatQuery({schema.quote_string(stmt)})")
        assert "CLUSTER" not in stmt and "Replicated" not in stmt and "Distributed" not in stmt


def test_fresh_schema_has_collector_columns_and_engines(backend):
    assert backend.ensure_schema() == schema.SCHEMA_VERSION == 7
    assert _columns(backend, "otel_traces") == COLLECTOR_TRACE_COLUMNS
    rows = dict(backend.query(
        "SELECT name, engine || '|' || sorting_key || '|' || partition_key FROM system.tables "
        "WHERE database = 'spanlet'"))
    assert rows["otel_traces"] == "ReplacingMergeTree|TraceId, SpanId|toDate(Timestamp)"
    assert rows["kernel_events"].startswith("ReplacingMergeTree|Kind, CgroupId, Timestamp")
    assert rows["metric_samples"] == ("ReplacingMergeTree|MetricName, LabelsHash, Timestamp|"
                                      "toDate(Timestamp)")
    # the collector's lookup table and view, by its names and columns
    assert rows["otel_traces_trace_id_ts"] == "MergeTree|TraceId, Start|toDate(Start)"
    assert _columns(backend, "otel_traces_trace_id_ts") == [
        ("TraceId", "String"), ("Start", "DateTime"), ("End", "DateTime")]
    assert rows["otel_traces_trace_id_ts_mv"].startswith("MaterializedView")
    ddl = backend.query("SELECT create_table_query FROM system.tables WHERE database = 'spanlet' "
                        "AND name = 'otel_traces'")[0][0]
    assert "TTL toDateTime(Timestamp) + toIntervalDay(3)" in ddl
    assert ("Node", "LowCardinality(String)") in _columns(backend, "kernel_events")
    # Idempotent: a second start-up applies nothing.
    assert backend.ensure_schema() == 7
    assert backend.query("SELECT Version FROM spanlet.schema_version ORDER BY Version") == [
        (1,), (2,), (3,), (4,), (5,), (6,), (7,)]


def test_the_embedded_spans_table_merges_wider_and_a_server_keeps_its_ddl(backend):
    """v6: the embedded store's otel_traces merges with merge_selector_base 20
    (its background merges' CPU); a server's or cluster's tables stay as the
    Collector's DDL makes them, and the other embedded tables as they were."""
    backend.ensure_schema()
    ddl = dict(backend.query("SELECT name, create_table_query FROM system.tables WHERE database = 'spanlet'"))
    assert f"merge_selector_base = {schema.TRACES_MERGE_SELECTOR_BASE}" in ddl["otel_traces"]
    assert schema.TRACES_MERGE_SELECTOR_BASE == 20
    assert all("merge_selector_base" not in text for name, text in ddl.items() if name != "otel_traces")
    for t in (schema.Target(), schema.Target(cluster="c")):
        assert schema.MIGRATIONS[5].statements(t) == []
        assert not any("merge_selector" in stmt for stmt in schema.all_statements(t))


def test_the_embedded_spans_table_leaves_its_codecs_to_the_part_size_and_a_server_keeps_its_ddl(backend):
    """v7: the embedded store's otel_traces columns have no codec of their own
    but Timestamp's (the engine's rule picks LZ4 or ZSTD(1) by part size:
    test_chdb_backend); a server's or cluster's tables keep the Collector's
    ZSTD(1), and the other embedded tables theirs."""
    backend.ensure_schema()
    codecs = dict(backend.query("SELECT table || '.' || name, compression_codec FROM system.columns "
                                "WHERE database = 'spanlet'"))
    assert codecs.pop("otel_traces.Timestamp") == "CODEC(Delta(8), ZSTD(1))"
    assert {c for name, c in codecs.items() if name.startswith("otel_traces.")} == {""}
    assert codecs["otel_traces_trace_id_ts.TraceId"] == codecs["metric_samples.Labels"] == "CODEC(ZSTD(1))"
    for t in (schema.Target(), schema.Target(cluster="c")):
        assert schema.MIGRATIONS[6].statements(t) == []
        assert not any("REMOVE CODEC" in stmt for stmt in schema.all_statements(t))


def test_a_retried_insert_is_stored_once(backend):
    """v3: the same block sent again (its answer lost, or replayed from the
    spool) is dropped by the server, before any merge."""
    backend.ensure_schema()
    t0 = time.time_ns()
    block = [[t0 + i, f"{i:032x}", f"{i:016x}"] for i in range(3)]
    for _ in range(2):
        backend.insert("otel_traces", ["Timestamp", "TraceId", "SpanId"], block)
    backend.insert("otel_traces", ["Timestamp", "TraceId", "SpanId"], block[:1])   # another block
    assert backend.query("SELECT count() FROM spanlet.otel_traces") == [(4,)]
    assert schema.MIGRATIONS[2].statements(schema.Target(cluster="c")) == []  # Replicated: built in


@pytest.mark.parametrize("form", ["span protos", "kernel records"])
def test_a_retried_batch_in_the_agents_own_form_is_stored_once(backend, form):
    """The inserts the engine reads from a file (INSERT SELECT) carry a
    deduplication token of their data: a resent batch is dropped too."""
    from store_load import kernel_events, resource_spans
    from spanlet.exporters.clickhouse import rows
    backend.ensure_schema()
    if form == "span protos":
        table, columns, make = "otel_traces", rows.SPAN_PROTO_COLUMNS, lambda n, k: rows.span_proto_rows(
            resource_spans(n, k))
    else:
        table, columns, make = "kernel_events", rows.KERNEL_RECORD_COLUMNS, lambda n, k: rows.kernel_record_rows(
            kernel_events(n, k))
    batch = make(0, 3)
    for _ in range(2):
        backend.insert(table, columns, batch)
    backend.insert(table, columns, make(0, 1))     # another batch (a part of the first)
    assert backend.query(f"SELECT count() FROM spanlet.{table}") == [(4,)]


SHIPPED = Path(__file__).resolve().parents[1] / "support" / "store_schemas"


def shipped_store(path: str, version: int) -> ChdbBackend:
    """A store made by the statements schema version `version` ran as it
    shipped (tests/support/store_schemas/vN.sql, never edited)."""
    b = ChdbBackend(path)
    text = (SHIPPED / f"v{version}.sql").read_text()
    body = "\n".join(line for line in text.splitlines() if not line.startswith("--"))
    for stmt in body.split("\n;;\n"):
        b.query(stmt)
    return b


def test_every_shipped_schema_is_frozen():
    assert sorted(p.name for p in SHIPPED.glob("v*.sql")) == [f"v{n}.sql" for n in range(1, schema.SCHEMA_VERSION)]


def _shape(b) -> list[tuple]:
    tables = b.query("SELECT name, engine_full FROM system.tables WHERE database = 'spanlet' "
                     "AND name != 'schema_version' ORDER BY name")
    columns = b.query("SELECT table, name, type, default_expression, compression_codec FROM system.columns "
                      "WHERE database = 'spanlet' ORDER BY table, position")
    return tables + columns


@pytest.mark.parametrize("version", range(1, schema.SCHEMA_VERSION))
def test_a_store_of_each_shipped_version_is_brought_to_the_shape_of_a_fresh_one(tmp_path, version):
    fresh = ChdbBackend(str(tmp_path / "fresh"))
    try:
        fresh.ensure_schema()
        want = _shape(fresh)
    finally:
        fresh.close()
    path = str(tmp_path / "old")
    shipped_store(path, version).close()
    b = ChdbBackend(path)
    try:
        assert b.schema_version() == version
        assert b.ensure_schema() == schema.SCHEMA_VERSION
        assert _shape(b) == want
        assert [v for v, in b.query("SELECT Version FROM spanlet.schema_version FINAL ORDER BY Version")] == \
            list(range(1, schema.SCHEMA_VERSION + 1))
    finally:
        b.close()


def test_v1_database_with_rows_is_migrated_without_loss(tmp_path):
    # Recent timestamps: older rows would (rightly) be dropped by the TTL.
    t0 = time.time_ns() - 3_600_000_000_000 + 1
    path = str(tmp_path / "db")
    b = shipped_store(path, 1)
    try:
        assert b.schema_version() == 1
        assert "Node" not in dict(_columns(b, "kernel_events"))
        b.insert("kernel_events", ["Timestamp", "Kind", "Pid", "Tid", "CgroupId", "DurationNs"],
                 [[t0 + i, "GPU_SYNC", 10, 11 + i, 99, 1000 * i]
                  for i in range(5)])
        b.insert("otel_traces", ["Timestamp", "TraceId", "SpanId", "SpanKind", "StatusCode"],
                 [[t0, "ab" * 16, "cd" * 8, "SPAN_KIND_SERVER", "STATUS_CODE_ERROR"],
                  [t0 + 5_000_000_000, "ab" * 16, "ce" * 8, "SPAN_KIND_CLIENT", "STATUS_CODE_UNSET"]])
    finally:
        b.close()
    # Restart on the same directory: start-up migration to the current version.
    b = ChdbBackend(path)
    try:
        assert b.schema_version() == 1
        assert b.ensure_schema() == schema.SCHEMA_VERSION
        assert b.query("SELECT toUnixTimestamp64Nano(Timestamp), Tid, DurationNs, Node "
                       "FROM spanlet.kernel_events ORDER BY Tid") == [
            (t0 + i, 11 + i, 1000 * i, "") for i in range(5)]
        # v4: the collector's spellings, rows stored before rewritten
        assert b.query("SELECT TraceId, SpanId, SpanKind, StatusCode FROM spanlet.otel_traces ORDER BY SpanId") == [
            ("ab" * 16, "cd" * 8, "Server", "Error"), ("ab" * 16, "ce" * 8, "Client", "Unset")]
        # v5: the lookup filled for the spans already stored (whole seconds, as the collector's)
        assert b.query("SELECT TraceId, toUnixTimestamp(End) - toUnixTimestamp(Start) "
                       "FROM spanlet.otel_traces_trace_id_ts") == [("ab" * 16, 5)]
        b.insert("kernel_events", ["Timestamp", "Kind", "Node"],
                 [[t0 + 100, "FLOW", "node-a"]])
        assert b.query("SELECT Node, count() FROM spanlet.kernel_events GROUP BY Node "
                       "ORDER BY Node") == [("", 5), ("node-a", 1)]
    finally:
        b.close()


def test_identifiers_are_checked():
    for bad in ("a-b", "x; DROP TABLE y", "", "1abc", "a.b", "a`b"):
        with pytest.raises(ValueError):
            schema.Target(database=bad)
        with pytest.raises(ValueError):
            schema.Target(cluster=bad)
    with pytest.raises(ValueError):
        schema.Target(ttl_days=0)
    with pytest.raises(ValueError):
        schema.migrate(lambda sql: [], schema.Target(), upto=schema.SCHEMA_VERSION + 1)


def test_quote_string_round_trips_any_text(backend):
    nasty = "it's \\ a \"test\"\n\t\r\0 `x` '); DROP TABLE t; -- ünïcode ✓"
    assert backend.query(f"SELECT {schema.quote_string(nasty)}") == [(nasty,)]


def test_unknown_table_and_bad_sql_are_backend_errors(backend):
    backend.ensure_schema()
    with pytest.raises(BackendError):
        backend.query("SELECT * FROM spanlet.nope")
    with pytest.raises(BackendError):
        backend.insert("nope", ["a"], [[1]])
    with pytest.raises(BackendError):
        backend.insert("otel_traces", ["NoSuchColumn"], [[1]])
    with pytest.raises(BackendError):   # a string into a UInt64 column
        backend.insert("otel_traces", ["Timestamp", "Duration"], [[1, "not a number"]])
