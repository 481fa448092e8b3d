"""The embedded store: ClickHouse through chdb, with its data directory on the
node's disk, behind the Backend interface; the engine in this process or, as
the agent runs it, in a process of its own (engine_process.py), the rows
encoded here either way.

chdb runs one embedded server per process: a second ChdbBackend on another
path can only be opened after the first was closed."""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import time
from typing import Any, Sequence

import xxhash

from spanlet.exporters.clickhouse import BackendError, BackendUnavailable
from spanlet.exporters.clickhouse import kernel_records, metric_native, schema, span_protos
from spanlet.exporters.clickhouse import rows as rows_mod
from spanlet.exporters.clickhouse.engine_process import STATEMENT_TIMEOUT_S, EngineProcess
from spanlet.exporters.clickhouse.http_backend import RETRYABLE_CLICKHOUSE_CODES

_DT64 = re.compile(r"^(?:LowCardinality\()?(?:Nullable\()?DateTime64\((\d)")
_ARRAY_DT64 = re.compile(r"^Array\(DateTime64\((\d)")
_ERROR_CODE = re.compile(r"\bCode: (\d+)\.")

# Inserted DateTime64 text is UTC (see _utc_text), results are too; JSON
# output for query() with 64-bit integers and decimals as numbers, so that
# UInt64 and Int64 come back as Python ints.
# No replacing merge of each inserted block (it halved the insert rate of
# otel_traces): a block rarely holds one key twice, and every read is FINAL.
_SESSION_SETTINGS = ("session_timezone = 'UTC'",
                     "output_format_json_quote_64bit_integers = 0",
                     "output_format_json_quote_decimals = 0",
                     "optimize_on_insert = 0")


# The spans' inserts: their bloom-filter indexes built at the first merge (schema.py).
_SPAN_INSERT_SETTINGS = ("exclude_materialize_skip_indexes_on_insert = "
                         + schema.quote_string(", ".join(schema.TRACES_INSERT_DEFERRED_INDEXES)))


# The embedded server's own configuration, given to chdb as its config file
# (written into the data directory at open; chdb reads it when the process's
# one embedded server starts). Removing outdated parts (those merged away):
# past concurrent_part_removal_threshold (100) of them waiting, the engine
# removes them on a pool of up to 128 threads, which then stay, idle, for the
# life of the process (their stacks and allocator caches: a step of ~125
# threads and ~20 MB of RSS in the agent the first time it happens, under a
# steady insert load within minutes). One by one they take well under a second.
ENGINE_CONFIG_FILE = "spanlet-engine.xml"
# Spans, ring-buffer records and metric series wait in INCOMING_FILE for the
# one INSERT that reads them (under the lock).
INCOMING_FILE = "spanlet-incoming.data"
OLD_SCHEMA_FILE = "spanlet-spans.proto"
# The engine's memory worker reads the process's memory figures every 100 ms
# by default (a steady ~0.3% of a core in an idle agent): once every 5 s is
# enough for an embedded store whose memory the agent bounds itself.
# Each table's background task (merges, TTL, removing merged-away parts)
# that finds nothing to do sleeps 0.1 s x 1.1^n plus up to 1 s by default,
# about 1.5 wake-ups a second a table, 9 tables: from 5 s x 1.5^n, at most
# 60 s, plus up to 1 s. An insert still wakes its table's task at once (the
# engine triggers it), so merges follow inserts as before.
# Columns without a codec of their own are written with LZ4 in parts smaller
# than schema.TRACES_ZSTD_PART_BYTES, ZSTD(1) in larger ones (schema
# migration 7: otel_traces' columns, whose frequent small merges this makes
# cheaper).
# The engine's own bound on the memory it tracks (its queries, inserts and
# merges; 0: the engine's default, 90% of the machine's): past it a statement
# fails with MEMORY_LIMIT_EXCEEDED, which the sink retries.
_ENGINE_CONFIG = """<clickhouse>
    <max_server_memory_usage>%(memory)d</max_server_memory_usage>
    <memory_worker_period_ms>5000</memory_worker_period_ms>
    <background_processing_pool_thread_sleep_seconds_if_nothing_to_do>5</background_processing_pool_thread_sleep_seconds_if_nothing_to_do>
    <background_processing_pool_task_sleep_seconds_when_no_work_multiplier>1.5</background_processing_pool_task_sleep_seconds_when_no_work_multiplier>
    <background_processing_pool_task_sleep_seconds_when_no_work_max>60</background_processing_pool_task_sleep_seconds_when_no_work_max>
    <merge_tree>
        <concurrent_part_removal_threshold>1000000000</concurrent_part_removal_threshold>
    </merge_tree>
    <compression>
        <case>
            <min_part_size>%(zstd)d</min_part_size>
            <min_part_size_ratio>0</min_part_size_ratio>
            <method>zstd</method>
            <level>1</level>
        </case>
    </compression>
</clickhouse>
"""


