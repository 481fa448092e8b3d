"""Rows per second into the embedded ClickHouse (chdb) in batches of the
sink's default size, per table, and the resident memory of a process before
and after chdb is loaded (the agent's cost of the embedded store). Spans both
ways side by side: as the agent stores them (serialized, columns built by
the engine) and as Python-built rows in JSON; rows/s of the process's CPU
(the engine's threads included) and of the wall clock, the rows' making from
the received spans included.

    .venv/bin/python bench/store_bench.py [--batch 10000] [--seconds 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support")]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _spans_rate(db, a, make, columns) -> tuple[float, float]:
    """(rows per CPU second, rows per wall second) of spans made into rows and
    inserted `make`'s way (the received spans' own making not counted); fresh
    span ids each batch (a repeated batch is deduplicated)."""
    from store_load import resource_spans
    n = cpu = wall = 0.0
    while wall < a.seconds:
        received = resource_spans(_spans_rate.next_id, a.batch)
        _spans_rate.next_id += a.batch
        c0, t0 = time.process_time(), time.perf_counter()
        db.insert("otel_traces", columns, make(received))
        cpu += time.process_time() - c0
        wall += time.perf_counter() - t0
        n += a.batch
    return n / cpu, n / wall


_spans_rate.next_id = 0


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
        spans = {name: _spans_rate(db, a, make, columns) for name, make, columns in (
            ("serialized, columns by the engine (the agent's way)", rows.span_proto_rows, rows.SPAN_PROTO_COLUMNS),
            ("Python rows as JSON", rows.span_rows, rows.TRACE_COLUMNS))}
        after = rss_mb()
        db.close()
    print(f"chdb inserts, kernel_events, batches of {a.batch:,}: {rate:,.0f} rows/s (goal >= 200,000)")
    for name, (cpu_rate, wall_rate) in spans.items():
        print(f"chdb inserts, otel_traces, {name}: {cpu_rate:,.0f} rows per CPU second, "
              f"{wall_rate:,.0f} rows/s")
    print(f"RSS: {before:.0f} MB before chdb, {loaded:.0f} MB with chdb and the schema, "
          f"{after:.0f} MB after the inserts (goal: agent <= 400 MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
