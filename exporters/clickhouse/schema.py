"""The store's tables as one DDL text each, for the embedded chdb backend and a
ClickHouse server or cluster alike, and the versioned forward migrations that
ensure_schema() applies at start-up.

Value conventions of the rows given to Backend.insert (both backends):
DateTime64(9) values (and arrays of them) are int nanoseconds since the epoch,
Map values are dict[str, str], Array values are lists."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("spanlet")

TRACES = "otel_traces"
KERNEL_EVENTS = "kernel_events"
METRIC_SAMPLES = "metric_samples"
SCHEMA_VERSION_TABLE = "schema_version"
# The collector's trace-id lookup (traces_id_ts_lookup_table.sql and its view):
# where a trace starts and ends, so that a trace-by-id read prunes by time.
TRACE_ID_TS = "otel_traces_trace_id_ts"
TRACE_ID_TS_MV = "otel_traces_trace_id_ts_mv"
DATA_TABLES = (TRACES, KERNEL_EVENTS, METRIC_SAMPLES)

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_identifier(name: str, what: str = "identifier") -> str:
    """Database, cluster and table names are spliced into DDL: only plain
    identifiers are accepted, never quoted text."""
    if not isinstance(name, str) or not _IDENT.match(name):
        raise ValueError(f"invalid {what} {name!r}: letters, digits and _ only")
    return name


def quote_string(value: str) -> str:
    """A ClickHouse string literal for any text."""
    return "'" + (value.replace("\\", "\\\\").replace("'", "\\'").replace("\0", "\\0")
                  .replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")) + "'"


def quote_identifier(name: str) -> str:
    """A back-quoted identifier (column names such as `Events.Timestamp`)."""
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


@dataclass(frozen=True)
class Target:
    """Where the tables live: database, retention and the optional cluster."""

    database: str = "spanlet"
    ttl_days: int = 7
    cluster: str | None = None
    embedded: bool = False       # the agent's own chdb store (settings for its CPU, not the data)

    def __post_init__(self):
        check_identifier(self.database, "database name")
        if self.cluster is not None:
            check_identifier(self.cluster, "cluster name")
        if not isinstance(self.ttl_days, int) or self.ttl_days < 1:
            raise ValueError(f"ttl_days must be a positive int, not {self.ttl_days!r}")


# ---------------------------------------------------------------------------
# Table bodies: columns, indexes and the sorting/partitioning/TTL clauses. One
# text per table; {engine} and {ttl_days} are the only holes.

# The OpenTelemetry Collector ClickHouse exporter's traces table, column for
# column (exporter/clickhouseexporter/internal/sql_templates/traces_table.sql:
# Duration UInt64, ScopeName/ScopeVersion columns, Events/Links Nested, i.e.
# Events.Timestamp Array(DateTime64(9)) ...). Differences, on purpose:
# ReplacingMergeTree ORDER BY (TraceId, SpanId) where the collector has
# MergeTree ORDER BY (ServiceName, SpanName, toDateTime(Timestamp)), so that a
# retried insert never duplicates a span; a minmax index on Timestamp and a set
# index on ServiceName recover some of the pruning of the collector's order.
_TRACES_BODY = """(
    Timestamp DateTime64(9) CODEC(Delta, ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    TraceState String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    SpanKind LowCardinality(String) CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    SpanAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    Duration UInt64 CODEC(ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    StatusMessage String CODEC(ZSTD(1)),
    Events Nested (
        Timestamp DateTime64(9),
        Name LowCardinality(String),
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    Links Nested (
        TraceId String,
        SpanId String,
        TraceState String,
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    INDEX idx_res_attr_key mapKeys(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_res_attr_value mapValues(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_key mapKeys(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_value mapValues(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_duration Duration TYPE minmax GRANULARITY 1,
    INDEX idx_timestamp Timestamp TYPE minmax GRANULARITY 1,
    INDEX idx_service ServiceName TYPE set(0) GRANULARITY 1
) ENGINE = {engine}
PARTITION BY toDate(Timestamp)
ORDER BY (TraceId, SpanId)
TTL toDateTime(Timestamp) + toIntervalDay({ttl_days})
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1"""

# One row per ring-buffer event. Payload as flat typed columns (not a Map):
# the structs are fixed by bpf/spanlet.h and change only with a migration;
# columns a kind does not have hold their default, which a columnar store keeps
# for next to nothing; sums and filters (DurationNs, Rule) stay numeric.
# The dedupe key is the event's identity (kind, cgroup, ns timestamp, task,
# flow): a retried batch collapses, two real events never share it.
_KERNEL_EVENTS_BODY = """(
    Timestamp DateTime64(9) CODEC(Delta, ZSTD(1)),
    Kind LowCardinality(String),
    Pid UInt32,
    Tid UInt32,
    CgroupId UInt64,
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    Modality LowCardinality(String),
    HeaderFlags UInt8,
    K8sNamespace LowCardinality(String),
    K8sPodName LowCardinality(String),
    K8sContainerName LowCardinality(String),
    Api LowCardinality(String),
    Entry LowCardinality(String),
    Func UInt64,
    Stream UInt64,
    DurationNs UInt64,
    Grid Array(UInt32),
    Block Array(UInt32),
    SharedMem UInt32,
    Rule LowCardinality(String),
    Action LowCardinality(String),
    Addr UInt64,
    Len UInt64,
    PoolMaxBytes UInt64,
    Prot UInt32,
    MapFlags UInt32,
    PoolId UInt32,
    Fd Int32,
    SrcAddr String,
    DstAddr String,
    SrcPort UInt16,
    DstPort UInt16,
    L4Proto UInt8,
    Ifindex UInt32,
    Direction LowCardinality(String),
    ProtoClass LowCardinality(String),
    Method UInt8,
    PathHash UInt32,
    TraceFlags UInt8,
    RequestBytes UInt64,
    ResponseBytes UInt64,
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_timestamp Timestamp TYPE minmax GRANULARITY 1
) ENGINE = {engine}
PARTITION BY toDate(Timestamp)
ORDER BY (Kind, CgroupId, Timestamp, Pid, Tid, SrcAddr, SrcPort, DstAddr, DstPort)
TTL toDateTime(Timestamp) + toIntervalDay({ttl_days})
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1"""

# One row per series per window. Histograms keep their buckets in the row
# (Bounds without +Inf, BucketCounts per bucket, not cumulative, len(Bounds)+1),
# as the collector's histogram table does; Value is 0 for them. Dashboards read
# one metric over a time range grouped by labels: ORDER BY (MetricName,
# LabelsHash, Timestamp); a retried window replaces itself.
_METRIC_SAMPLES_BODY = """(
    Timestamp DateTime64(9) CODEC(Delta, ZSTD(1)),
    MetricName LowCardinality(String),
    MetricType LowCardinality(String),
    Unit LowCardinality(String),
    Labels Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    LabelsHash UInt64 MATERIALIZED cityHash64(mapKeys(Labels), mapValues(Labels)),
    Value Float64 CODEC(ZSTD(1)),
    Count UInt64,
    Sum Float64,
    Bounds Array(Float64) CODEC(ZSTD(1)),
    BucketCounts Array(UInt64) CODEC(ZSTD(1))
) ENGINE = {engine}
PARTITION BY toDate(Timestamp)
ORDER BY (MetricName, LabelsHash, Timestamp)
TTL toDateTime(Timestamp) + toIntervalDay({ttl_days})
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1"""

_SCHEMA_VERSION_BODY = """(
    Version UInt32,
    Description String,
    AppliedAt DateTime64(3) DEFAULT now64(3)
) ENGINE = {engine}
ORDER BY Version"""

TABLE_BODIES = {
    TRACES: _TRACES_BODY,
    KERNEL_EVENTS: _KERNEL_EVENTS_BODY,
    METRIC_SAMPLES: _METRIC_SAMPLES_BODY,
}

# Distributed sharding keys: a trace on one shard (so that its spans' retries
# meet and collapse there), an event with its span, a series on one shard.
SHARDING_KEYS = {
    TRACES: "cityHash64(TraceId)",
    KERNEL_EVENTS: "cityHash64(TraceId, CgroupId)",
    METRIC_SAMPLES: "cityHash64(MetricName, mapKeys(Labels), mapValues(Labels))",
}


def _on_cluster(t: Target) -> str:
    return f" ON CLUSTER {t.cluster}" if t.cluster else ""


def _engine(t: Target, table: str, local_name: str, replacing: bool = True,
            shared: bool = False) -> str:
    kind = "ReplacingMergeTree" if replacing else "MergeTree"
    if not t.cluster:
        return f"{kind}()"
    # {shard} and {replica} are the server's macros; `shared` tables (the
    # version bookkeeping) have one replica set across all shards.
    shard = "" if shared else "{shard}/"
    path = f"/clickhouse/tables/{shard}{t.database}/{local_name}"
    return f"Replicated{kind}({quote_string(path)}, '{{replica}}')"


def create_database(t: Target) -> str:
    return f"CREATE DATABASE IF NOT EXISTS {t.database}{_on_cluster(t)}"


def create_table(table: str, t: Target) -> list[str]:
    """The statements that create one data table: the table itself, or in
    cluster mode the replicated `<table>_local` and a Distributed `<table>`."""
    body = TABLE_BODIES[table]
    if not t.cluster:
        return [f"CREATE TABLE IF NOT EXISTS {t.database}.{table}\n"
                + body.format(engine=_engine(t, table, table), ttl_days=t.ttl_days)]
    local = f"{table}_local"
    return [
        f"CREATE TABLE IF NOT EXISTS {t.database}.{local}{_on_cluster(t)}\n"
        + body.format(engine=_engine(t, table, local), ttl_days=t.ttl_days),
        f"CREATE TABLE IF NOT EXISTS {t.database}.{table}{_on_cluster(t)}"
        f" AS {t.database}.{local}\n"
        f"ENGINE = Distributed({t.cluster}, {t.database}, {local}, {SHARDING_KEYS[table]})",
    ]


# The collector's lookup table, column for column (TraceId String, Start and
# End DateTime, a bloom filter on TraceId, MergeTree ORDER BY (TraceId,
# Start)); its TTL is the spans'. Duplicate rows are harmless: readers take
# min(Start) and max(End).
_TRACE_ID_TS_BODY = """(
    TraceId String CODEC(ZSTD(1)),
    Start DateTime CODEC(Delta, ZSTD(1)),
    End DateTime CODEC(Delta, ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.01) GRANULARITY 1
) ENGINE = {engine}
PARTITION BY toDate(Start)
ORDER BY (TraceId, Start)
TTL toDateTime(Start) + toIntervalDay({ttl_days})
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1"""

_TRACE_ID_TS_SELECT = ("SELECT TraceId, min(Timestamp) AS Start, max(Timestamp) AS End "
                       "FROM {source} WHERE TraceId != '' GROUP BY TraceId")


def create_trace_id_ts(t: Target) -> list[str]:
    """The lookup table and the view that fills it from every insert into the
    spans. In cluster mode each node's view reads its own spans
    (`otel_traces_local`) into its own lookup table, and a Distributed
    `otel_traces_trace_id_ts` reads them all: a trace whose spans are on
    several shards has a row on each, and the reader's min/max over rows
    makes the lookup whole."""
    db = t.database
    if not t.cluster:
        return [f"CREATE TABLE IF NOT EXISTS {db}.{TRACE_ID_TS}\n"
                + _TRACE_ID_TS_BODY.format(engine=_engine(t, TRACE_ID_TS, TRACE_ID_TS, replacing=False),
                                           ttl_days=t.ttl_days),
                f"CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.{TRACE_ID_TS_MV} TO {db}.{TRACE_ID_TS} AS "
                + _TRACE_ID_TS_SELECT.format(source=f"{db}.{TRACES}")]
    local = f"{TRACE_ID_TS}_local"
    return [f"CREATE TABLE IF NOT EXISTS {db}.{local}{_on_cluster(t)}\n"
            + _TRACE_ID_TS_BODY.format(engine=_engine(t, TRACE_ID_TS, local, replacing=False),
                                       ttl_days=t.ttl_days),
            f"CREATE TABLE IF NOT EXISTS {db}.{TRACE_ID_TS}{_on_cluster(t)} AS {db}.{local}\n"
            f"ENGINE = Distributed({t.cluster}, {db}, {local}, cityHash64(TraceId))",
            f"CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.{TRACE_ID_TS_MV}{_on_cluster(t)} TO {db}.{local} AS "
            + _TRACE_ID_TS_SELECT.format(source=f"{db}.{TRACES}_local")]


def create_schema_version_table(t: Target) -> str:
    return (f"CREATE TABLE IF NOT EXISTS {t.database}.{SCHEMA_VERSION_TABLE}{_on_cluster(t)}\n"
            + _SCHEMA_VERSION_BODY.format(
                engine=_engine(t, SCHEMA_VERSION_TABLE, SCHEMA_VERSION_TABLE, shared=True)))


def add_column(table: str, column_ddl: str, t: Target) -> list[str]:
    """ALTER ... ADD COLUMN on the table, and in cluster mode on the local
    table first, then on the Distributed one over it."""
    names = [f"{table}_local", table] if t.cluster else [table]
    return [f"ALTER TABLE {t.database}.{n}{_on_cluster(t)} ADD COLUMN IF NOT EXISTS {column_ddl}"
            for n in names]


# ---------------------------------------------------------------------------
# Migrations: forward only; a migration's statements are idempotent (IF NOT
# EXISTS) so that a crash between them and the version row is repaired by
# running them again.

@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    statements: Callable[[Target], list[str]]


def _v1(t: Target) -> list[str]:
    out: list[str] = []
    for table in DATA_TABLES:
        out.extend(create_table(table, t))
    return out


def _v2(t: Target) -> list[str]:
    return add_column(KERNEL_EVENTS, "Node LowCardinality(String) DEFAULT ''", t)


# Blocks remembered per table for insert deduplication. A retried insert (the
# server stored it but its answer was lost) or a spool replay resends the
# same block, which the server then drops. Replicated tables (cluster mode)
# deduplicate by default.
DEDUP_WINDOW_BLOCKS = 1000


def _v3(t: Target) -> list[str]:
    if t.cluster:
        return []
    return [f"ALTER TABLE {t.database}.{table} MODIFY SETTING "
            f"non_replicated_deduplication_window = {DEDUP_WINDOW_BLOCKS}" for table in DATA_TABLES]


# Migration 4: SpanKind and StatusCode as the collector spells them
# (rows.SPAN_KINDS / STATUS_CODES); rows stored before with the proto enum
# names are rewritten in place (neither column is in the sorting key).
_OLD_SPELLINGS = {
    "SpanKind": {f"SPAN_KIND_{n.upper()}": n for n in
                 ("Unspecified", "Internal", "Server", "Client", "Producer", "Consumer")},
    "StatusCode": {f"STATUS_CODE_{n.upper()}": n for n in ("Unset", "Ok", "Error")},
}


def _v4(t: Target) -> list[str]:
    table = f"{TRACES}_local" if t.cluster else TRACES
    sets, where = [], []
    for column, names in _OLD_SPELLINGS.items():
        old = ", ".join(quote_string(k) for k in names)
        new = ", ".join(quote_string(v) for v in names.values())
        sets.append(f"{column} = transform({column}, [{old}], [{new}], {column})")
        where.append(f"{column} IN ({old})")
    return [f"ALTER TABLE {t.database}.{table}{_on_cluster(t)} UPDATE {', '.join(sets)} "
            f"WHERE {' OR '.join(where)} SETTINGS mutations_sync = 2"]


def _v5(t: Target) -> list[str]:
    """The trace-id lookup, filled for the spans already stored (run again
    after a crash it adds duplicate rows, which readers' min/max absorb)."""
    db = t.database
    target = f"{db}.{TRACE_ID_TS}_local" if t.cluster else f"{db}.{TRACE_ID_TS}"
    source = f"{db}.{TRACES}_local" if t.cluster else f"{db}.{TRACES}"
    backfill = f"INSERT INTO {target} " + _TRACE_ID_TS_SELECT.format(source=source)
    # in cluster mode each node fills its own lookup from its own spans: not
    # a statement ON CLUSTER can carry, so it is left to the views (new spans)
    return create_trace_id_ts(t) + ([] if t.cluster else [backfill])


# Migration 6, the embedded store only: its background merges of otel_traces
# were about as much of the agent's CPU as the inserts themselves. The merge
# selector's base (default 5) is how many parts of a size it lets gather
# before merging them: at 20 each span is rewritten by fewer, wider merges
# over its day's partition (~3 rewrites for a day of 10 s inserts instead of
# ~5.6), at the price of a few more parts to read (tens a day, well below
# parts_to_delay_insert). Stored rows are the same.
TRACES_MERGE_SELECTOR_BASE = 20


def _v6(t: Target) -> list[str]:
    if not t.embedded:
        return []
    return [f"ALTER TABLE {t.database}.{TRACES} MODIFY SETTING merge_selector_base = {TRACES_MERGE_SELECTOR_BASE}"]


# Migration 7, the embedded store only: its merges of otel_traces were most
# of what the store's CPU grows by over hours. Its columns lose their
# explicit ZSTD(1) codec (all but Timestamp's Delta): the engine's own rule
# (chdb_backend's engine configuration, <compression>) then writes parts
# smaller than TRACES_ZSTD_PART_BYTES with LZ4 and larger ones with ZSTD(1),
# so the frequent merges of fresh, small parts cost ~27% less (LZ4 for them
# is ~55% more disk, for their few hours) and what stays on disk is ZSTD(1)
# as before. Parts written before keep their codec until merged.
TRACES_ZSTD_PART_BYTES = 64 << 20


# The embedded store's inserts of spans leave out the Collector schema's four
# bloom-filter indexes on the attribute maps (~0.6 us of a span's ~5.5 us
# insert): the engine builds them at a part's first merge, as every merge
# builds all the indexes of the part it writes (a merge costs no more for it).
# Until then a query reads that part whole, which is correct and unpruned:
# the parts of the last few minutes, and the last small parts of a day.
TRACES_INSERT_DEFERRED_INDEXES = ("idx_res_attr_key", "idx_res_attr_value",
                                  "idx_span_attr_key", "idx_span_attr_value")


def _v7(t: Target) -> list[str]:
    if not t.embedded:
        return []
    return [f"ALTER TABLE {t.database}.{TRACES} MODIFY COLUMN {quote_identifier(c)} REMOVE CODEC"
            for c in _columns_of(_TRACES_BODY) if c != "Timestamp"]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "initial: otel_traces, kernel_events, metric_samples", _v1),
    Migration(2, "kernel_events.Node", _v2),
    Migration(3, "insert deduplication on single-server tables", _v3),
    Migration(4, "SpanKind and StatusCode as the OpenTelemetry Collector spells them", _v4),
    Migration(5, "the Collector's trace-id lookup table and its view", _v5),
    Migration(6, "embedded store: fewer, wider merges of otel_traces", _v6),
    Migration(7, "embedded store: otel_traces parts LZ4 while small, ZSTD(1) once large", _v7),
)
SCHEMA_VERSION = MIGRATIONS[-1].version


def all_statements(t: Target, upto: int = SCHEMA_VERSION) -> list[str]:
    """Every statement of a fresh install up to `upto` (for review and for the
    parser test)."""
    out = [create_database(t), create_schema_version_table(t)]
    for m in MIGRATIONS:
        if m.version <= upto:
            out.extend(m.statements(t))
    return out


# -- tables made by someone else ------------------------------------------------
# CREATE ... IF NOT EXISTS keeps a table that is already there (one the
# OpenTelemetry Collector made, say). At start-up each table spanlet uses is
# compared with spanlet's own: a different engine or sorting key is reported
# and worked with (reads deduplicate with `final = 1`, which a plain MergeTree
# ignores); a missing column spanlet writes, or a plain table where cluster
# mode needs the Distributed one, refuses the store with one line.

_DIFFERENT_ENGINE = {
    "ReplacingMergeTree": "a span or event sent twice (a retried insert) is stored twice",
    "MergeTree": "lookups read it as the collector's form",
}


@dataclass(frozen=True)
class Difference:
    table: str
    what: str
    fatal: bool

    def __str__(self) -> str:
        return f"table {self.table}: {self.what}"


def _columns_of(body: str) -> list[str]:
    """The columns a table body declares and spanlet writes (Nested ones as
    `Outer.Inner`; MATERIALIZED and ALIAS columns left out)."""
    out, nested = [], None
    for line in body.splitlines():
        m = re.match(r"^( {4}| {8})(\w+) (.*)$", line)
        if not m or m.group(2) == "INDEX":
            if nested and line.strip().startswith(")"):
                nested = None
            continue
        indent, name, rest = m.groups()
        if len(indent) == 8 and nested:
            out.append(f"{nested}.{name}")
        elif rest.startswith("Nested"):
            nested = name
        elif " MATERIALIZED " not in f" {rest} " and " ALIAS " not in f" {rest} ":
            out.append(name)
    return out


def _sorting_key(body: str) -> str:
    m = re.search(r"^ORDER BY \(?([^)\n]*)\)?$", body, re.M)
    return m.group(1) if m else ""


def _expected(t: Target) -> dict[str, tuple[str, str, list[str]]]:
    """table → (engine, sorting key, columns) as spanlet makes it (in cluster
    mode: of the `_local` table)."""
    out = {table: ("ReplacingMergeTree", _sorting_key(body), _columns_of(body))
           for table, body in TABLE_BODIES.items()}
    out[TRACE_ID_TS] = ("MergeTree", _sorting_key(_TRACE_ID_TS_BODY), _columns_of(_TRACE_ID_TS_BODY))
    if t.cluster:
        out = {table: ("Replicated" + engine, key, cols) for table, (engine, key, cols) in out.items()}
    return out


def table_differences(query: Callable[[str], list[tuple]], t: Target) -> list[Difference]:
    """How the tables spanlet uses differ from spanlet's own (none on a store
    spanlet made)."""
    db = quote_string(t.database)
    tables = {name: (engine, key) for name, engine, key in query(
        f"SELECT name, engine, sorting_key FROM system.tables WHERE database = {db}")}
    columns: dict[str, dict[str, str]] = {}
    for table, name, ctype in query(f"SELECT table, name, type FROM system.columns WHERE database = {db}"):
        columns.setdefault(table, {})[name] = ctype
    out = []
    for table, (engine, key, cols) in _expected(t).items():
        if table not in tables:
            continue
        data = table
        if t.cluster:
            if tables[table][0] != "Distributed":
                out.append(Difference(table, f"engine {tables[table][0]}, not the Distributed table over "
                                             f"{table}_local that cluster mode writes through", True))
                continue
            data = f"{table}_local"
            if data not in tables:
                continue
        have_engine, have_key = tables[data]
        if have_engine != engine:
            out.append(Difference(data, f"engine {have_engine}, not spanlet's {engine}: "
                                        f"{_DIFFERENT_ENGINE[engine.removeprefix('Replicated')]}; reads work",
                                  False))
        if have_key.replace(" ", "") != key.replace(" ", ""):
            out.append(Difference(data, f"sorting key ({have_key}), not spanlet's ({key}): "
                                        "reads by trace id may scan more of it", False))
        have = columns.get(table, {})
        missing = [c for c in cols if c not in have]
        if missing:
            out.append(Difference(table, f"no column {', '.join(missing)}, which spanlet writes", True))
        json = [c for c in cols if have.get(c, "").startswith(("JSON", "Object("))]
        if json:   # the collector's json table form
            out.append(Difference(table, f"column {', '.join(json)} of type JSON, where spanlet writes "
                                         "a Map (the collector's json table form)", True))
    return out


def check_tables(query: Callable[[str], list[tuple]], t: Target) -> list[Difference]:
    """table_differences, each logged once; raises BackendError naming the
    first that makes the store unusable."""
    from spanlet.exporters.clickhouse import BackendError
    found = table_differences(query, t)
    for d in found:
        (log.error if d.fatal else log.warning)("store: %s", d)
    fatal = [d for d in found if d.fatal]
    if fatal:
        raise BackendError(f"store refused: {fatal[0]}")
    return found


def current_version(query: Callable[[str], list[tuple]], t: Target) -> int:
    rows = query(f"SELECT max(Version) FROM {t.database}.{SCHEMA_VERSION_TABLE}")
    return int(rows[0][0]) if rows and rows[0][0] is not None else 0


def migrate(query: Callable[[str], list[tuple]], t: Target, upto: int = SCHEMA_VERSION) -> int:
    """Bring the database to version `upto`: create the database and the
    bookkeeping table, run each missing migration in order and record it.
    `query` runs one statement (Backend.query). Returns the version reached."""
    if upto > SCHEMA_VERSION:
        raise ValueError(f"no migration to version {upto} (latest {SCHEMA_VERSION})")
    query(create_database(t))
    query(create_schema_version_table(t))
    check_tables(query, t)       # before any migration touches a table someone else made
    version = current_version(query, t)
    for m in MIGRATIONS:
        if version < m.version <= upto:
            for stmt in m.statements(t):
                query(stmt)
            query(f"INSERT INTO {t.database}.{SCHEMA_VERSION_TABLE} (Version, Description) "
                  f"VALUES ({m.version}, {quote_string(m.description)})")
            version = m.version
    return version
