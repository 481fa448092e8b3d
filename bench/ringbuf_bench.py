"""How many GPU launch records a second the agent's reader decodes before the
ring buffer drops: the stand-in cuLaunchKernel is driven at rising rates with
launch_events=all while a reader thread runs Probe.poll (ring buffer walked in
C, a batch of records per wake-up, each decoded when a field of it is read ->
sink), as the daemon does; and the reader's ceiling draining a full ring.
With --before, the same for the Python walk with a ctypes decode per record
(the reader before the C walk, still the one where spanlet._ring is not
built), in the same run.

--pages N (repeatable) measures the rates for each ring size in the same run;
--busy N keeps N processes spinning beside the reader, as a busy node's other
work (the drops of a small ring come when the reader is not run in time).

Run as root: .venv/bin/python bench/ringbuf_bench.py [--window S] [--before] [--pages N ...] [--busy N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

import cuda_standin  # noqa: E402
from spanlet import config  # noqa: E402
from spanlet.probes.gpu import GpuProbe  # noqa: E402

RATES = [50_000, 100_000, 200_000, 300_000, 400_000, 500_000, 750_000, 1_000_000]


class Reader:
    """The daemon's reader thread, which can be paused."""

    def __init__(self, probe: GpuProbe):
        self.probe = probe
        self.running, self.done = threading.Event(), threading.Event()
        self.running.set()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.done.is_set():
            if self.running.wait(0.1):
                self.probe.poll(100)

    def close(self) -> None:
        self.done.set()
        self.thread.join()


def step(w, probe: GpuProbe, line: str, n: int) -> dict:
    """Run one workload line of `n` launches; wait until every record is
    either decoded or counted as dropped."""
    read0, drop0 = probe.events_read, probe.events_dropped()
    (out,) = w.run(line)
    producer_s = int(out.split()[2]) / 1e9
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if probe.events_read - read0 + probe.events_dropped() - drop0 >= n:
            break
        time.sleep(0.001)
    decoded, dropped = probe.events_read - read0, probe.events_dropped() - drop0
    # Over the producer's window: the reader ran alongside it, and the last
    # batch (below the wake-up size) is only picked up at the poll timeout.
    return {"offered": n / producer_s, "decoded": decoded, "dropped": dropped,
            "decoded_rate": decoded / producer_s}


def drain_rate(w, probe: GpuProbe, reader: Reader, n: int) -> float:
    """The reader's ceiling: records decoded per second while emptying a ring
    filled with the reader paused."""
    reader.running.clear()
    time.sleep(0.15)  # let a poll in progress return
    read0 = probe.events_read
    w.run(f"bench {n}")
    t0 = time.perf_counter()
    probe.drain()
    rate = (probe.events_read - read0) / (time.perf_counter() - t0)
    reader.running.set()
    return rate


class PythonWalk(GpuProbe):
    """The reader before: the ring walked in Python, a ctypes struct per record."""

    native_ring = False


class CallbackOnly(PythonWalk):
    """Diagnostic: the Python walk's per-record callback with no decoding, to
    show how its time splits between the walk and the decode."""

    def _on_record(self, _buf, _offset, _size) -> None:
        self.events_read += 1


def _reads_header(ev) -> None:
    ev.hdr.span_id          # what the daemon's join reads of every record


def _reads_payload(ev) -> None:
    ev.func                 # a payload field: the record decoded into its struct


