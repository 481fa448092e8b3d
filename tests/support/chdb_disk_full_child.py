# The embedded store losing its disk, run in a private mount namespace (test_store_outage.py starts it under
# `unshare`): chdb's data directory is a small tmpfs that a filler file fills up and then frees, while a
# ClickHouseSink takes a steady load; the sink is restarted once with a non-empty spool. Prints one JSON
# object of facts (offered, stored by id, the sink's counters) for the test to assert.
from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend  # noqa: E402
from spanlet.exporters.clickhouse.sink import ClickHouseSink  # noqa: E402
from store_load import BASE_NS, KERNEL_EVENTS, STORED_SQL, TRACES, Feed  # noqa: E402

# Compressed time: small bounds, fast retries.
SINK = dict(batch_rows=100, batch_interval_s=0.05, queue_rows=600, spool_max_bytes=120_000,
            min_backoff_s=0.02, max_backoff_s=0.2)


def fill(disk: Path) -> None:
    """Take every free block of the store's filesystem, as another writer on a shared disk does."""
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass


def wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)


def open_sink(backend, spool: Path, seed: int) -> ClickHouseSink:
    return ClickHouseSink(backend, spool_dir=spool, rng=random.Random(seed), **SINK)


def spool_rows(spool: Path) -> int:
    return sum(json.loads(p.open().readline())["rows"] for p in spool.glob("*.ndjson"))


def main(root: Path) -> dict:
    disk, spool = root / "disk", root / "spool"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "spanlet-test-store", str(disk)], check=True)
    backend = ChdbBackend(str(disk / "chdb"))
    backend.ensure_schema()
    for table in (TRACES, KERNEL_EVENTS):  # so that a duplicate insert stays visible as a second row
        backend.query(f"SYSTEM STOP MERGES spanlet.{table}")
    facts: dict = {"sink": SINK, "base_ns": BASE_NS}

    sink = open_sink(backend, spool, 1)
    feed = Feed(sink)
    feed.run(10, 0.005)
    facts["flushed_while_up"] = sink.flush(30.0)

    # Outage 1: the disk fills under steady load, stays full for a while, then space comes back.
    fill(disk)
    retries0 = sink.stats()["retries"]
    feed.run(300, 0.005)
    wait_for(lambda: sink.stats()["retries"] >= retries0 + 3, 30.0, "retries against the full disk")
    facts["outage1_error"] = sink.stats()["last_error"]
    facts["flushed_while_full"] = sink.flush(0.2)
    (disk / "filler").unlink()
    facts["flushed_after_outage1"] = sink.flush(30.0)
    facts["stats1"] = sink.stats()

    # Outage 2: full again; the agent restarts in the middle of it (the spool carries what memory held).
    fill(disk)
    feed.run(60, 0.005)
    sink.shutdown(0.5)
    facts["stats_at_restart"] = sink.stats()
    facts["spool_rows_at_restart"] = spool_rows(spool)
    backend = ChdbBackend(str(disk / "chdb"))
    sink = open_sink(backend, spool, 2)
    facts["spooled_rows_loaded"] = sink.stats()["spooled_rows"]
    feed.sink = sink
    feed.run(20, 0.005)
    (disk / "filler").unlink()
    facts["flushed_after_restart"] = sink.flush(30.0)
    facts["stored"] = {table: [str(r[0]) for r in backend.query(sql)] for table, sql in STORED_SQL.items()}
    sink.shutdown(2.0)  # closes the backend
    facts["stats2"] = sink.stats()
    facts["spool_files_left"] = len(list(spool.glob("*")))
    facts["offered"] = dict(feed.offered)
    return facts


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
