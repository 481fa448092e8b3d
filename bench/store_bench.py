"""Rows per second into the embedded ClickHouse (chdb), per table the store
writes, the way before (Python rows as JSONCompactEachRow text) and the way
now, side by side in one run, in batches of the sink's default size: rows/s
of the process's CPU (the engine's threads included: one core's worth) and
of the wall clock, the rows' making from what the agent holds included
(decoded ring-buffer records, received spans, metric families). Then the
resident memory of a process before and after chdb is loaded.

otel_traces is measured with what its inserts cost later as well: a run of
`--inserts` batches, then `--quiet` seconds for the background merges they
cause, all of the process's CPU (every thread, less its idle rate measured
before and the input's making), in rounds that alternate the way before
(schema v5 in its own database: the merge selector's default base; Python
rows as JSON text, the way the store still takes for spans the C block
leaves out) and the way now (schema v6; the rows cut in C from the bytes
the join serialized each resource to, as the agent's store gets them, laid
out as a Native block in C). The spans are an SDK's: traces of 8 spans, 6
attributes each, kernel facts among them.

    .venv/bin/python bench/store_bench.py [--batch 30000] [--seconds 4] [--inserts 30] [--quiet 10] [--rounds 2]
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

    def sdk_spans(self):
        """(ResourceSpans, the join's bytes of each): traces of 8 spans, as an SDK's."""
        import random

        from opentelemetry.proto.trace.v1 import trace_pb2
        from store_load import BASE_NS
        start, rnd = self._ids(), random.Random(self.next_id)
        rs = trace_pb2.ResourceSpans()
        for key, value in (("service.name", "frontend"), ("telemetry.sdk.language", "python"),
                           ("k8s.pod.name", "web-0"), ("k8s.namespace.name", "prod"), ("k8s.node.name", "node-1")):
            rs.resource.attributes.add(key=key).value.string_value = value
        ss = rs.scope_spans.add()
        ss.scope.name, ss.scope.version = "opentelemetry.instrumentation.flask", "0.48b0"
        parent = b""
        for n in range(start, start + self.batch):
            if n % 8 == 0:
                trace_id, parent = rnd.randbytes(16), b""
            span = ss.spans.add(trace_id=trace_id, span_id=rnd.randbytes(8), parent_span_id=parent,
                                name=f"POST /v1/images/{n % 7}", kind=1 if parent else 2,
                                start_time_unix_nano=BASE_NS + n * 1_000_000)
            span.end_time_unix_nano = span.start_time_unix_nano + rnd.randrange(10 ** 5, 10 ** 8)
            for key, value in (("http.method", "POST"), ("http.route", f"/v1/images/{n % 7}"),
                               ("net.peer.name", f"10.0.0.{n % 50}")):
                span.attributes.add(key=key).value.string_value = value
            for key, value in (("http.status_code", 200), ("kernel.gpu.launches", 50),
                               ("kernel.gpu.launch_ns", rnd.randrange(10 ** 6))):
                span.attributes.add(key=key).value.int_value = value
            parent = span.span_id
        return [rs], [rs.SerializeToString()]

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
        ("metric_samples", "families", [
            ("before: Python rows, JSON", put("metric_samples", rows.METRIC_COLUMNS,
                                               lambda f: rows.metric_rows(f, node_ts), db.insert)),
            ("now: series as Native columns", put("metric_samples", rows.METRIC_SERIES_COLUMNS,
                                                   lambda f: rows.metric_series_rows(f, node_ts), db.insert)),
        ]),
    ]


def other_database(db, database: str, upto: int | None = None):
    """A backend over `db`'s engine session (chdb has one a process) for another
    database, made with the migrations up to `upto` (default: all)."""
    import copy

    from spanlet.exporters.clickhouse import schema
    other = copy.copy(db)
    other.target, other._types = schema.Target(database=database, embedded=True), {}
    schema.migrate(other._query_locked, other.target, schema.SCHEMA_VERSION if upto is None else upto)
    return other


def spans_with_merges(db, inputs: Inputs, a) -> list[tuple[str, float, float, float]]:
    """(label, spans per CPU second, insert calls' CPU per span, later CPU per span) of each way,
    its rounds summed."""
    from spanlet.exporters.clickhouse import rows

    before = other_database(db, "spanlet_before", upto=5)

    def old_way(given):
        before.insert("otel_traces", rows.TRACE_COLUMNS, rows.span_rows(given[0]))

    def new_way(given):
        db.insert("otel_traces", rows.SPAN_PROTO_COLUMNS, rows.span_proto_rows(*given))

    ways = [("before: Python rows as JSON, merge base 5", old_way),
            ("now: Native block in C from the join's bytes, base 20", new_way)]
    for _, store in ways:
        store(inputs.sdk_spans())             # each way loads what it needs once
    time.sleep(a.quiet)
    totals = {label: [0.0, 0.0, 0] for label, _ in ways}
    for _ in range(a.rounds):
        for label, store in ways:
            c0, t0 = time.process_time(), time.perf_counter()
            time.sleep(2.0)
            idle = (time.process_time() - c0) / (time.perf_counter() - t0)      # the engine's own wakeups
            making = calls = 0.0
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(a.inserts):
                m0 = time.thread_time()
                given = inputs.sdk_spans()
                making += time.thread_time() - m0
                s0 = time.process_time()
                store(given)
                calls += time.process_time() - s0
            time.sleep(a.quiet)
            total = time.process_time() - c0 - making - idle * (time.perf_counter() - t0)
            t = totals[label]
            t[0] += calls
            t[1] += total - calls
            t[2] += a.inserts * a.batch
    return [(label, n / (calls + later), calls / n * 1e6, later / n * 1e6)
            for label, (calls, later, n) in totals.items()]


def metric_parts(db, inputs: Inputs, node_ts: int, batches: int = 8) -> dict[str, float]:
    """CPU ms per batch of each part of the metric_samples insert, the engine's apart: the series
    rows, their Native block, the block's hash and file, the engine's SELECT of the file alone
    (FORMAT Null), then the INSERT of it (the table's write)."""
    import os

    import xxhash

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
        token = xxhash.xxh3_128_hexdigest(data)
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
    from spanlet.config import StoreConfig
    ap.add_argument("--batch", type=int, default=StoreConfig().batch_rows, help="rows an insert (the store's default)")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--inserts", type=int, default=30, help="otel_traces inserts a way a round")
    ap.add_argument("--quiet", type=float, default=10.0, help="seconds after a way's inserts for its merges")
    ap.add_argument("--rounds", type=int, default=2)
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
        spans = spans_with_merges(db, inputs, a)
        parts = metric_parts(db, inputs, time.time_ns())
        after = rss_mb()
        db.close()
    print(f"chdb inserts, batches of {a.batch:,}, rows/s of one core's CPU (and of the wall clock); "
          f"goal >= {GOAL:,} rows/s for every table:")
    for table, label, cpu_rate, wall_rate in results:
        print(f"  {table:15} {label:44} {cpu_rate:>9,.0f} per CPU second ({wall_rate:,.0f}/s)")
    print(f"otel_traces, {a.rounds} x {a.inserts} inserts of {a.batch:,} SDK spans a way, each way's "
          f"merges included ({a.quiet:.0f} s after its inserts), all threads' CPU:")
    for label, cpu_rate, calls_us, later_us in spans:
        print(f"  {label:44} {cpu_rate:>9,.0f} spans per CPU second "
              f"({calls_us:.1f} us a span in the insert calls, rows' making included, +{later_us:.1f} us later)")
    print(f"  ratio now / before: {spans[1][1] / spans[0][1]:.2f}")
    print(f"metric_samples now, CPU ms per batch of {a.batch:,} (the engine's read and its write apart):")
    for key, ms in parts.items():
        print(f"  {key:34} {ms:7.1f} ms  ({ms * 1000 / a.batch:.2f} us a row)")
    print(f"RSS: {before:.0f} MB before chdb, {loaded:.0f} MB with chdb and the schema, "
          f"{after:.0f} MB after the inserts (goal: agent <= 400 MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
