"""Cost of the join's side of the span facts map: SpanFacts.take() (one
BPF_MAP_LOOKUP_AND_DELETE_ELEM) for a row that is there and one that is not,
and rows()/ages() (the sweep's read) of a full map, on the real span_ctx program.

Run as root: .venv/bin/python bench/span_facts_bench.py [--rows N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from spanlet import config  # noqa: E402
from spanlet.probes.span_ctx import SpanCtxProbe  # noqa: E402

TRACE_ID = bytes(range(1, 17))


def fill(facts, n: int) -> None:
    """n rows, as the kernel would have made them (span ids 1..n)."""
    for i in range(1, n + 1):
        facts.put_row(TRACE_ID, i, launches_driver=50, first_ns=time.monotonic_ns())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=65_536)
    a = ap.parse_args()
    cfg = config.load(env={}, overrides=[f"join.span_facts_max={a.rows}"])
    span = SpanCtxProbe(cfg)
    if not span.start().attached:
        raise SystemExit(f"span_ctx did not attach: {span.status.reason}")
    try:
        facts = span.facts
        n = min(a.rows, 50_000)
        fill(facts, n)
        t0 = time.perf_counter()
        got = sum(facts.take(TRACE_ID, i) is not None for i in range(1, n + 1))
        hit = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        for i in range(1, n + 1):
            facts.take(TRACE_ID, i)
        miss = (time.perf_counter() - t0) / n
        fill(facts, a.rows)
        t0 = time.perf_counter()
        present = len(facts.rows())
        full = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert len(facts.ages()) == present
        sweep = time.perf_counter() - t0
    finally:
        span.stop()
    print(f"span facts map, {a.rows} rows max")
    print(f"take(), row present (read + delete + decode): {hit * 1e6:6.2f} us  ({got} of {n} found)")
    print(f"take(), no row:                               {miss * 1e6:6.2f} us")
    print(f"rows() over a full map ({present} rows):       {full * 1e3:6.1f} ms")
    print(f"ages() (what the sweep reads), same map:     {sweep * 1e3:6.1f} ms")
    print("goal: take() a few us at most")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
