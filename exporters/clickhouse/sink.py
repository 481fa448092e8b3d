# The ClickHouse sink: a queue bounded in rows, an on-disk spool past it, behind the batching worker, which
# inserts per table in write order, backing off while the store is away and replaying the spool when it returns.
from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import logging
import os
import random
import threading
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spanlet.exporters.batching import EXPORTED, SHUTDOWN, Backoff, BatchWorker, ExportResult
from spanlet.exporters.clickhouse import Backend, BackendError, BackendUnavailable
from spanlet.exporters.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

DEFAULT_SPOOL_MAX_BYTES = 256 * 1024 * 1024
SPOOL_SUFFIX = ".ndjson"
SPOOL_FORMAT_VERSION = 1

# Drop reasons, the keys of stats()["dropped_rows"].
DROP_SPOOL_FULL = "spool_full"  # memory queue full and the spool at its byte bound (or the disk failing)
DROP_REJECTED = "rejected"  # the store refused the batch (BackendError)
DROP_SPOOL_CORRUPT = "spool_corrupt"  # a spool file that cannot be read back
DROP_UNENCODABLE = "unencodable"  # a value the spool format cannot hold
DROP_CLOSED = "closed"  # written after shutdown()


# -- spool format ---------------------------------------------------------------------------------
# One file per batch, named by the write sequence number of its first rows, so that a directory listing
# sorted by name is write order. Line 1 is a JSON header, then one JSON array per row. JSON keeps the spool
# readable by hand and safe to load (no pickle); values JSON lacks are tagged one-key objects.