def ceiling(cfg, w, cls, n: int, sink=lambda ev: None) -> float:
    """Records/s one reader decodes while emptying a ring filled with it paused
    (best of three fills)."""
    probe = cls(cfg, sink=sink)
    if not probe.start().attached:
        raise SystemExit(f"probe did not attach: {probe.status.reason}")
    reader = Reader(probe)
    try:
        return max(drain_rate(w, probe, reader, n) for _ in range(3))
    finally:
        reader.close()
        probe.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=float, default=0.5, help="seconds of launches per rate")
    ap.add_argument("--before", action="store_true",
                    help="also the Python walk with a ctypes decode per record, in the same run")
    ap.add_argument("--pages", type=int, action="append", default=[],
                    help="the ring's pages (repeatable: each size's rates in the same run; default: the agent's)")
    ap.add_argument("--busy", type=int, default=0,
                    help="processes spinning beside the reader all along (a busy node's other work)")
    args = ap.parse_args()
    t_start = time.monotonic()
    cfg = config.load(env={})
    cfg.gpu.launch_events = "all"
    sizes = args.pages or [cfg.ringbuf_pages]
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        return _run(args, cfg, sizes, t_start)
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def _run(args, cfg, sizes: list[int], t_start: float) -> int:
    with tempfile.TemporaryDirectory(prefix="spanlet-ringbuf-bench-") as tmp:
        standin = cuda_standin.build(Path(tmp))
        with cuda_standin.Workload(standin.workload) as w:
            w.load(standin.lib_dir)
            w.run("bench 10000")  # warm up
            capacity = cfg.ringbuf_pages * 4096 // 120  # 112-byte record + 8-byte ring header
            full = capacity * 9 // 10
            readers = [("C walk", GpuProbe)] + ([("Python walk", PythonWalk)] if args.before else [])
            ceilings = {}
            for label, cls in readers:
                ceilings[label] = (ceiling(cfg, w, cls, full),
                                   ceiling(cfg, w, cls, full, sink=_reads_header),
                                   ceiling(cfg, w, cls, full, sink=_reads_payload))
            if args.before:
                callback_only = ceiling(cfg, w, CallbackOnly, full)
            tables = {}
            for pages in sizes:
                sized = config.load(env={}, overrides=[f"ringbuf_pages={pages}", "gpu.launch_events=all"])
                for label, cls in readers:
                    tables[f"{label}, {pages} pages (~{pages * 4096 // 120:,} records)"] = \
                        rate_table(sized, w, cls, args.window)
    print(f"GPU launch records through the ring buffer, reader = Probe.poll -> sink, {args.window} s per rate"
          + (f", {args.busy} process(es) spinning beside it" if args.busy else ""))
    for label, rows in tables.items():
        print(f"\n{label}:")
        print(f"{'target':>12}{'offered/s':>14}{'decoded/s':>14}{'decoded':>10}{'dropped':>10}")
        best, first_drop = 0.0, None
        for target, r in rows:
            print(f"{target:>12}{r['offered']:>14,.0f}{r['decoded_rate']:>14,.0f}{r['decoded']:>10,}"
                  f"{r['dropped']:>10,}")
            if r["dropped"] == 0:
                best = max(best, r["decoded_rate"])
            elif first_drop is None:
                first_drop = r["offered"]
        print(f"highest decoded rate with zero drops: {best:,.0f}/s")
        print("drops begin at an offered rate of " + (f"{first_drop:,.0f}/s" if first_drop else
              "(none: the producer's uprobe cost limits the offered rate first)"))
    print(f"\nreader ceiling (draining a full ring of {cfg.ringbuf_pages} pages, producer idle), records/s:")
    for label, (top, header, payload) in ceilings.items():
        print(f"  {label}: {top:,.0f} to a consumer that keeps each record; "
              f"{header:,.0f} to one that reads each record's header (ev.hdr.span_id); "
              f"{payload:,.0f} to one that reads a payload field (ev.func)")
    if args.before:
        c, p = ceilings["C walk"][0], ceilings["Python walk"][0]
        print(f"  ratio C / Python walk: {c / p:.1f}x; the Python walk's callback alone, "
              f"no decode: {callback_only:,.0f}/s")
    print(f"goal: >= 500,000/s; wall time {time.monotonic() - t_start:.1f} s")
    return 0


def rate_table(cfg, w, cls, window: float) -> list[tuple[str, dict]]:
    """Decoded and dropped records at each offered rate, then flat out."""
    probe = cls(cfg, sink=lambda ev: None)
    st = probe.start()
    if not st.attached:
        raise SystemExit(f"probe did not attach: {st.reason}")
    reader = Reader(probe)
    try:
        rows = []
        for rate in RATES:
            n = int(rate * window)
            rows.append((f"{rate:,}/s", step(w, probe, f"paced {n} {rate}", n)))
        n = int(RATES[-1] * window)
        rows.append(("flat out", step(w, probe, f"bench {n}", n)))
        return rows
    finally:
        reader.close()
        probe.stop()


if __name__ == "__main__":
    raise SystemExit(main())
