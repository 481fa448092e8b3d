# Tests of ClickHouseSink with a Backend written here that refuses for a while: real worker thread, real spool
# files. Bounds, exact drop counts, write order across memory/spool/restart, and shutdown behaviour.
from __future__ import annotations

import datetime as dt
import logging
import random
import threading
import uuid

import pytest

from spanlet.exporters.clickhouse import BackendError, BackendUnavailable
from spanlet.exporters.clickhouse.sink import (DROP_CLOSED, DROP_REJECTED, DROP_SPOOL_CORRUPT, DROP_SPOOL_FULL, ClickHouseSink, decode_batch,
                                       encode_batch)

COLUMNS = ("Seq", "Body")


def rows(start: int, count: int) -> list[list]:
    # Fixed-width values, so that every spool file of a full batch has the same size.
    return [[10_000_000 + i, f"row-{i:08d}"] for i in range(start, start + count)]


def seqs(batch_rows: list) -> list[int]:
    return [r[0] - 10_000_000 for r in batch_rows]


class GatedBackend:
    """Refuses (BackendUnavailable) while `down` is set; records every insert attempt and what it stored."""

    name = "gated"

    def __init__(self, down: bool = True):
        self.down = threading.Event()
        if down:
            self.down.set()
        self.lock = threading.Lock()
        self.stored: dict[str, list] = {}
        self.attempts = 0
        self.refused_batch = None  # rows whose first Seq equals this are refused with BackendError
        self.closed = 0
        self.schema_calls = 0
        self.attempted = threading.Event()  # set by the worker's first call of any kind

    def ensure_schema(self) -> int:
        self.attempted.set()
        if self.down.is_set():
            raise BackendUnavailable("connection refused")
        self.schema_calls += 1
        return 3

    def insert(self, table, columns, rows):
        self.attempted.set()
        with self.lock:
            self.attempts += 1
        if self.down.is_set():
            raise BackendUnavailable("connection refused")
        assert tuple(columns) == COLUMNS
        if self.refused_batch is not None and rows[0][0] == 10_000_000 + self.refused_batch:
            raise BackendError("Code: 53. Type mismatch")
        with self.lock:
            self.stored.setdefault(table, []).extend(list(r) for r in rows)

    def query(self, sql):
        return []

    def close(self):
        self.closed += 1


@pytest.fixture
def sinks():
    made = []
    yield made
    for sink in made:
        sink.shutdown(0.2)


def make_sink(sinks, backend, tmp_path, **kw) -> ClickHouseSink:
    params = dict(batch_rows=10, batch_interval_s=0.05, queue_rows=40, spool_dir=tmp_path / "spool",
                  spool_max_bytes=1 << 20, min_backoff_s=0.01, max_backoff_s=0.05, rng=random.Random(7))
    params.update(kw)
    sink = ClickHouseSink(backend, **params)
    sinks.append(sink)
    return sink


def spool_files(tmp_path):
    return sorted(p.name for p in (tmp_path / "spool").glob("*.ndjson"))


def test_spool_format_round_trips_clickhouse_values():
    row = [1, -2.5, "x", None, True, b"\x00\xff", dt.datetime(2026, 1, 2, 3, 4, 5, 6),
           dt.date(2026, 1, 2), uuid.UUID(int=5), {"k": "v"}, [1, 2], ("a", 1), [{"e": "1"}]]
    table, columns, back = decode_batch(encode_batch("otel_traces", ["c"] * len(row), [row]))
    assert table == "otel_traces" and columns == ["c"] * len(row)
    assert back == [row]
    assert isinstance(back[0][11], tuple) and isinstance(back[0][5], bytes)


