"""Rows per second into the embedded ClickHouse (chdb) in batches of the
sink's default size, per table, and the resident memory of a process before
and after chdb is loaded (the agent's cost of the embedded store).

    .venv/bin/python bench/store_bench.py [--batch 10000] [--seconds 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=4.0)
    a = ap.parse_args()
    before = rss_mb()
    from spanlet import events
    from spanlet.exporters.clickhouse import rows
    from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend

    with tempfile.TemporaryDirectory(prefix="spanlet-store-bench-") as tmp:
        db = ChdbBackend(tmp)
        db.ensure_schema()
        loaded = rss_mb()
        ev = events.GpuLaunch()
        ev.hdr.kind = events.Kind.GPU_LAUNCH
        ev.hdr.ts_ns = time.monotonic_ns()
        ev.epoch_ns = time.time_ns()
        ev.grid[:] = [4, 1, 1]
        batch = rows.kernel_event_rows([ev] * a.batch)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < a.seconds:
            db.insert("kernel_events", rows.KERNEL_EVENT_COLUMNS, batch)
            n += len(batch)
        rate = n / (time.perf_counter() - t0)
        after = rss_mb()
        db.close()
    print(f"chdb inserts, kernel_events, batches of {a.batch:,}: {rate:,.0f} rows/s (goal >= 200,000)")
    print(f"RSS: {before:.0f} MB before chdb, {loaded:.0f} MB with chdb and the schema, "
          f"{after:.0f} MB after the inserts (goal: agent <= 400 MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
