# The store goes away for a long stretch (compressed in time) under steady load, for both backends: the embedded
# chdb store loses its disk (a real full filesystem), a ClickHouse server behind the HTTP interface answers 503,
# refuses connections, then hangs. After recovery every span and kernel event that fit in the sink's bounds
# (store.queue_rows in memory, store.spool_max_bytes on disk) is in the store exactly once, by id; what did not
# fit equals the sink's drop counters; a sink restarted with a non-empty spool replays it exactly once.
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from require import cannot_run
from clickhouse_standin import HUNG, REFUSED, UNAVAILABLE_503, UP, ChdbHttpStandin
from spanlet.exporters.clickhouse.http_backend import HttpBackend
from spanlet.exporters.clickhouse.sink import DROP_SPOOL_FULL, ClickHouseSink
from store_load import BASE_NS, KERNEL_EVENTS, STORED_SQL, TRACES, Feed, offered_ids

SUPPORT = Path(__file__).resolve().parents[1] / "support"


def wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def dropped(*stats: dict) -> dict[str, int]:
    """Rows each table lost, summed over the sinks' counters; every loss must be the spool's bound."""
    out = {TRACES: 0, KERNEL_EVENTS: 0}
    for st in stats:
        for table, reasons in st["dropped_rows_by_table"].items():
            assert set(reasons) == {DROP_SPOOL_FULL}, f"{table} lost rows for {reasons}, not the bounds"
            out[table] += sum(reasons.values())
    return out


def assert_exactly_once(stored: dict[str, list[str]], offered: dict[str, int], lost: dict[str, int],
                        base_ns: int = BASE_NS) -> None:
    for table in (TRACES, KERNEL_EVENTS):
        ids = stored[table]
        assert len(ids) == len(set(ids)), f"{table}: {len(ids) - len(set(ids))} rows stored twice"
        assert set(ids) <= offered_ids(table, offered[table], base_ns), f"{table}: rows nobody wrote"
        assert len(ids) + lost[table] == offered[table], (table, len(ids), lost[table], offered[table])
        assert lost[table] > 0, f"{table}: the outage never reached the bounds, so they went untested"


def assert_within_bounds(st: dict, sink_params: dict) -> None:
    assert 0 < st["queued_rows_max"] <= sink_params["queue_rows"]
    assert 0 < st["spooled_bytes_max"] <= sink_params["spool_max_bytes"]


# -- the embedded store: its disk fills up ---------------------------------------------------------

