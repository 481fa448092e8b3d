"""Cost of the GPU launch uprobes to the application: calls per second of the
stand-in cuLaunchKernel (and cudaLaunchKernel, which nests into it) in a tight
C loop, untraced and traced with launch_events=none and =all, side by side.

Run as root: .venv/bin/python bench/uprobe_bench.py [--calls N] [--repeat R]
"""

from __future__ import annotations

import argparse
import statistics
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

LOOPS = {"cuLaunchKernel": "bench", "cudaLaunchKernel": "benchrt"}
MODES = {None: "untraced", "none": "traced, none", "spanned": "traced, spanned", "all": "traced, all"}


def ns_per_call(w: cuda_standin.Workload, loop: str, calls: int, repeat: int) -> float:
    """Median over `repeat` runs of the loop's own clock, per call."""
    runs = []
    for _ in range(repeat):
        (line,) = w.run(f"{loop} {calls}")
        _, n, ns = line.split()
        runs.append(int(ns) / int(n))
    return statistics.median(runs)


class Reader:
    """The daemon's reader thread: Probe.poll in a loop."""

    def __init__(self, probe: GpuProbe):
        self.probe, self.stop = probe, threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            self.probe.poll(100)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def measure(w, standin, mode: str | None, calls: dict[str, int], repeat: int) -> dict[str, float]:
    probe = reader = None
    if mode is not None:
        cfg = config.load(env={})
        cfg.gpu.launch_events = mode
        probe = GpuProbe(cfg, sink=lambda ev: None)
        st = probe.start()
        if not st.attached or not any(str(standin.lib_dir) in a for a in st.attachments):
            raise SystemExit(f"probe did not attach: {st.reason or st.failed_attachments}")
        reader = Reader(probe)
    try:
        out = {api: ns_per_call(w, LOOPS[api], calls[api], repeat) for api in LOOPS}
        if probe is not None:
            probe.drain()
            out["dropped"] = probe.events_dropped()
            out["read"] = probe.events_read
        return out
    finally:
        if reader:
            reader.close()
        if probe:
            probe.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000, help="cuLaunchKernel calls per run")
    ap.add_argument("--runtime-calls", type=int, default=40_000, help="cudaLaunchKernel calls per run")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    calls = {"cuLaunchKernel": args.calls, "cudaLaunchKernel": args.runtime_calls}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="spanlet-uprobe-bench-") as tmp:
        standin = cuda_standin.build(Path(tmp))
        with cuda_standin.Workload(standin.workload) as w:
            w.load(standin.lib_dir)
            ns_per_call(w, "bench", 10_000, 1)  # warm up (page faults, PLT binding)
            results = {mode: measure(w, standin, mode, calls, args.repeat)
                       for mode in MODES}
    base = results[None]
    print(f"GPU launch uprobe cost, stand-in libraries, median of {args.repeat} runs "
          f"({args.calls} driver / {args.runtime_calls} runtime calls each)")
    print("ratio: traced calls/s over untraced calls/s")
    print(f"{'api':<18}{'mode':<17}{'calls/s':>14}{'ns/call':>10}{'ratio':>9}{'ns added':>10}")
    for api in LOOPS:
        for mode, label in MODES.items():
            ns = results[mode][api]
            print(f"{api:<18}{label:<17}{1e9 / ns:>14,.0f}{ns:>10.1f}"
                  f"{base[api] / ns:>9.4f}{ns - base[api]:>10.0f}")
    a = results["all"]
    print(f"launch_events=all: {a['read']} records decoded, {a['dropped']} dropped "
          "(the reader thread polled throughout)")
    print(f"goal: <= 1000 ns added per cuLaunchKernel call; wall time {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
