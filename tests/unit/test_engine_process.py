"""The embedded store's engine in a process of its own (engine_process.py), for
real: the agent's process never loads chdb and reads back what it wrote; the
engine's refusals are classified as in process; a killed engine costs a
BackendUnavailable, then a restart after the back-off with every stored row
kept, and a sink loses nothing across it; the engine ends when its agent
ends, however it ends; its memory bound is the engine's; its self-metrics
come only where it runs apart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from spanlet.exporters.clickhouse import BackendError, BackendUnavailable, engine_process
from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend


@pytest.fixture
def backend(tmp_path):
    b = ChdbBackend(str(tmp_path / "store"), own_process=True)
    try:
        b.ensure_schema()
        yield b
    finally:
        b.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, limit_s: float = 30) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


AGENT_SIDE = textwrap.dedent("""
    import sys, time
    from spanlet import events
    from spanlet.exporters.clickhouse import rows
    from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend
    b = ChdbBackend(sys.argv[1], own_process=True)
    b.ensure_schema()
    evs = []
    for i in range(1000):
        ev = events.GpuLaunch()
        ev.hdr.kind, ev.hdr.pid, ev.func = int(events.Kind.GPU_LAUNCH), 4242, i
        ev.epoch_ns = time.time_ns() - 60 * 10**9 + i
        evs.append(ev)
    b.insert("kernel_events", rows.KERNEL_RECORD_COLUMNS, rows.kernel_record_rows(evs))
    print(b.query("SELECT count(), sum(Func) FROM spanlet.kernel_events WHERE Pid = 4242"))
    print("chdb" in sys.modules, any("_chdb" in line for line in open("/proc/self/maps")))
    print(b.engine_stats()["rss_bytes"] > 0, b.engine.pid)
    b.close()
