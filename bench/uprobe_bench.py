"""Cost of the GPU launch uprobes to the application, per launch inside a span:
calls per second of the stand-in cuLaunchKernel (and cudaLaunchKernel, which
reaches it) in a tight C loop, with no agent and with the span_ctx and GPU
programs in several settings (default: one entry-only driver uprobe), side by
side, and with an empty uprobe program on the driver's cuLaunchKernel where the
agent probes it (the trap alone, which no program goes below) and on its first
instruction (a RIP-relative compare in the driver's trampolines, which the
kernel single-steps: a second trap); the default entry program's own time a run
by BPF statistics (kernel.bpf_stats_enabled, on only for that pass: it adds its
own clock reads); then, with no agent, with the defaults (uprobe_multi links) and with a
perf-event uprobe per hook (gpu.uprobe_multi=false), every launch entry point and
a graph replay (cuGraphLaunch of a 7-kernel graph captured after the agent
attached).

Run as root: .venv/bin/python bench/uprobe_bench.py [--calls N] [--repeat R] [--no-entries]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

import cuda_standin  # noqa: E402
from spanlet import config, events  # noqa: E402
from spanlet.demo.standin import DRIVER  # noqa: E402
from spanlet.probes.gpu import ENTRY as ENTRY_PROGRAM, GpuProbe, probe_sites  # noqa: E402
from spanlet.probes.span_ctx import SpanCtxProbe  # noqa: E402

LOOPS = {"cuLaunchKernel": "bench", "cudaLaunchKernel": "benchrt"}
# label → config overrides (None: no agent at all)
TRAP_ONLY = "trap only"   # an empty program where the agent probes cuLaunchKernel: the trap's own cost
# the same on the function's first instruction, a RIP-relative compare in the
# driver's trampolines: run out of line and single-stepped, a second trap
# (where the agent probed before it went to the jump after the compare)
TRAP_AT_ENTRY = "trap at entry"
MODES = {
    "no agent": None,
    TRAP_ONLY: None,
    TRAP_AT_ENTRY: None,
    "default": [],
    "sampled": ["gpu.launch_events=sampled"],
    "timed+runtime": ["gpu.launch_timing=true", "gpu.runtime_hooks=true"],
    "all, timed+rt": ["gpu.launch_events=all", "gpu.launch_timing=true", "gpu.runtime_hooks=true"],
}
# Every launch entry point of the stand-ins, called straight (the runtime's
# reach their driver twin), and a graph replay.
ENTRIES = ["cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz",
           "cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel_ptsz", "cuLaunch", "cuLaunchGrid",
           "cuLaunchGridAsync", "cudaLaunchKernel", "cudaLaunchKernel_ptsz", "cudaLaunchKernelExC",
           "cudaLaunchKernelExC_ptsz", "cudaLaunchCooperativeKernel",
           "cudaLaunchCooperativeKernel_ptsz"]
GRAPH = "cuGraphLaunch (7 kernels)"
ENTRY_MODES = ("no agent", "default", "perf uprobes")
MODES_ALL = {**MODES, "perf uprobes": ["gpu.uprobe_multi=false"]}   # one perf-event uprobe per hook
TRACE_ID, SPAN_ID = bytes(range(1, 17)), 0x5EED


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


def graph_exec(w: cuda_standin.Workload) -> int:
    """A 7-kernel graph captured and instantiated now; its executable graph."""
    out = w.run("begin cuStreamBeginCapture_v2 0x5 0", "cuLaunchKernel 7 1 1 1 1 1 1 0 0x5",
                "end cuStreamEndCapture 0x5")
    (line,) = w.run(f"inst cuGraphInstantiateWithFlags {out[1].split()[2]}")
    return int(line.split()[2], 16)


def loops_of(entries: bool) -> dict[str, str]:
    """label → the workload command of its loop (without the count)."""
    if not entries:
        return dict(LOOPS)
    return {name: f"benchx {name}" for name in ENTRIES} | {GRAPH: "benchgraph cuGraphLaunch {exec}"}


def trap_only(w, standin, calls: dict[str, int], repeat: int, at_entry: bool) -> dict[str, float]:
    """ns per call of each loop with an empty program on the driver's
    cuLaunchKernel (which the runtime's cudaLaunchKernel reaches), at the
    agent's probe site or at the entry."""
    from bcc import BPF

    path = str(standin.lib_dir / DRIVER)
    (addr,) = {a for _, a in BPF.get_user_functions_and_addresses(path.encode(), b"^cuLaunchKernel$")}
    if not at_entry:
        ((_, addr),) = probe_sites(path, [(None, addr)])
    b = BPF(text="int spanlet_bench_empty(struct pt_regs *ctx) { return 0; }")
    try:
        b.attach_uprobe(name=path.encode(), addr=addr, fn_name="spanlet_bench_empty")
        return {label: ns_per_call(w, loop, calls[label], repeat) for label, loop in LOOPS.items()}
    finally:
        b.cleanup()


def bpf_prog_stats() -> dict[int, tuple[str, int, int]]:
    """id → (name, run_time_ns, run_cnt) of every loaded BPF program."""
    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True, timeout=30).stdout
    return {p["id"]: (p.get("name", ""), p.get("run_time_ns", 0), p.get("run_cnt", 0))
            for p in json.loads(out or "[]")}