def _private_mount_namespace(probe_dir: Path) -> list[str]:
    """A command prefix that runs a child in its own mount namespace, where it may mount a tmpfs (which
    vanishes with the child): a user namespace where allowed, else root's own."""
    candidates = [["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]]
    if os.geteuid() == 0:
        candidates.append(["unshare", "--mount", "--propagation", "private"])
    probe = ["mount", "-t", "tmpfs", "-o", "size=1m", "spanlet-probe", str(probe_dir)]
    for prefix in candidates:
        if shutil.which(prefix[0]) and subprocess.run(prefix + probe, capture_output=True).returncode == 0:
            return prefix
    reason = "no private mount namespace (unshare) to give the embedded store a disk that fills up"
    cannot_run(reason)


def test_chdb_store_disk_full_then_freed_and_a_restart_keep_every_row_within_the_bounds(tmp_path):
    prefix = _private_mount_namespace(tmp_path)
    child = subprocess.run(prefix + [sys.executable, str(SUPPORT / "chdb_disk_full_child.py"), str(tmp_path)],
                           capture_output=True, text=True, timeout=80)
    assert child.returncode == 0, child.stderr[-4000:]
    facts = json.loads(child.stdout)

    assert facts["flushed_while_up"] and not facts["flushed_while_full"]
    # the disk-full error, retried: the engine's own, or ENOSPC writing the batch the engine reads from a file
    assert "NOT_ENOUGH_SPACE" in facts["outage1_error"] or "[Errno 28]" in facts["outage1_error"]
    assert facts["flushed_after_outage1"] and facts["flushed_after_restart"]
    st1, st_restart, st2 = facts["stats1"], facts["stats_at_restart"], facts["stats2"]
    assert st1["retries"] >= 3 and st1["replayed_rows"] > 0
    for st in (st1, st_restart, st2):
        assert_within_bounds(st, facts["sink"])
    # The restarted sink found the spool the first one left and replayed it, once.
    assert facts["spool_rows_at_restart"] > 0
    assert facts["spooled_rows_loaded"] == facts["spool_rows_at_restart"] == st_restart["spooled_rows"]
    assert st2["replayed_rows"] >= facts["spool_rows_at_restart"]
    assert facts["spool_files_left"] == 0
    assert_exactly_once(facts["stored"], facts["offered"], dropped(st_restart, st2), facts["base_ns"])


# -- a ClickHouse server over HTTP: 503, connection refused, hung ----------------------------------

HTTP_SINK = dict(batch_rows=100, batch_interval_s=0.05, queue_rows=600, spool_max_bytes=120_000,
                 min_backoff_s=0.02, max_backoff_s=0.2)


def http_backend(standin: ChdbHttpStandin) -> HttpBackend:
    # Timeouts compressed like the rest: a hung server costs the worker half a second per attempt.
    return HttpBackend(f"http://127.0.0.1:{standin.port}", compress=False,
                       connect_timeout_s=0.5, send_receive_timeout_s=0.5)


def stored_over_http(backend: HttpBackend) -> dict[str, list[str]]:
    return {table: [str(r[0]) for r in backend.query(sql)] for table, sql in STORED_SQL.items()}


@pytest.fixture
def standin(tmp_path):
    server = ChdbHttpStandin(str(tmp_path / "clickhouse"))
    try:
        yield server
    finally:
        server.close()


def test_clickhouse_server_503_refused_hung_then_back_and_a_restart_keep_every_row_within_the_bounds(
        standin, tmp_path):
    spool = tmp_path / "spool"
    backend = http_backend(standin)
    backend.ensure_schema()
    for table in (TRACES, KERNEL_EVENTS):  # so that a duplicate insert stays visible as a second row
        standin.query(f"SYSTEM STOP MERGES spanlet.{table}")
    sink = ClickHouseSink(backend, spool_dir=spool, rng=random.Random(3), **HTTP_SINK)
    sinks = [sink]
    try:
        feed = Feed(sink)
        feed.run(10, 0.005)
        assert sink.flush(30.0)
        inserts_up = standin.inserts

        # One long outage that changes its face: a proxy answering 503, then no server, then a hung one.
        for mode in (UNAVAILABLE_503, REFUSED, HUNG):
            standin.set_mode(mode)
            retries, refused = sink.stats()["retries"], standin.requests_refused
            feed.run(80, 0.005)
            wait_for(lambda: sink.stats()["retries"] >= retries + 2, 30.0, f"retries while {mode}")
            if mode != REFUSED:
                assert standin.requests_refused > refused  # the failures came from this mode
        assert standin.inserts == inserts_up  # nothing got through while it was away
        assert "unavailable" in sink.stats()["last_error"]
        standin.set_mode(UP)
        assert sink.flush(30.0)
        st1 = sink.stats()
        assert st1["replayed_rows"] > 0
        assert_within_bounds(st1, HTTP_SINK)

        # Away again, and the agent restarts in the middle of it: the spool carries over.
        standin.set_mode(REFUSED)
        feed.run(60, 0.005)
        sink.shutdown(0.5)
        st_restart = sink.stats()
        assert st_restart["spooled_rows"] > 0
        sink = ClickHouseSink(http_backend(standin), spool_dir=spool, rng=random.Random(4), **HTTP_SINK)
        sinks.append(sink)
        assert sink.stats()["spooled_rows"] == st_restart["spooled_rows"]
        feed.sink = sink
        feed.run(20, 0.005)
        standin.set_mode(UP)
        assert sink.flush(30.0)
        st2 = sink.stats()
        assert st2["replayed_rows"] >= st_restart["spooled_rows"]
        assert_within_bounds(st2, HTTP_SINK)
        assert list(spool.glob("*")) == []
        stored = stored_over_http(sink.backend)
    finally:
        for s in sinks:
            s.shutdown(1.0)
    assert_exactly_once(stored, feed.offered, dropped(st_restart, st2))