def test_outage_bounds_memory_and_spool_and_delivers_the_rest_in_order(sinks, tmp_path):
    backend = GatedBackend(down=True)
    file_size = len(encode_batch("kernel_events", COLUMNS, rows(0, 10)))
    spool_max = 5 * file_size + file_size // 2  # room for exactly 5 batch files
    sink = make_sink(sinks, backend, tmp_path, spool_max_bytes=spool_max)
    sink.write("kernel_events", COLUMNS, rows(0, 10))
    assert backend.attempted.wait(5.0)  # the worker holds batch 0 in flight, backing off
    for b in range(1, 20):  # 200 rows in all while the store is away
        sink.write("kernel_events", COLUMNS, rows(b * 10, 10))

    st = sink.stats()
    assert st["queued_rows_max"] <= 40
    assert st["queued_rows"] == 40
    assert st["spooled_files"] == 5 and st["spooled_bytes"] == 5 * file_size <= spool_max
    assert len(spool_files(tmp_path)) == 5
    # 40 rows stay in memory (the worker's in-flight batch counts), 50 on disk, the other 110 are dropped.
    assert st["dropped_rows"] == {DROP_SPOOL_FULL: 110}
    assert st["rows_written"] == 0

    backend.down.clear()
    assert sink.flush(10.0)
    delivered = seqs(backend.stored["kernel_events"])
    assert len(delivered) == 90 == 200 - sink.stats()["dropped_rows_total"]
    assert delivered == sorted(delivered)  # write order kept across in-flight batch, spool and memory
    # Memory keeps the oldest batch (in flight when the outage began) and the newest 30 rows; the spool the
    # 5 batches after the first; the dropped batches are the ones in between.
    assert delivered == list(range(0, 60)) + list(range(170, 200))
    st = sink.stats()
    assert st["spooled_files"] == 0 and st["spooled_bytes"] == 0 and spool_files(tmp_path) == []
    assert st["replayed_rows"] == 50 and st["rows_written"] == 90 and st["retries"] >= 1
    assert st["queued_rows"] == 0


def test_rejected_batch_is_dropped_and_counted_the_rest_delivered(sinks, tmp_path, caplog):
    backend = GatedBackend(down=False)
    backend.refused_batch = 10
    sink = make_sink(sinks, backend, tmp_path)
    with caplog.at_level(logging.WARNING, logger="spanlet.exporters.clickhouse.sink"):
        for b in range(3):
            sink.write("t", COLUMNS, rows(b * 10, 10))
        assert sink.flush(5.0)
    assert seqs(backend.stored["t"]) == list(range(0, 10)) + list(range(20, 30))
    st = sink.stats()
    assert st["dropped_rows"] == {DROP_REJECTED: 10}
    assert "Type mismatch" in st["last_error"]
    assert "Type mismatch" in caplog.text


def test_spool_survives_restart_and_is_replayed_before_new_rows(sinks, tmp_path):
    backend = GatedBackend(down=True)
    first = make_sink(sinks, backend, tmp_path, queue_rows=20)
    for b in range(6):
        first.write("t", COLUMNS, rows(b * 10, 10))
    first.shutdown(0.3)  # the store never came back: everything ends up on disk
    assert first.stats()["dropped_rows_total"] == 0
    assert len(spool_files(tmp_path)) == 6
    assert backend.stored == {} and backend.closed == 1

    backend2 = GatedBackend(down=True)
    second = make_sink(sinks, backend2, tmp_path, queue_rows=20)
    assert second.stats()["spooled_rows"] == 60
    for b in range(6, 10):  # newer than anything in the spool; spills next to the old files while still down
        second.write("t", COLUMNS, rows(b * 10, 10))
    assert second.stats()["spooled_files"] >= 8
    backend2.down.clear()
    assert second.flush(5.0)
    assert seqs(backend2.stored["t"]) == list(range(100))
    assert spool_files(tmp_path) == []
    assert second.stats()["schema_version"] == 3


