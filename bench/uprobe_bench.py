"""Cost of the GPU launch uprobes to the application: calls per second of the
stand-in cuLaunchKernel (driver path) and cudaLaunchKernel (runtime path, which
nests into the driver) in a tight C loop, untraced and traced, outside a span
and inside one (the loop's thread marked in span_ctx, so every launch adds to
its span_facts row), with the default settings and each option, side by side.

Run as root: .venv/bin/python bench/uprobe_bench.py [--calls N] [--repeat R]
"""

from __future__ import annotations

import argparse
import secrets
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
from spanlet.events import Modality  # noqa: E402
from spanlet.probes.gpu import GpuProbe  # noqa: E402
from spanlet.probes.span_ctx import SpanCtxProbe  # noqa: E402

LOOPS = {"cuLaunchKernel": "bench", "cudaLaunchKernel": "benchrt"}
# label → (agent settings, whether the loop's thread is inside a span); None: untraced
MODES = {
    "untraced": None,
    "default, no span": ([], False),
    "default, in a span": ([], True),
    "sampled, in a span": (["gpu.launch_events=sampled"], True),
    "all, in a span": (["gpu.launch_events=all"], True),
    "launch_timing, in span": (["gpu.launch_timing=true"], True),
    "runtime_hooks, in span": (["gpu.runtime_hooks=true"], True),
}


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


def measure(w, standin, mode, calls: dict[str, int], repeat: int) -> dict[str, float]:
    """ns per call of each loop under `mode` (MODES' values)."""
    if mode is None:
        return {api: ns_per_call(w, LOOPS[api], calls[api], repeat) for api in LOOPS}
    overrides, in_span = mode
    cfg = config.load(env={}, overrides=overrides)
    span = SpanCtxProbe(cfg)
    probe = reader = None
    try:
        if not span.start().attached:
            raise SystemExit(f"span_ctx probe did not attach: {span.status.reason}")
        probe = GpuProbe(cfg, sink=lambda ev: None)
        st = probe.start(pin_dir=span.shared_pin_dir())
        if not st.attached or not any(str(standin.lib_dir) in a for a in st.attachments):
            raise SystemExit(f"probe did not attach: {st.reason or st.failed_attachments}")
        reader = Reader(probe)
        if in_span:
            span.set(w.tid, secrets.token_bytes(16), int.from_bytes(secrets.token_bytes(8), "big") | 1,
                     Modality.image)
        out = {api: ns_per_call(w, LOOPS[api], calls[api], repeat) for api in LOOPS}
        probe.drain()
        out["dropped"] = probe.events_dropped()
        out["read"] = probe.events_read
        return out
    finally:
        if reader:
            reader.close()
        if probe:
            probe.stop()
        span.stop()


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
            results = {label: measure(w, standin, mode, calls, args.repeat)
                       for label, mode in MODES.items()}
    base = results["untraced"]
    print(f"GPU launch uprobe cost, stand-in libraries, median of {args.repeat} runs "
          f"({args.calls} driver / {args.runtime_calls} runtime calls each)")
    print("ratio: traced calls/s over untraced calls/s; settings as gpu.* keys (default: launch_events=off, "
          "one entry-only driver uprobe per launch)")
    print(f"{'api':<18}{'mode':<24}{'calls/s':>14}{'ns/call':>10}{'ratio':>9}{'ns added':>10}")
    for api in LOOPS:
        for mode in MODES:
            ns = results[mode][api]
            print(f"{api:<18}{mode:<24}{1e9 / ns:>14,.0f}{ns:>10.1f}"
                  f"{base[api] / ns:>9.4f}{ns - base[api]:>10.0f}")
    for mode in ("sampled, in a span", "all, in a span"):
        r = results[mode]
        print(f"{mode}: {r['read']} records decoded, {r['dropped']} dropped (the reader thread polled throughout)")
    print(f"goal: <= 1000 ns added per launch inside a span, driver and runtime path, default settings; "
          f"wall time {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