def _utc_text(ns: int) -> str:
    """Epoch nanoseconds → 'YYYY-MM-DD hh:mm:ss.fffffffff' in UTC: the one
    DateTime64 text ClickHouse parses exactly (a bare number is read as
    seconds, a short digit string as a date)."""
    sec, frac = divmod(int(ns), 1_000_000_000)
    return f"{_utc_second(sec)}.{frac:09d}"


@functools.lru_cache(maxsize=4096)
def _utc_second(sec: int) -> str:
    """'YYYY-MM-DD hh:mm:ss' of an epoch second (cached: a batch's rows share
    a few seconds, and gmtime plus formatting cost more than the lookup)."""
    t = time.gmtime(sec)
    return (f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d} "
            f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}")


# json.dumps with any keyword builds a new JSONEncoder on every call: one, built once.
_encode_row = json.JSONEncoder(ensure_ascii=False).encode


def _classify(exc: Exception) -> Exception:
    """The engine's own word on a failure: a full or failing disk, memory or
    overload is BackendUnavailable (the sink keeps the rows and retries);
    anything else refuses this statement for good."""
    text = str(exc).strip()
    message = text.splitlines()[0] if text else repr(exc)
    found = _ERROR_CODE.search(text)
    if found and int(found.group(1)) in RETRYABLE_CLICKHOUSE_CODES:
        return BackendUnavailable(message)
    return BackendError(message)