def test_unreadable_spool_files_are_dropped_and_counted(sinks, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / f"{0:020d}.ndjson").write_bytes(encode_batch("t", COLUMNS, rows(0, 10)))
    (spool / f"{1:020d}.ndjson").write_bytes(b"not json\n")  # header unreadable: dropped at start
    truncated = encode_batch("t", COLUMNS, rows(10, 10))
    (spool / f"{2:020d}.ndjson").write_bytes(truncated[: len(truncated) // 2])  # body cut short
    (spool / ".tmp-00000000000000000003").write_bytes(b"partial")
    backend = GatedBackend(down=False)
    sink = make_sink(sinks, backend, tmp_path)
    assert sink.flush(5.0)
    assert seqs(backend.stored["t"]) == list(range(10))
    st = sink.stats()
    assert st["spool_corrupt_files"] == 1 and st["dropped_rows"] == {DROP_SPOOL_CORRUPT: 10}
    assert list(spool.iterdir()) == []


def test_write_does_not_wait_for_a_stuck_insert(sinks, tmp_path):
    backend = GatedBackend(down=False)
    release = threading.Event()
    stored_insert = backend.insert

    def stuck_insert(table, columns, batch):
        backend.attempted.set()
        release.wait(30)
        stored_insert(table, columns, batch)

    backend.insert = stuck_insert
    sink = make_sink(sinks, backend, tmp_path, queue_rows=20)
    sink.write("t", COLUMNS, rows(0, 10))
    assert backend.attempted.wait(5.0)
    writer = threading.Thread(target=lambda: [sink.write("t", COLUMNS, rows(b * 10, 10)) for b in range(1, 30)])
    writer.start()
    writer.join(10.0)
    alive = writer.is_alive()
    release.set()
    assert not alive  # 290 rows written (most spooled) while the insert hung
    assert sink.flush(10.0)
    assert seqs(backend.stored["t"]) == list(range(300))


def test_tables_keep_their_own_order(sinks, tmp_path):
    backend = GatedBackend(down=True)
    sink = make_sink(sinks, backend, tmp_path, queue_rows=20)
    for b in range(4):
        sink.write("a", COLUMNS, rows(b * 10, 10))
        sink.write("b", COLUMNS, rows(100 + b * 10, 10))
    backend.down.clear()
    assert sink.flush(5.0)
    assert seqs(backend.stored["a"]) == list(range(40))
    assert seqs(backend.stored["b"]) == list(range(100, 140))


def test_flush_returns_false_while_store_is_away(sinks, tmp_path):
    backend = GatedBackend(down=True)
    sink = make_sink(sinks, backend, tmp_path)
    sink.write("t", COLUMNS, rows(0, 3))
    assert sink.flush(0.2) is False
    assert sink.stats()["queued_rows"] == 3


def test_small_writes_go_out_after_the_batch_interval(sinks, tmp_path):
    backend = GatedBackend(down=False)
    sink = make_sink(sinks, backend, tmp_path, batch_rows=1000, queue_rows=1000, batch_interval_s=0.05)
    sink.write("t", COLUMNS, rows(0, 3))
    sink.write("t", COLUMNS, rows(3, 2))
    deadline = threading.Event()
    for _ in range(200):  # no flush(): the interval alone must send them, as one batch
        if sink.stats()["rows_written"] == 5:
            break
        deadline.wait(0.025)
    assert seqs(backend.stored["t"]) == [0, 1, 2, 3, 4]
    assert sink.stats()["batches_written"] == 1


def test_shutdown_twice_spools_the_rest_and_drops_later_writes(sinks, tmp_path):
    backend = GatedBackend(down=True)
    sink = make_sink(sinks, backend, tmp_path)
    sink.write("t", COLUMNS, rows(0, 25))
    sink.shutdown(0.2)
    sink.shutdown(0.2)
    assert backend.closed == 1
    assert sink.stats()["spooled_rows"] == 25 and sink.stats()["queued_rows"] == 0
    assert len(spool_files(tmp_path)) == 3
    sink.write("t", COLUMNS, rows(25, 1))
    assert sink.stats()["dropped_rows"] == {DROP_CLOSED: 1}


def test_shutdown_delivers_when_the_store_is_up(sinks, tmp_path):
    backend = GatedBackend(down=False)
    sink = make_sink(sinks, backend, tmp_path, batch_interval_s=60.0, batch_rows=100, queue_rows=100)
    sink.write("t", COLUMNS, rows(0, 7))
    sink.shutdown(5.0)
    assert seqs(backend.stored["t"]) == list(range(7))
    assert spool_files(tmp_path) == []


def test_without_spool_overflow_is_dropped_and_counted(sinks, tmp_path):
    backend = GatedBackend(down=True)
    sink = make_sink(sinks, backend, tmp_path, spool_dir=None, queue_rows=20)
    for b in range(5):
        sink.write("t", COLUMNS, rows(b * 10, 10))
    assert sink.stats()["dropped_rows"] == {DROP_SPOOL_FULL: 30}
    backend.down.clear()
    assert sink.flush(5.0)
    delivered = seqs(backend.stored["t"])
    assert len(delivered) == 20 and delivered == sorted(delivered)


def test_drop_log_is_rate_limited(sinks, tmp_path, caplog):
    backend = GatedBackend(down=True)
    sink = make_sink(sinks, backend, tmp_path, spool_dir=None, queue_rows=10)
    with caplog.at_level(logging.WARNING, logger="spanlet.exporters.clickhouse.sink"):
        for b in range(50):
            sink.write("t", COLUMNS, rows(b * 10, 10))
    drops = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(drops) == 1
    assert sink.stats()["dropped_rows"][DROP_SPOOL_FULL] == 490