""")


def test_the_agent_process_never_loads_the_engine_and_reads_back_what_it_wrote(tmp_path):
    out = subprocess.run([sys.executable, "-c", AGENT_SIDE, str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    counted, loaded, engine = out.stdout.splitlines()
    assert counted == f"[(1000, {sum(range(1000))})]"
    assert loaded == "False False"
    alive, pid = engine.split()
    assert alive == "True"
    assert _wait_gone(int(pid)), "close() left the engine process running"


def test_the_engine_process_loads_neither_arrow_nor_numpy(backend):
    """chdb imports pyarrow (and with it numpy and OpenBLAS) where it can:
    0.07 s of CPU at each start and tens of MB resident, for Arrow results
    the store never asks for (it reads CSV, writes RowBinary and Native)."""
    assert backend.query("SELECT 1") == [(1,)]
    with open(f"/proc/{backend.engine.pid}/maps") as f:
        maps = f.read()
    assert "_chdb" in maps                       # the engine is loaded, and nothing of these
    assert not [name for name in ("libarrow", "pyarrow", "numpy", "openblas") if name in maps]


def test_a_refusal_is_the_engines_word_as_in_process(backend, tmp_path):
    with pytest.raises(BackendError, match=r"Code: 47\b"):
        backend.query("SELECT no_such_column FROM spanlet.otel_traces")
    with pytest.raises(BackendError, match="row of 1 values"):
        backend.insert("otel_traces", ["TraceId", "SpanId"], [["a"]])
    assert backend.query("SELECT 1") == [(1,)]      # the process is still the same one
    assert backend.engine_stats()["restarts"] == 0


def test_a_killed_engine_is_unavailable_then_restarted_after_the_backoff_with_every_row(backend):
    backend.query("CREATE TABLE spanlet.kept (n UInt64) ENGINE = MergeTree ORDER BY n")
    backend.query("INSERT INTO spanlet.kept SELECT number FROM numbers(500)")
    first = backend.engine.pid
    os.kill(first, signal.SIGKILL)
    assert _wait_gone(first)
    with pytest.raises(BackendUnavailable, match="ended .killed by signal 9"):
        backend.query("SELECT count() FROM spanlet.kept")
    with pytest.raises(BackendUnavailable, match="restarting"):
        backend.query("SELECT count() FROM spanlet.kept")
    time.sleep(engine_process.BACKOFF_FIRST_S + 0.1)
    assert backend.query("SELECT count(), sum(n) FROM spanlet.kept") == [(500, sum(range(500)))]
    assert backend.engine.pid != first
    assert backend.engine_stats()["restarts"] == 1
    # the session's settings are set again in the new process
    assert backend.query("SELECT getSetting('session_timezone')") == [("UTC",)]


def test_a_statement_with_no_answer_in_time_has_the_engine_killed_and_restarted(tmp_path):
    b = ChdbBackend(str(tmp_path / "store"), own_process=True, statement_timeout_s=1.0)
    try:
        b.ensure_schema()
        b.query("CREATE TABLE spanlet.kept (n UInt64) ENGINE = MergeTree ORDER BY n")
        b.query("INSERT INTO spanlet.kept SELECT number FROM numbers(300)")
        first = b.engine.pid
        t = time.monotonic()
        with pytest.raises(BackendUnavailable, match=r"killed by signal 9.*no answer within 1 s"):
            b.query("SELECT sleep(3)")                 # the engine is busy past the wait
        assert time.monotonic() - t < 2.5
        assert _wait_gone(first)
        time.sleep(engine_process.BACKOFF_FIRST_S + 0.1)
        assert b.query("SELECT count() FROM spanlet.kept") == [(300,)]
        assert b.engine.pid != first and b.engine_stats()["restarts"] == 1
        assert b.query("SELECT sleep(0.2)") == [(0,)]  # an answer within the wait is the answer
    finally:
        b.close()


def test_the_backoff_doubles_while_the_engine_keeps_ending_and_is_bounded(backend):
    delays = []
    for _ in range(3):
        pid = backend.engine.pid
        os.kill(pid, signal.SIGKILL)
        assert _wait_gone(pid)
        t = time.monotonic()
        with pytest.raises(BackendUnavailable):
            backend.query("SELECT 1")
        delays.append(backend.engine._next_start - t)
        time.sleep(max(0.0, backend.engine._next_start - time.monotonic()) + 0.05)
        assert backend.query("SELECT 1") == [(1,)]
    assert [round(d) for d in delays] == [1, 2, 4]
    assert backend.engine._backoff <= engine_process.BACKOFF_MAX_S


def test_a_restart_that_fails_doubles_the_backoff_once(backend, monkeypatch):
    pid = backend.engine.pid
    os.kill(pid, signal.SIGKILL)
    assert _wait_gone(pid)
    with pytest.raises(BackendUnavailable, match="ended"):
        backend.query("SELECT 1")                      # next start in 1 s
    monkeypatch.setattr(engine_process.sys, "executable", "/bin/false")   # a process that ends at once
    delays = []
    for _ in range(3):
        time.sleep(max(0.0, backend.engine._next_start - time.monotonic()) + 0.05)
        t = time.monotonic()
        with pytest.raises(BackendUnavailable, match="ended"):
            backend.query("SELECT 1")
        delays.append(backend.engine._next_start - t)
    assert [round(d) for d in delays] == [2, 4, 8]
    monkeypatch.undo()
    time.sleep(max(0.0, backend.engine._next_start - time.monotonic()) + 0.05)
    assert backend.query("SELECT 1") == [(1,)]
    assert backend.engine_stats()["restarts"] == 1


def test_a_sink_keeps_every_row_across_a_killed_engine(tmp_path):
    from spanlet import events
    from spanlet.exporters.clickhouse import rows
    from spanlet.exporters.clickhouse.sink import ClickHouseSink

    b = ChdbBackend(str(tmp_path / "store"), own_process=True)
    sink = ClickHouseSink(b, batch_rows=100, batch_interval_s=0.05, queue_rows=100_000,
                          spool_dir=tmp_path / "spool", spool_max_bytes=1 << 20)
    try:
        base = time.time_ns() - 60 * 10**9
        for batch in range(6):
            evs = []
            for i in range(100):
                ev = events.GpuLaunch()
                ev.hdr.kind, ev.hdr.pid, ev.func = int(events.Kind.GPU_LAUNCH), 77, batch * 100 + i
                ev.epoch_ns = base + batch * 100 + i
                evs.append(ev)
            sink.write("kernel_events", rows.KERNEL_RECORD_COLUMNS, rows.kernel_record_rows(evs))
            if batch == 2:
                time.sleep(0.5)
                pid = b.engine.pid
                os.kill(pid, signal.SIGKILL)
                assert _wait_gone(pid)
        deadline = time.monotonic() + 60
        got = None
        while time.monotonic() < deadline:
            try:
                got = b.query("SELECT count(), uniqExact(Func) FROM spanlet.kernel_events FINAL WHERE Pid = 77")
            except BackendUnavailable:
                got = None
            if got == [(600, 600)]:
                break
            time.sleep(0.2)
        assert got == [(600, 600)]
        assert b.engine_stats()["restarts"] >= 1
        assert sum(sink.stats()["dropped_rows"].values()) == 0
    finally:
        sink.shutdown(30)


PARENT = textwrap.dedent("""
    import sys, time
    from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend
    b = ChdbBackend(sys.argv[1], own_process=True)
    print(b.engine.pid, flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_the_engine_ends_when_its_agent_ends(tmp_path, how):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "store")],
                              stdout=subprocess.PIPE, text=True)
    try:
        engine = int(parent.stdout.readline())
        assert _alive(engine)
        parent.send_signal(how)
        parent.wait(30)
        assert _wait_gone(engine), "the engine outlived its agent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_the_engines_memory_bound_fails_a_statement_retryably(tmp_path):
    b = ChdbBackend(str(tmp_path / "store"), own_process=True, memory_mb=150)
    try:
        b.query("CREATE DATABASE IF NOT EXISTS spanlet")
        b.query("CREATE TABLE spanlet.big (n UInt64) ENGINE = MergeTree ORDER BY n")
        with pytest.raises(BackendUnavailable, match=r"Code: 241\b"):
            b.query("INSERT INTO spanlet.big SELECT length(groupArray(toString(number))) FROM numbers(40000000)")
        assert b.query("SELECT 1") == [(1,)]
        assert b.engine_stats()["restarts"] == 0
    finally:
        b.close()


def test_an_engine_that_cannot_open_its_store_is_a_backend_error(backend):
    """A second engine on the same folder (the engine locks it): refused at the start."""
    with pytest.raises(BackendError, match="could not open its store"):
        ChdbBackend(backend.path, own_process=True)
    assert backend.query("SELECT 1") == [(1,)]


def test_engine_self_metrics_only_where_the_engine_runs_apart():
    from spanlet.metrics.engine import store_metrics
    base = {"dropped_rows_by_table": {}, "queued_rows": 0, "spooled_bytes": 0}
    apart = SimpleNamespace(events_overflow=0, stats=lambda: {**base, "engine_rss_bytes": 5 << 20,
                                                              "engine_restarts": 2})
    inside = SimpleNamespace(events_overflow=0, stats=lambda: dict(base))
    got = {f.name: f.samples[0].value for f in store_metrics(apart)}
    assert got["spanlet_store_engine_resident_bytes"] == 5 << 20
    assert got["spanlet_store_engine_restarts_total"] == 2
    assert not {f.name for f in store_metrics(inside)} & {"spanlet_store_engine_resident_bytes",
                                                           "spanlet_store_engine_restarts_total"}