class ChdbBackend:
    """Backend over an embedded chdb session at `path` (created if missing;
    persistent across restarts). Thread-safe: every call holds one lock."""

    name = "chdb"

    def __init__(self, path: str, database: str = "spanlet", ttl_days: int = 7, *,
                 own_process: bool = False, memory_mb: int = 0,
                 statement_timeout_s: float = STATEMENT_TIMEOUT_S):
        """`own_process`: the engine in a process of its own (engine_process.py),
        as the agent's store runs it; in this process otherwise. `memory_mb`:
        the engine's bound on the memory it tracks (0: the engine's default).
        `statement_timeout_s`: own_process only, the wait for a statement's
        answer before the engine's process is killed (and started again)."""
        self.target = schema.Target(database=database, ttl_days=ttl_days, embedded=True)
        self.path = os.path.abspath(path)
        os.makedirs(self.path, exist_ok=True)
        self._lock = threading.Lock()
        self._types: dict[str, dict[str, str]] = {}
        self.engine: EngineProcess | None = None
        try:
            config = os.path.join(self.path, ENGINE_CONFIG_FILE)
            with open(config, "w") as f:
                f.write(_ENGINE_CONFIG % {"memory": memory_mb << 20, "zstd": schema.TRACES_ZSTD_PART_BYTES})
            try:                 # the spans' ProtobufList schema of agents before the Native block
                os.unlink(os.path.join(self.path, OLD_SCHEMA_FILE))
            except FileNotFoundError:
                pass
            uri = f"{self.path}?config-file={config}"
            setup = tuple(f"SET {setting}" for setting in _SESSION_SETTINGS)
            if own_process:
                self.engine = self._session = EngineProcess(uri, setup, statement_timeout_s)
            else:
                from chdb import session as chdb_session
                self._session = chdb_session.Session(uri)
                for stmt in setup:
                    self._session.query(stmt)
        except BackendError as e:
            raise BackendError(f"cannot open chdb at {self.path}: {e}") from e
        except Exception as e:   # chdb raises RuntimeError/ChdbError
            raise BackendError(f"cannot open chdb at {self.path}: {e}") from e
        self._closed = False

    # -- Backend ------------------------------------------------------------

    def ensure_schema(self, upto: int = schema.SCHEMA_VERSION) -> int:
        """Apply the forward migrations up to `upto` (default: all)."""
        with self._lock:
            self._types.clear()
            return schema.migrate(self._query_locked, self.target, upto)

    def schema_version(self) -> int:
        with self._lock:
            return schema.current_version(self._query_locked, self.target)

    def insert(self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """INSERT rows (values as schema.py's conventions say) as
        JSONCompactEachRow data: every value is encoded, never spliced into
        SQL text. Rows of rows.SPAN_PROTO_COLUMNS are serialized spans, laid
        out as a Native block in C (span_protos.py); rows of
        rows.KERNEL_RECORD_COLUMNS ring-buffer records: the engine builds
        their columns (kernel_records.py); rows of
        rows.METRIC_SERIES_COLUMNS are metric series, laid out as a Native
        block (metric_native.py). (Arrow columns were tried for metrics:
        pyarrow brings pandas, ~90 MB more resident in the agent.)"""
        if not rows:
            return
        schema.check_identifier(table, "table name")
        columns = tuple(columns)
        if columns == rows_mod.SPAN_PROTO_COLUMNS:
            self._insert_span_protos(table, rows)
            return
        if columns == rows_mod.KERNEL_RECORD_COLUMNS:
            self._insert_kernel_records(table, rows)
            return
        if columns == rows_mod.METRIC_SERIES_COLUMNS:
            self._insert_metric_series(table, rows)
            return
        with self._lock:
            self._check_open()
            types = self._column_types_locked(table)
            ctypes = []
            for col in columns:
                ctype = types.get(col)
                if ctype is None:
                    raise BackendError(f"{table} has no column {col!r}")
                ctypes.append(ctype)
            width = len(columns)
            for row in rows:
                if len(row) != width:
                    raise BackendError(f"row of {len(row)} values for {width} columns")
            self._insert_json_locked(table, columns, ctypes, rows)

    def _insert_json_locked(self, table: str, columns: tuple, ctypes: Sequence[str],
                            rows: Sequence[Sequence[Any]]) -> None:
        convert = []
        for i, ctype in enumerate(ctypes):
            if _DT64.match(ctype):
                convert.append((i, False))
            elif _ARRAY_DT64.match(ctype):
                convert.append((i, True))
        lines = []
        dumps = _encode_row
        for row in rows:
            if convert:
                row = list(row)
                for i, is_array in convert:
                    v = row[i]
                    row[i] = [_utc_text(x) for x in v] if is_array else _utc_text(v)
            lines.append(dumps(row))
        sql = (f"INSERT INTO {self.target.database}.{table} ({self._column_list(columns)}) "
               f"FORMAT JSONCompactEachRow\n" + "\n".join(lines))
        self._run_locked(sql, "CSV")

    @staticmethod
    def _column_list(columns: Sequence[str]) -> str:
        return ", ".join(schema.quote_identifier(c) for c in columns)

    def _insert_kernel_records(self, table: str, record_rows: Sequence[Sequence[Any]]) -> None:
        """One INSERT ... SELECT of the records, read from a RowBinary file."""
        data = kernel_records.encode(record_rows)
        with self._lock:
            self._check_open()
            self._insert_from_file_locked(data, lambda path: kernel_records.insert_sql(
                self.target.database, table, path))

    def _insert_metric_series(self, table: str, series_rows: Sequence[Sequence[Any]]) -> None:
        """One INSERT ... SELECT of the series, read from a Native block; a
        batch with values the block cannot hold as given goes through
        rows.metric_rows' Python rows (metric_native.Unsuitable)."""
        try:
            data = metric_native.encode(series_rows)
        except metric_native.Unsuitable:
            self.insert(table, rows_mod.METRIC_COLUMNS, rows_mod.rows_from_metric_series(series_rows))
            return
        with self._lock:
            self._check_open()
            self._insert_from_file_locked(data, lambda path: metric_native.insert_sql(
                self.target.database, table, path))

    def _insert_from_file_locked(self, data: bytes, sql, settings: str = "") -> None:
        """Run the INSERT ... SELECT sql(path) that reads `data` from
        INCOMING_FILE, with a deduplication token of the statement and the
        data: the engine deduplicates an INSERT SELECT only with one (it
        cannot tell that the file's rows come in the same order again), and
        a batch retried or replayed from the spool must be dropped as the
        same block, as the tables' deduplication window (schema v3) means.
        `settings`: more of the INSERT's SETTINGS ("name = value, ...").
        The token is the data's XXH3 128-bit hash: 0.04 us a row of 700 bytes,
        against 0.9 us for blake2b, which it replaced."""
        path = os.path.join(self.path, INCOMING_FILE)
        statement = sql(path)
        digest = xxhash.xxh3_128(statement.encode() + b"\0")
        digest.update(data)
        token = digest.hexdigest()
        head, select, rest = statement.partition(") SELECT ")
        if not select:
            raise ValueError("not an INSERT INTO ... (columns) SELECT")
        more = f", {settings}" if settings else ""
        statement = f"{head}) SETTINGS insert_deduplication_token = '{token}'{more} SELECT {rest}"
        try:
            with open(path, "wb") as f:
                f.write(data)
        except OSError as e:     # a full or failing disk: the sink keeps the rows and retries
            try:
                os.unlink(path)
            except OSError:
                pass
            raise BackendUnavailable(f"cannot write {INCOMING_FILE}: {e}") from e
        try:
            self._run_locked(statement, "CSV")
        finally:
            os.unlink(path)

    def _insert_span_protos(self, table: str, proto_rows: Sequence[Sequence[Any]]) -> None:
        """One INSERT of the spans as a Native block made in C; the rows it
        leaves out (span_protos.native's skip) go through rows.span_rows."""
        data, skip = span_protos.native(proto_rows)
        if data is not None:
            with self._lock:
                self._check_open()
                self._insert_from_file_locked(data, lambda path: span_protos.insert_sql(
                    self.target.database, table, path), _SPAN_INSERT_SETTINGS)
        if skip:
            self.insert(table, rows_mod.TRACE_COLUMNS, rows_mod.rows_from_span_protos(proto_rows[i] for i in skip))

    def query(self, sql: str) -> list[tuple]:
        with self._lock:
            return self._query_locked(sql)

    def release_engine_memory(self) -> int:
        """The engine process gives back what its start left resident (bytes
        paged out); 0 in process, where the agent's own release does it."""
        with self._lock:
            self._check_open()
            return self.engine.release_memory() if self.engine is not None else 0

    def engine_stats(self) -> dict[str, int] | None:
        """The engine process's resident memory and restarts; None in process."""
        engine = self.engine
        if engine is None:
            return None
        return {"rss_bytes": engine.rss_bytes(), "restarts": engine.restarts}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._session.close()
            except Exception:
                pass

    # -- internals ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("chdb backend is closed")

    def _run_locked(self, sql: str, fmt: str):
        self._check_open()
        try:
            return self._session.query(sql, fmt)
        except BackendUnavailable:      # the engine's process ended (engine_process.py)
            raise
        except Exception as e:
            raise _classify(e) from e

    def _query_locked(self, sql: str) -> list[tuple]:
        stripped = sql.strip().rstrip(";")
        head = stripped.split(None, 1)[0].upper() if stripped else ""
        if head in ("SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXISTS", "EXPLAIN"):
            res = self._run_locked(stripped, "JSONCompact")
            data = res.bytes()
            if not data:
                return []
            return [tuple(r) for r in json.loads(data)["data"]]
        self._run_locked(stripped, "CSV")
        return []

    def _column_types_locked(self, table: str) -> dict[str, str]:
        types = self._types.get(table)
        if types is None:
            rows = self._query_locked(
                "SELECT name, type FROM system.columns WHERE database = "
                f"{schema.quote_string(self.target.database)} AND table = {schema.quote_string(table)}")
            if not rows:
                raise BackendError(f"no table {self.target.database}.{table}")
            types = dict(rows)
            self._types[table] = types
        return types
