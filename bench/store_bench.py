"""Rows per second into the embedded ClickHouse (chdb), per table the store
writes, the way before (Python rows as JSONCompactEachRow text) and the way
now, side by side in one run, in batches of the sink's default size: rows/s
of the process's CPU (the engine's threads included: one core's worth) and
of the wall clock, the rows' making from what the agent holds included
(decoded ring-buffer records, received spans, metric families). Then the
resident memory of a process before and after chdb is loaded.

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

GOAL = 200_000


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Inputs:
    """Fresh input for each batch (ids never repeat: a repeated block is deduplicated)."""

    def __init__(self, batch: int):
        self.batch, self.next_id = batch, 0

    def _ids(self) -> int:
        start = self.next_id
        self.next_id += self.batch
        return start

    def events(self):
        from store_load import kernel_events
        return kernel_events(self._ids(), self.batch)

    def spans(self):
        from store_load import resource_spans
        return resource_spans(self._ids(), self.batch)

    def families(self):
        from spanlet.metrics import Family, HistogramSample, Sample, labels
        start, n = self._ids(), self.batch
        counters = Family("spanlet_gpu_kernel_launches_total", "counter", "launches", "",
                          [Sample(labels(pod=f"pod-{i}", namespace="prod", container="c", api="driver"), float(i))
                           for i in range(start, start + n // 2)])
        hist = Family("spanlet_gpu_sync_wait_seconds", "histogram", "sync wait", "seconds",
                      [HistogramSample(labels(pod=f"pod-{i}", namespace="prod"), (0.001, 0.01, 0.1),
                                       (i % 5, 2, 1, 0), 0.05 * i, i % 5 + 3)
                       for i in range(start, start + n - n // 2)])
        return [counters, hist]


def rate(seconds: float, batch: int, fresh, store) -> tuple[float, float]:
    """(rows per CPU second, rows per wall second) of store(fresh()), fresh()'s own time not counted."""
    n = cpu = wall = 0.0
    store(fresh())     # the first insert of a way loads what it needs once
    while wall < seconds:
        given = fresh()
        c0, t0 = time.process_time(), time.perf_counter()
        store(given)
        cpu += time.process_time() - c0
        wall += time.perf_counter() - t0
        n += batch
    return n / cpu, n / wall


def ways(db, node_ts: int):
    """(table, input, [(label, store)]): the way before first, the agent's way now last."""
    from spanlet.exporters.clickhouse import rows

    def put(table, columns, make, insert):
        return lambda given: insert(table, columns, make(given))

    return [
        ("kernel_events", "events", [
            ("before: Python rows, JSON", put("kernel_events", rows.KERNEL_EVENT_COLUMNS,
                                               rows.kernel_event_rows, db.insert)),
            ("now: ring-buffer records, RowBinary", put("kernel_events", rows.KERNEL_RECORD_COLUMNS,
                                                             rows.kernel_record_rows, db.insert)),
        ]),
        ("otel_traces", "spans", [
            ("Python rows, JSON", put("otel_traces", rows.TRACE_COLUMNS, rows.span_rows, db.insert)),
            ("before and now: serialized, engine-built", put("otel_traces", rows.SPAN_PROTO_COLUMNS,
                                                                       rows.span_proto_rows, db.insert)),
        ]),
        ("metric_samples", "families", [
            ("before: Python rows, JSON", put("metric_samples", rows.METRIC_COLUMNS,
                                               lambda f: rows.metric_rows(f, node_ts), db.insert)),
            ("now: series as Native columns", put("metric_samples", rows.METRIC_SERIES_COLUMNS,
                                                   lambda f: rows.metric_series_rows(f, node_ts), db.insert)),
        ]),
    ]


def metric_parts(db, inputs: Inputs, node_ts: int, batches: int = 8) -> dict[str, float]:
    """CPU ms per batch of each part of the metric_samples insert, the engine's apart: the series
    rows, their Native block, the block's hash and file, the engine's SELECT of the file alone
    (FORMAT Null), then the INSERT of it (the table's write)."""
    import hashlib
    import os

    from spanlet.exporters.clickhouse import metric_native, rows
    path = os.path.join(db.path, "spanlet-bench-metrics.native")
    took = dict.fromkeys(("series rows", "Native block", "hash and file", "engine: SELECT of the file alone",
                          "engine: INSERT (read and write)"), 0.0)
    for i in range(batches + 1):
        given = inputs.families()
        marks = [time.process_time()]
        series = rows.metric_series_rows(given, node_ts)
        marks.append(time.process_time())
        data = metric_native.encode(series)
        marks.append(time.process_time())
        token = hashlib.blake2b(data, digest_size=16).hexdigest()
        with open(path, "wb") as f:
            f.write(data)
        marks.append(time.process_time())
        insert = metric_native.insert_sql(db.target.database, "metric_samples", path)
        select = insert[insert.index(" SELECT ") + 1:]
        db.query(f"{select} FORMAT Null")
        marks.append(time.process_time())
        head, _, rest = insert.partition(") SELECT ")
        db.query(f"{head}) SETTINGS insert_deduplication_token = '{token}' SELECT {rest}")
        marks.append(time.process_time())
        if i:       # the first loads what it needs once
            for key, start, end in zip(took, marks, marks[1:]):
                took[key] += (end - start) * 1000 / batches
    os.unlink(path)
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=4.0)
    a = ap.parse_args()
    before = rss_mb()
    from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend

    results = []
    with tempfile.TemporaryDirectory(prefix="spanlet-store-bench-") as tmp:
        db = ChdbBackend(tmp)
        db.ensure_schema()
        loaded = rss_mb()
        inputs = Inputs(a.batch)
        for table, given, table_ways in ways(db, time.time_ns()):
            fresh = getattr(inputs, given)
            for label, store in table_ways:
                results.append((table, label, *rate(a.seconds, a.batch, fresh, store)))
        parts = metric_parts(db, inputs, time.time_ns())
        after = rss_mb()
        db.close()
    print(f"chdb inserts, batches of {a.batch:,}, rows/s of one core's CPU (and of the wall clock); "
          f"goal >= {GOAL:,} rows/s for every table:")
    for table, label, cpu_rate, wall_rate in results:
        print(f"  {table:15} {label:44} {cpu_rate:>9,.0f} per CPU second ({wall_rate:,.0f}/s)")
    print(f"metric_samples now, CPU ms per batch of {a.batch:,} (the engine's read and its write apart):")
    for key, ms in parts.items():
        print(f"  {key:34} {ms:7.1f} ms  ({ms * 1000 / a.batch:.2f} us a row)")
    print(f"RSS: {before:.0f} MB before chdb, {loaded:.0f} MB with chdb and the schema, "
          f"{after:.0f} MB after the inserts (goal: agent <= 400 MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
