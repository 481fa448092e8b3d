"""The embedded store's background merges of otel_traces over a long window,
in real time, side by side: the same SDK spans inserted as the agent's store
inserts them (`--batch` spans every `--interval` seconds: 30,000 every 30 s
is 1,000 spans/s with the store's defaults) into one database per way of
storing them, in one engine, for `--minutes`. The engine's part log (turned
on for this bench only) gives each merge's rows and CPU (its ProfileEvents),
so that each way's merge cost is its own although their merges share the
engine's pool. Printed by quarter of the window: merges, rows rewritten per
row inserted (write amplification), merge CPU per row inserted, the insert
calls' CPU per row (the calling thread only: the engine's pipeline threads
do most of an insert) and the active parts' count and size on disk.

Real time matters: the merge selector lowers its base for parts as they age
(from 10 s old at small sizes to an hour), so a window compressed in time
merges differently. The ways:
  now           the schema as it ships (merge_selector_base 20; no codec on the
                columns but Timestamp's, so the engine's <compression> rule
                writes parts of --zstd-above MB and more with ZSTD(1), smaller
                ones with LZ4: schema migration 7)
  zstd          the form before migration 7: every column ZSTD(1), as the
                Collector's DDL has them
  lz4           every column LZ4, whatever the part's size

Not one of `make bench`'s (*_bench.py): it takes its window, 20 minutes by default.

    .venv/bin/python bench/store_merges.py [--minutes 20] [--interval 30] [--batch 30000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support"), str(REPO / "bench")]

from spanlet.exporters.clickhouse import schema  # noqa: E402


def _part_log() -> str:
    return ("<part_log><database>system</database><table>part_log</table>"
            "<flush_interval_milliseconds>2000</flush_interval_milliseconds></part_log>\n</clickhouse>")


def ways() -> dict:
    from spanlet.exporters.clickhouse import rows

    def codec(c):
        return lambda db: [f"ALTER TABLE {db.target.database}.otel_traces MODIFY COLUMN `{n}` CODEC({c})"
                           for n in rows.TRACE_COLUMNS if n != "Timestamp"]

    return {"now": lambda db: [], "zstd": codec("ZSTD(1)"), "lz4": codec("LZ4")}


def report(tag: str, elapsed: float, inserted: int, dbs: dict, insert_cpu: dict) -> None:
    print(f"{tag} ({elapsed:.0f} s, {inserted:,} spans inserted into each):", flush=True)
    first = next(iter(dbs.values()))
    first.query("SYSTEM FLUSH LOGS")
    for name, db in dbs.items():
        d = db.target.database
        merges, merged, cpu_us = first.query(
            "SELECT count(), sum(rows), sum(ProfileEvents['UserTimeMicroseconds'] + "
            "ProfileEvents['SystemTimeMicroseconds']) FROM system.part_log "
            f"WHERE database = '{d}' AND table = 'otel_traces' AND event_type = 'MergeParts'")[0]
        parts, level, size = first.query(
            "SELECT count(), max(level), sum(bytes_on_disk) FROM system.parts "
            f"WHERE database = '{d}' AND table = 'otel_traces' AND active")[0]
        n = max(inserted, 1)
        print(f"  {name:13} {merges:3} merges, {(merged or 0) / n:4.2f} rewrites a row, "
              f"merges {(cpu_us or 0) / n:5.2f} us a row inserted, insert calls {insert_cpu[name] / n * 1e6:5.2f} us a row; "
              f"{parts} parts (level <= {level}), {size / 2**20:.1f} MiB", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--interval", type=float, default=30.0, help="seconds between inserts")
    ap.add_argument("--batch", type=int, default=30_000, help="spans an insert")
    ap.add_argument("--zstd-above", type=int, default=schema.TRACES_ZSTD_PART_BYTES >> 20, metavar="MB",
                    help="now: ZSTD(1) for parts this big")
    a = ap.parse_args()
    if a.minutes <= 0 or a.interval <= 0 or a.batch <= 0 or a.zstd_above <= 0:
        ap.error("--minutes, --interval, --batch and --zstd-above must be positive")

    from spanlet.exporters.clickhouse import chdb_backend, rows
    chdb_backend._ENGINE_CONFIG = chdb_backend._ENGINE_CONFIG.replace(
        "<min_part_size>%(zstd)d<", f"<min_part_size>{a.zstd_above << 20}<").replace(
        "</clickhouse>", _part_log())
    from store_bench import Inputs, other_database

    with tempfile.TemporaryDirectory(prefix="spanlet-merge-bench-") as tmp:
        engine = chdb_backend.ChdbBackend(tmp)
        engine.ensure_schema()
        dbs = {}
        for name, alters in ways().items():
            db = other_database(engine, "merge_" + name.replace("-", "_"))
            for sql in alters(db):
                db.query(sql)
            dbs[name] = db
        inputs, inserts, quarter = Inputs(a.batch), 0, 1
        insert_cpu = dict.fromkeys(dbs, 0.0)
        window = a.minutes * 60
        print(f"{a.batch:,} spans every {a.interval:g} s into {len(dbs)} databases for {a.minutes:g} min",
              flush=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < window:
            given = inputs.sdk_spans()
            for name, db in dbs.items():
                c0 = time.thread_time()
                db.insert("otel_traces", rows.SPAN_PROTO_COLUMNS, rows.span_proto_rows(*given))
                insert_cpu[name] += time.thread_time() - c0
            inserts += 1
            if time.monotonic() - t0 >= quarter * window / 4 and quarter < 4:
                report(f"quarter {quarter}", time.monotonic() - t0, inserts * a.batch, dbs, insert_cpu)
                quarter += 1
            time.sleep(max(0.0, t0 + inserts * a.interval - time.monotonic()))
        time.sleep(min(20.0, a.interval))     # the last inserts' merges
        report("end", time.monotonic() - t0, inserts * a.batch, dbs, insert_cpu)
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
