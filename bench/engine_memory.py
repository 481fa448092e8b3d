"""The embedded store engine's memory over many inserts, compressed in time:
the engine in a process of its own, as the agent's store runs it (its
start-up memory given back, as the agent does once it is up), takes the
soak's inserts, one batch of each table (`--launches` GPU launch records,
`--spans` SDK spans, a metric batch) every `--every` seconds. With the
defaults, one insert of each every 3 s is the soak's every 30 s (1,000
launches/s and 200 spans/s), ten times as often: 20 minutes hold the inserts
and rows of 200 minutes of the soak.

Every `--sample` seconds: the engine process's RSS, the memory the engine
tracks (its statements and merges), jemalloc's allocated and resident bytes
(the engine's allocator: what it holds, and what of it is in RAM), the
active parts and the rows stored. Then, by quarter of the run, the mean and
the minimum of RSS and of jemalloc's allocated bytes (the minimum is the
level between merges), and the verdict `bench/soak.py` gives RSS (the fit
over inserts, in minutes of the soak they stand for).

What this does not reproduce: the merge selector lowers its base as parts
age (real time), and merged-away parts wait old_parts_lifetime (8 minutes)
before their removal, so a compressed run merges differently and holds more
outdated parts at a time than the soak. It answers whether the engine's
memory keeps rising with the number of inserts and rows stored.

Not one of `make bench`'s (*_bench.py): it takes its window, 20 minutes by default.

    .venv/bin/python bench/engine_memory.py [--minutes 20] [--every 3] [--sample 30]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support"), str(REPO / "bench")]

from common import quarter_means, rss_trend  # noqa: E402
from spanlet.exporters.clickhouse import rows  # noqa: E402
from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend  # noqa: E402
from store_bench import Inputs  # noqa: E402

SOAK_INSERT_S = 30.0     # the store's batch_interval_s, at which the soak inserts
MB = 1 << 20


def jemalloc_mb(db: ChdbBackend) -> dict[str, float]:
    """jemalloc's totals line of the engine's stats: allocated, active, metadata, resident, mapped, retained."""
    (text,), = db.query("SELECT stats FROM system.jemalloc_stats")
    line = next((ln for ln in text.splitlines() if ln.startswith("Allocated:")), "")
    return {k.lower(): int(v) / MB for k, v in re.findall(r"(\w+): (\d+)", line)}


def sample(db: ChdbBackend, t: float, inserts: int) -> dict[str, float]:
    (tracked,), = db.query("SELECT value FROM system.metrics WHERE metric = 'MemoryTracking'")
    (active, stored), = db.query(f"SELECT countIf(active), sumIf(rows, active) FROM system.parts "
                                 f"WHERE database = '{db.target.database}'")
    je = jemalloc_mb(db)
    return {"t": t, "inserts": inserts, "rss": db.engine_stats()["rss_bytes"] / MB, "tracked": tracked / MB,
            "allocated": je.get("allocated", float("nan")), "resident": je.get("resident", float("nan")),
            "parts": active, "rows": stored}


def by_quarter(samples: list[dict], key: str) -> str:
    q = max(1, len(samples) // 4)
    quarters = [samples[i * q:(i + 1) * q] if i < 3 else samples[3 * q:] for i in range(4)]
    return " / ".join(f"{sum(s[key] for s in part) / len(part):.1f} (min {min(s[key] for s in part):.1f})"
                      for part in quarters if part)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--every", type=float, default=3.0, help="seconds between inserts (the soak's: 30)")
    ap.add_argument("--sample", type=float, default=30.0, help="seconds between samples")
    ap.add_argument("--launches", type=int, default=30_000, help="launch records an insert (the soak's: 30,000)")
    ap.add_argument("--spans", type=int, default=6_000, help="spans an insert (the soak's: 6,000)")
    ap.add_argument("--warmup", type=int, default=20, help="inserts left out of the fit (the first merges)")
    a = ap.parse_args()
    if a.every <= 0 or a.sample <= 0 or a.minutes <= 0:
        ap.error("--minutes, --every and --sample must be positive")
    launches, spans, families = Inputs(a.launches), Inputs(a.spans), Inputs(200)
    samples: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="spanlet-engine-memory-") as tmp:
        db = ChdbBackend(str(Path(tmp) / "chdb"), own_process=True, memory_mb=1024)
        try:
            db.ensure_schema()
            db.release_engine_memory()
            print(f"an insert of each table every {a.every:g} s ({SOAK_INSERT_S / a.every:g}x the soak's), "
                  f"{a.minutes:g} min; a sample every {a.sample:g} s", flush=True)
            print(f"{'t (s)':>6s} {'inserts':>7s} {'soak min':>8s} {'RSS MB':>7s} {'tracked':>7s} "
                  f"{'jemalloc alloc':>14s} {'resident':>8s} {'parts':>5s} {'rows':>11s}", flush=True)
            t0 = time.monotonic()
            next_insert = next_sample = t0
            inserts = 0
            while time.monotonic() - t0 < a.minutes * 60:
                now = time.monotonic()
                if now >= next_insert:
                    db.insert("kernel_events", rows.KERNEL_RECORD_COLUMNS, rows.kernel_record_rows(launches.events()))
                    db.insert("otel_traces", rows.SPAN_PROTO_COLUMNS, rows.span_proto_rows(*spans.sdk_spans()))
                    db.insert("metric_samples", rows.METRIC_SERIES_COLUMNS,
                              rows.metric_series_rows(families.families(), 0))
                    inserts += 1
                    next_insert += a.every
                if now >= next_sample:
                    s = sample(db, now - t0, inserts)
                    samples.append(s)
                    print(f"{s['t']:6.0f} {inserts:7d} {inserts * SOAK_INSERT_S / 60:8.0f} {s['rss']:7.1f} "
                          f"{s['tracked']:7.1f} {s['allocated']:14.1f} {s['resident']:8.1f} {s['parts']:5d} "
                          f"{s['rows']:11,d}", flush=True)
                    next_sample += a.sample
                time.sleep(max(0.0, min(next_insert, next_sample) - time.monotonic()))
        finally:
            db.close()
    steady = [s for s in samples if s["inserts"] > a.warmup]
    if len(steady) < 8:
        print(f"only {len(steady)} samples after the first {a.warmup} inserts: run longer")
        return 1
    print(f"\n{steady[0]['inserts']}..{steady[-1]['inserts']} inserts ({steady[-1]['rows']:,} rows stored at the end); "
          f"by quarter, mean (min):")
    print(f"  engine RSS (MB)          {by_quarter(steady, 'rss')}")
    print(f"  jemalloc allocated (MB)  {by_quarter(steady, 'allocated')}")
    first, last = quarter_means([s["rss"] for s in steady])
    print(f"  RSS last/first quarter   {last / first:.3f}")
    soak_minutes = [s["inserts"] * SOAK_INSERT_S / 60 for s in steady]
    print(f"engine RSS over the soak's minutes these inserts stand for: "
          f"{rss_trend(soak_minutes, [s['rss'] for s in steady])}")
    print(f"jemalloc allocated, the same way: {rss_trend(soak_minutes, [s['allocated'] for s in steady])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