def _encode_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_encode_value(v) for v in value]
    if isinstance(value, tuple):
        return {"$tuple": [_encode_value(v) for v in value]}
    if isinstance(value, dict):
        return {"$map": [[_encode_value(k), _encode_value(v)] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dt.datetime):
        return {"$datetime": value.isoformat()}
    if isinstance(value, dt.date):
        return {"$date": value.isoformat()}
    if isinstance(value, uuid.UUID):
        return {"$uuid": str(value)}
    if isinstance(value, decimal.Decimal):
        return {"$decimal": str(value)}
    raise TypeError(f"cannot spool a value of type {type(value).__name__}")


_DECODERS = {
    "$tuple": lambda v: tuple(_decode_value(x) for x in v),
    "$map": lambda v: {_decode_value(k): _decode_value(x) for k, x in v},
    "$bytes": lambda v: base64.b64decode(v),
    "$datetime": dt.datetime.fromisoformat,
    "$date": dt.date.fromisoformat,
    "$uuid": uuid.UUID,
    "$decimal": decimal.Decimal,
}


def _decode_value(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode_value(v) for v in value]
    if isinstance(value, dict):
        ((tag, inner),) = value.items()
        return _DECODERS[tag](inner)
    return value


def encode_batch(table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> bytes:
    """The bytes of one spool file."""
    header = {"v": SPOOL_FORMAT_VERSION, "table": table, "columns": list(columns), "rows": len(rows)}
    lines = [json.dumps(header, separators=(",", ":"))]
    lines.extend(json.dumps([_encode_value(v) for v in row], separators=(",", ":")) for row in rows)
    return ("\n".join(lines) + "\n").encode("utf-8")


def read_spool_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        header = json.loads(f.readline())
    if header.get("v") != SPOOL_FORMAT_VERSION or not isinstance(header.get("table"), str):
        raise ValueError(f"unknown spool header in {path.name}")
    return header


def decode_batch(data: bytes) -> tuple[str, list[str], list[list[Any]]]:
    lines = data.decode("utf-8").splitlines()
    header = json.loads(lines[0])
    rows = [_decode_value(json.loads(line)) for line in lines[1:]]
    if header.get("v") != SPOOL_FORMAT_VERSION or len(rows) != header["rows"]:
        raise ValueError("spool file is truncated or of an unknown version")
    return header["table"], header["columns"], rows


# -- queue items ----------------------------------------------------------------------------------

@dataclass
class _Chunk:
    """Rows from one write() (split at batch_rows), in memory."""
    seq: int
    columns: tuple[str, ...]
    rows: list[Sequence[Any]]


@dataclass
class _SpoolFile:
    seq: int
    path: Path
    rows: int
    size: int


@dataclass
class _Batch:
    table: str
    columns: tuple[str, ...]
    rows: list[Sequence[Any]]
    seq: int
    spool: _SpoolFile | None = None  # set when the batch is read back from disk
    attempts: int = 0


@dataclass
class _Table:
    memory: deque[_Chunk] = field(default_factory=deque)
    memory_rows: int = 0
    spool: deque[_SpoolFile] = field(default_factory=deque)


class _StoreQueue:
    """The batching worker's queue for the store: rows per table in memory up to queue_rows (the batch in
    flight counts), the oldest spilled to the spool past that, up to spool_max_bytes; a table's spool goes
    out before its memory, the lowest write sequence first. Runs under the worker's lock."""

    def __init__(self, batch_rows: int, queue_rows: int, spool_dir: Path | None, spool_max_bytes: int,
                 stats: dict[str, Any]) -> None:
        self.batch_rows, self.queue_rows = batch_rows, queue_rows
        self.spool_dir, self.spool_max_bytes = spool_dir, spool_max_bytes
        self._stats = stats
        self._tables: dict[str, _Table] = {}
        self._seq = 0
        self._sealed_seq = 0  # memory chunks below this sequence number are due
        self.queued_rows = 0  # memory + the batch the worker holds from memory
        self._inflight: _Batch | None = None
        self.dropped: dict[str, int] = {}
        self.dropped_by_table: dict[str, dict[str, int]] = {}
        self._ratelog = RateLimitedLog(log)

    # -- producer side ----------------------------------------------------------------------------

    def put(self, item: tuple[str, tuple[str, ...], Sequence[Sequence[Any]]]) -> bool:
        """Queue rows; past the memory bound the oldest rows move to the spool."""
        table, columns, rows = item
        state = self._tables.setdefault(table, _Table())
        for start in range(0, len(rows), self.batch_rows):
            piece = list(rows[start:start + self.batch_rows])
            state.memory.append(_Chunk(self._next_seq(), columns, piece))
            state.memory_rows += len(piece)
            self.queued_rows += len(piece)
        self._spill_over_bound()
        self._stats["queued_rows_max"] = max(self._stats["queued_rows_max"], self.queued_rows)
        return True

    def refuse(self, item) -> None:
        table, _, rows = item
        self._drop(table, DROP_CLOSED, len(rows), "sink is shut down")

    # -- worker side ------------------------------------------------------------------------------

    def ready(self) -> bool:
        return any(self._due(t) for t in self._tables.values())

    def seal(self) -> None:
        self._sealed_seq = self._seq

    def _due(self, state: _Table) -> bool:
        return bool(state.spool) or bool(state.memory) and (
            state.memory_rows >= self.batch_rows or state.memory[0].seq < self._sealed_seq)

    def take(self) -> _Batch | None:
        """The due batch with the lowest sequence number; a table's spool comes before its memory."""
        heads = [((t.spool[0] if t.spool else t.memory[0]).seq, name)
                 for name, t in self._tables.items() if self._due(t)]
        if not heads:
            return None
        _, name = min(heads)
        state = self._tables[name]
        if state.spool:
            entry = state.spool[0]
            batch = _Batch(name, (), [], entry.seq, spool=entry)
        else:
            batch = self._take_memory_batch(name)
            self.queued_rows += len(batch.rows)  # in flight from memory still counts against the memory bound
        self._inflight = batch
        return batch

    def idle(self) -> bool:
        return self._inflight is None and self.queued_rows == 0 and not any(t.spool for t in self._tables.values())

    def settle(self, batch: _Batch, outcome: str, result: ExportResult | None) -> None:
        if outcome == SHUTDOWN:
            self._give_back(batch)
        else:
            self._finish(batch, delivered=outcome == EXPORTED)

    def close(self) -> None:
        """Spool what is left in memory, so that a restart delivers it."""
        for name in list(self._tables):
            while self._tables[name].memory:
                self._spill(self._take_memory_batch(name))

    def _finish(self, batch: _Batch, delivered: bool) -> None:
        """A batch that left the queue for good: delivered, refused or unreadable."""
        self._inflight = None
        if batch.spool is not None:
            self._unindex_spool_file(batch.table, batch.spool)
            batch.spool.path.unlink(missing_ok=True)
        else:
            self.queued_rows -= len(batch.rows)
        if delivered:
            self._stats["rows_written"] += len(batch.rows)
            self._stats["batches_written"] += 1
            if batch.spool is not None:
                self._stats["replayed_rows"] += len(batch.rows)
        elif batch.spool is not None and not batch.rows:
            self._drop(batch.table, DROP_SPOOL_CORRUPT, batch.spool.rows,
                       f"spool file {batch.spool.path.name} unreadable")
        else:
            self._drop(batch.table, DROP_REJECTED, len(batch.rows), f"store refused a batch for {batch.table}")

    def _give_back(self, batch: _Batch) -> None:
        """Shutdown ran out of time while this batch waited: keep it on disk (spool batches already are)."""
        self._inflight = None
        if batch.spool is None:
            self.queued_rows -= len(batch.rows)
            self._spill(batch)

    # -- memory and spool bookkeeping -------------------------------------------------------------

    def _next_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _spill_over_bound(self) -> None:
        # Spool holds the oldest rows of a table and memory the newest, so spilling takes from the memory head.
        while self.queued_rows > self.queue_rows:
            heads = [(t.memory[0].seq, name) for name, t in self._tables.items() if t.memory]
            if not heads:
                return
            self._spill(self._take_memory_batch(min(heads)[1]))

    def _take_memory_batch(self, table: str) -> _Batch:
        """Pop up to batch_rows rows of the same columns from the head of a table's memory queue."""
        state = self._tables[table]
        first = state.memory.popleft()
        batch = _Batch(table, first.columns, list(first.rows), first.seq)
        while state.memory and state.memory[0].columns == batch.columns \
                and len(batch.rows) + len(state.memory[0].rows) <= self.batch_rows:
            batch.rows.extend(state.memory.popleft().rows)
        state.memory_rows -= len(batch.rows)
        self.queued_rows -= len(batch.rows)
        return batch

    def _spill(self, batch: _Batch) -> None:
        """Move a batch that left memory to the spool, or drop it when the spool cannot take it."""
        if self.spool_dir is None:
            self._drop(batch.table, DROP_SPOOL_FULL, len(batch.rows), "memory queue full and no spool configured")
            return
        try:
            data = encode_batch(batch.table, batch.columns, batch.rows)
        except (TypeError, ValueError) as exc:
            self._drop(batch.table, DROP_UNENCODABLE, len(batch.rows), str(exc))
            return
        if self._stats["spooled_bytes"] + len(data) > self.spool_max_bytes:
            self._drop(batch.table, DROP_SPOOL_FULL, len(batch.rows),
                       f"spool at its bound of {self.spool_max_bytes} bytes")
            return
        path = self.spool_dir / f"{batch.seq:020d}{SPOOL_SUFFIX}"
        tmp = self.spool_dir / f".tmp-{batch.seq:020d}"
        try:
            # No fsync: this runs in write()'s thread, and the page cache already survives an agent crash.
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._drop(batch.table, DROP_SPOOL_FULL, len(batch.rows), f"spool write failed: {exc}")
            return
        self._index_spool_file(batch.table, _SpoolFile(batch.seq, path, len(batch.rows), len(data)))
        self._stats["spooled_rows_total"] += len(batch.rows)

    def _index_spool_file(self, table: str, entry: _SpoolFile) -> None:
        spool = self._tables.setdefault(table, _Table()).spool
        spool.append(entry)
        if len(spool) > 1 and spool[-2].seq > entry.seq:  # a returned in-flight batch is older than the tail
            ordered = sorted(spool, key=lambda e: e.seq)
            spool.clear()
            spool.extend(ordered)
        self._stats["spooled_rows"] += entry.rows
        self._stats["spooled_bytes"] += entry.size
        self._stats["spooled_bytes_max"] = max(self._stats["spooled_bytes_max"], self._stats["spooled_bytes"])
        self._stats["spooled_files"] += 1

    def _unindex_spool_file(self, table: str, entry: _SpoolFile) -> None:
        self._tables[table].spool.remove(entry)
        self._stats["spooled_rows"] -= entry.rows
        self._stats["spooled_bytes"] -= entry.size
        self._stats["spooled_files"] -= 1

    def load_spool(self) -> None:
        """Index what an earlier run left; new writes get later sequence numbers than all of it."""
        assert self.spool_dir is not None
        for leftover in self.spool_dir.glob(".tmp-*"):
            leftover.unlink(missing_ok=True)  # a write cut short by a crash; its rows were never acknowledged
        for path in sorted(self.spool_dir.glob(f"*{SPOOL_SUFFIX}")):
            try:
                seq = int(path.name[: -len(SPOOL_SUFFIX)])
                header = read_spool_header(path)
            except (ValueError, OSError) as exc:
                log.warning("clickhouse sink: dropping unreadable spool file %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
                self._stats["spool_corrupt_files"] += 1
                continue
            entry = _SpoolFile(seq, path, int(header["rows"]), path.stat().st_size)
            self._index_spool_file(header["table"], entry)
            self._seq = max(self._seq, seq + 1)
        if self._stats["spooled_files"]:
            log.info("clickhouse sink: %d spooled batches (%d rows) to replay from %s",
                     self._stats["spooled_files"], self._stats["spooled_rows"], self.spool_dir)

    def _drop(self, table: str, reason: str, rows: int, detail: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + rows
        by_table = self.dropped_by_table.setdefault(table, {})
        by_table[reason] = by_table.get(reason, 0) + rows
        self._ratelog(logging.WARNING, reason, "clickhouse sink dropped %d rows (%s): %s", rows, reason, detail)


class ClickHouseSink:
    """Never-blocking writer in front of a Backend. Order per table is write order, across memory and spool."""

    def __init__(
        self,
        backend: Backend,
        batch_rows: int = 10_000,
        batch_interval_s: float = 1.0,
        queue_rows: int = 200_000,
        spool_dir: Path | str | None = None,
        spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES,
        max_backoff_s: float = 30.0,
        *,
        min_backoff_s: float = 0.1,
        rng: random.Random | None = None,
        close_backend: bool = True,
        ensure_schema: bool = True,
    ):
        if batch_rows <= 0 or queue_rows <= 0:
            raise ValueError("batch_rows and queue_rows must be positive")
        self.backend = backend
        self.batch_rows = min(batch_rows, queue_rows)
        self.batch_interval_s = batch_interval_s
        self.queue_rows = queue_rows
        self.spool_dir = Path(spool_dir) if spool_dir is not None else None
        self.spool_max_bytes = spool_max_bytes if self.spool_dir is not None else 0
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self._close_backend = close_backend
        self._schema_pending = ensure_schema  # done by the worker, so the agent starts while the store is away
        self._cond = threading.Condition()
        self._stats: dict[str, Any] = {
            "rows_written": 0, "batches_written": 0, "queued_rows_max": 0,
            "spooled_rows": 0, "spooled_bytes": 0, "spooled_bytes_max": 0, "spooled_files": 0,
            "spooled_rows_total": 0,
            "replayed_rows": 0, "spool_corrupt_files": 0, "schema_version": None, "last_error": None,
        }
        self._queue = _StoreQueue(self.batch_rows, queue_rows, self.spool_dir, self.spool_max_bytes, self._stats)
        if self.spool_dir is not None:
            self.spool_dir.mkdir(parents=True, exist_ok=True)
            self._queue.load_spool()
        # The store is retried for as long as it takes: only shutdown's deadline ends it (the batch is spooled).
        backoff = Backoff(min_backoff_s, max_backoff_s, rng=rng or random.Random())
        self._worker = BatchWorker(self._queue, self.export, backoff, schedule_delay_s=batch_interval_s,
                                   name="spanlet-clickhouse-sink", cond=self._cond, join_grace_s=0.5, logger=log)
        self._worker.start()

    # -- public API -------------------------------------------------------------------------------

    def write(self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """Queue rows; never waits on the store. Past the memory bound the oldest rows move to the spool."""
        if rows:
            self._worker.put((table, tuple(columns), rows))

    def flush(self, timeout_s: float) -> bool:
        """Send everything queued and spooled; True when all of it reached the store (or was dropped)."""
        return self._worker.force_flush(timeout_s)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush against one deadline, then spool what is left so a restart delivers it. Safe twice."""
        if not self._worker.shutdown(timeout_s):
            return
        if self._close_backend:
            try:
                self.backend.close()
            except Exception:  # noqa: BLE001 - shutdown must finish
                log.warning("clickhouse sink: backend close failed", exc_info=True)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            q = self._queue
            out = dict(self._stats)
            out["retries"] = self._worker.retries
            out["queued_rows"] = q.queued_rows
            out["dropped_rows"] = dict(q.dropped)
            out["dropped_rows_total"] = sum(q.dropped.values())
            out["dropped_rows_by_table"] = {t: dict(r) for t, r in q.dropped_by_table.items()}
            return out

    # -- the worker's export ----------------------------------------------------------------------

    def export(self, batch: _Batch, timeout_s: float | None = None) -> ExportResult:
        """Insert one batch (reading it back from the spool first when it is on disk). Unavailable is
        retryable; a refusal, an unreadable spool file or a backend bug is final."""
        if not batch.rows and batch.spool is not None:
            try:
                _, columns, rows = decode_batch(batch.spool.path.read_bytes())
            except (ValueError, OSError, KeyError, TypeError, IndexError) as exc:
                return self._failed(f"unreadable spool file {batch.spool.path.name}: {exc}", batch)
            batch.columns, batch.rows = tuple(columns), rows
        try:
            self._ensure_schema()
            self.backend.insert(batch.table, list(batch.columns), batch.rows)
            return ExportResult(True)
        except BackendUnavailable as exc:
            return self._failed(f"store unavailable: {exc}", batch, retryable=True)
        except BackendError as exc:
            return self._failed(f"store refused {len(batch.rows)} rows for {batch.table}: {exc}", batch)
        except Exception as exc:  # noqa: BLE001 - a backend bug must not kill the worker; treat as a refusal
            return self._failed(f"backend insert failed: {type(exc).__name__}: {exc}", batch)

    def _ensure_schema(self) -> None:
        if not self._schema_pending:
            return
        try:
            version = self.backend.ensure_schema()
        except BackendError as exc:  # the tables may exist already; inserts will tell
            log.warning("clickhouse sink: schema statements refused (%s); inserting anyway", exc)
            version = None
        self._schema_pending = False
        with self._cond:
            self._stats["schema_version"] = version

    def _failed(self, message: str, batch: _Batch, retryable: bool = False) -> ExportResult:
        """Note the error (an outage is logged once per batch, at INFO) and answer the worker."""
        with self._cond:
            self._stats["last_error"] = message
        batch.attempts += 1
        if not retryable or batch.attempts == 1:
            log.log(logging.INFO if retryable else logging.WARNING, "clickhouse sink: %s", message)
        return ExportResult(False, retryable=retryable, message=message)