def program_time(w, standin, calls: dict[str, int], repeat: int) -> dict[str, float]:
    """The default entry program's ns a run (gpu_entry, BPF statistics), by loop."""
    stats = Path("/proc/sys/kernel/bpf_stats_enabled")
    was = stats.read_text().strip()
    out: dict[str, float] = {}

    def run_loops() -> None:
        for label, loop in LOOPS.items():
            before = bpf_prog_stats()
            ns_per_call(w, loop, calls[label], repeat)
            after = bpf_prog_stats()
            runs = [(t - before[i][1], n - before[i][2]) for i, (name, t, n) in after.items()
                    if name == ENTRY_PROGRAM and i in before and n > before[i][2]]
            if runs:
                out[label] = sum(t for t, _ in runs) / sum(n for _, n in runs)

    stats.write_text("1")
    try:
        measure(w, standin, [], calls, 1, during=run_loops)
    finally:
        stats.write_text(was)
    return out


def measure(w, standin, overrides: list[str] | None, calls: dict[str, int],
            repeat: int, entries: bool = False, during=None) -> dict[str, float]:
    """ns per call of each loop, the workload's thread inside one span
    (`during`, if given, runs instead of the loops, the probes on)."""
    span = probe = reader = None
    if overrides is not None:
        cfg = config.load(env={}, overrides=overrides)
        span = SpanCtxProbe(cfg)
        if not span.start().attached:
            raise SystemExit(f"span_ctx did not attach: {span.status.reason}")
        probe = GpuProbe(cfg, sink=lambda ev: None)
        st = probe.start(pin_dir=span.shared_pin_dir())
        if not st.attached or not any(str(standin.lib_dir) in a for a in st.attachments):
            raise SystemExit(f"probe did not attach: {st.reason or st.failed_attachments}")
        span.set(w.tid, TRACE_ID, SPAN_ID, events.Modality.text)
        reader = Reader(probe)
    try:
        if during is not None:
            during()
            return {}
        loops = loops_of(entries)
        if entries:
            loops[GRAPH] = loops[GRAPH].format(exec=f"{graph_exec(w):#x}")
        out = {label: ns_per_call(w, loop, calls[label], repeat) for label, loop in loops.items()}
        if probe is not None:
            probe.drain()
            out["dropped"] = probe.events_dropped()
            out["read"] = probe.events_read
            row = span.facts.take(TRACE_ID, SPAN_ID)
            out["row_launches"] = row.launches if row else 0
            out["row_graph"] = (row.graph_launches, row.graph_kernels) if row else (0, 0)
        return out
    finally:
        if reader:
            reader.close()
        for p in (probe, span):
            if p:
                p.stop()


def foreign_probes(lib_dir: Path) -> int:
    """Uprobes that other processes (another agent on the machine) hold on the
    bench's own library files: they are in every figure, "no agent" too."""
    try:
        out = subprocess.run(["bpftool", "-j", "perf"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for p in json.loads(out or "[]")
               if p.get("pid") != os.getpid() and str(lib_dir) in p.get("filename", ""))


def table(results: dict, labels, modes, width: int = 34) -> None:
    base = results["no agent"]
    print(f"{'call':<{width}}{'setting':<17}{'calls/s':>14}{'ns/call':>10}{'ratio':>9}{'ns added':>10}")
    for label in labels:
        for mode in modes:
            ns = results[mode][label]
            print(f"{label:<{width}}{mode:<17}{1e9 / ns:>14,.0f}{ns:>10.1f}"
                  f"{base[label] / ns:>9.4f}{ns - base[label]:>10.0f}")


def print_main(results: dict, args: argparse.Namespace, expected: int) -> None:
    print(f"GPU launch uprobe cost, stand-in libraries, median of {args.repeat} runs "
          f"({args.calls} driver / {args.runtime_calls} runtime calls each)")
    print("every call inside one span; ratio: calls/s with the agent over calls/s without")
    table(results, LOOPS, MODES, 18)
    for mode, overrides in MODES.items():
        if overrides is None:
            continue
        r = results[mode]
        print(f"{mode}: span row {r['row_launches']} launches of {expected} made; "
              f"{r['read']} records decoded, {r['dropped']} dropped")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000, help="cuLaunchKernel calls per run")
    ap.add_argument("--runtime-calls", type=int, default=40_000, help="cudaLaunchKernel calls per run")
    ap.add_argument("--entry-calls", type=int, default=50_000,
                    help="calls per run of each entry point in the second table")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-entries", action="store_true", help="skip the per-entry-point table")
    ap.add_argument("--only-entries", action="store_true", help="only the per-entry-point table")
    args = ap.parse_args()
    calls = {"cuLaunchKernel": args.calls, "cudaLaunchKernel": args.runtime_calls}
    entry_calls = {label: args.entry_calls for label in loops_of(True)}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="spanlet-uprobe-bench-") as tmp:
        standin = cuda_standin.build(Path(tmp))
        with cuda_standin.Workload(standin.workload) as w:
            w.load(standin.lib_dir)
            ns_per_call(w, "bench", 10_000, 1)  # warm up (page faults, PLT binding)
            results = {} if args.only_entries else {
                mode: trap_only(w, standin, calls, args.repeat, mode == TRAP_AT_ENTRY)
                if mode in (TRAP_ONLY, TRAP_AT_ENTRY)
                else measure(w, standin, overrides, calls, args.repeat)
                for mode, overrides in MODES.items()}
            prog_ns = {} if args.only_entries else program_time(w, standin, calls, args.repeat)
            per_entry = {} if args.no_entries else {
                mode: measure(w, standin, MODES_ALL[mode], entry_calls, args.repeat, entries=True)
                for mode in ENTRY_MODES}
            foreign = foreign_probes(standin.lib_dir)
            expected = args.repeat * sum(calls.values())
    if foreign:
        print(f"WARNING: {foreign} uprobes of other processes were on the bench's libraries at "
              "the end (another agent on this machine): every figure includes their cost")
    if results:
        print_main(results, args, expected)
        print("the default entry program's own time a run (BPF statistics, which add their own "
              "clock reads): " + ", ".join(f"{label} {ns:.0f} ns" for label, ns in prog_ns.items()))
    if per_entry:
        print(f"\nevery entry point, {args.entry_calls} calls each, defaults (uprobe_multi links) and "
              "perf-event uprobes against no agent")
        table(per_entry, loops_of(True), ENTRY_MODES)
        r = per_entry["default"]
        n = args.repeat * args.entry_calls
        print(f"default: span row {r['row_launches']} launches of {n * len(ENTRIES)} made; "
              f"graph launches, kernels {r['row_graph']} of {(n, 7 * n)}")
    print(f"goal: <= 1000 ns added per launch (each entry point) and per graph replay; "
          f"wall time {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
