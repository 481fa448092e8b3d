"""Device check of the GPU probe on a machine with an NVIDIA GPU and PyTorch
(never part of the test suite; run as root): eager matmuls and elementwise
ops, a torch.compile (Triton) function, and a CUDA graph capture and replay,
each inside its own span with the spanlet span processor, and side by side per
span: spanlet's launches, graph launches and graph kernels against
torch.profiler's count of CUDA kernels for the same region, spanlet's sync
wait against the wall time of the syncs, then the NVML metrics against
nvidia-smi. With --costs, instead: what the probes add to the host time of a
launch, a graph replay and a synchronize (loops timed with the agent attached
and not, alternating, in a process without torch.profiler).

    sudo .venv/bin/python bench/gpu_check.py [--iters N] [--replays R] [--no-compile] [--json]
    sudo .venv/bin/python bench/gpu_check.py --costs [--calls N] [--rounds R]

The agent's span_ctx and GPU probes run in this process, with the default GPU
settings (one entry-only uprobe per driver launch) unless --set says
otherwise; each span's facts row is taken from the kernel's span facts map when
the span ends, as the join takes it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass
class Region:
    name: str
    launches: int = 0              # spanlet, the span's row
    graph_launches: int = 0
    graph_kernels: int = 0
    syncs: int = 0
    sync_wait_ms: float = 0.0
    profiler_kernels: int = 0      # torch.profiler: CUDA kernel activities in the region
    sync_wall_ms: float = 0.0      # this script's clock around its own syncs
    notes: list[str] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--iters", type=int, default=20, help="ops per eager region (default 20)")
    ap.add_argument("--replays", type=int, default=10, help="graph replays (default 10)")
    ap.add_argument("--size", type=int, default=1024, help="matrix side (default 1024)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile region")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="agent config override, e.g. gpu.runtime_hooks=true (repeatable)")
    ap.add_argument("--costs", action="store_true",
                    help="only the cost table: host time per call with the agent attached and "
                         "not, alternating, in a process that never starts torch.profiler "
                         "(its CUPTI callbacks stay on after it stops and slow every launch)")
    ap.add_argument("--calls", type=int, default=20000, help="calls per timed loop (default 20000)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="cost table: attached rounds, each between two unattached ones (default 2)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    return ap.parse_args(argv)


class Agent:
    """The span_ctx and GPU probes of one agent, in this process."""

    def __init__(self, overrides: list[str]):
        from spanlet import config
        from spanlet.probes.gpu import GpuProbe
        from spanlet.probes.span_ctx import SpanCtxProbe

        cfg = config.load(env={}, overrides=overrides)
        self.span = SpanCtxProbe(cfg)
        if not self.span.start().attached:
            raise SystemExit(f"span_ctx did not attach: {self.span.status.reason}")
        self.gpu = GpuProbe(cfg)
        st = self.gpu.start(pin_dir=self.span.shared_pin_dir())
        if not st.attached:
            raise SystemExit(f"gpu_launch did not attach: {st.reason}")

    def attached(self) -> list[str]:
        """Libraries of this process the GPU probe hooked (refreshed first)."""
        self.span.refresh()
        self.gpu.refresh()
        return [f"{a.path}: {len(a.symbols)} symbols" + (f", missing {a.missing}" if a.missing else "")
                for a in self.gpu.libraries() if a.pid == os.getpid()]

    def take(self, otel_span, region: Region) -> None:
        ctx = otel_span.get_span_context()
        row = self.span.facts.take(ctx.trace_id.to_bytes(16, "big"), ctx.span_id)
        if row is None:
            region.notes.append("no facts row (nothing counted in this span)")
            return
        region.launches, region.graph_launches = row.launches, row.graph_launches
        region.graph_kernels, region.syncs = row.graph_kernels, row.syncs
        region.sync_wait_ms = row.sync_wait_ns / 1e6

    def stop(self) -> None:
        self.gpu.stop()
        self.span.stop()


def profiler_kernels(prof) -> int:
    """CUDA kernel activities torch.profiler recorded (memcpy/memset left out)."""
    import torch

    n = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower() \
                and "memset" not in e.name.lower():
            n += 1
    return n


def regions(args: argparse.Namespace):
    """(name, setup, body) per region: setup runs outside any span (warm-up,
    compilation), body inside the region's span."""
    import torch

    dev = torch.device("cuda")
    a = torch.randn(args.size, args.size, device=dev)
    b = torch.randn(args.size, args.size, device=dev)

    def eager_matmul():
        for _ in range(args.iters):
            a @ b

    def eager_elementwise():
        x = a
        for _ in range(args.iters):
            x = torch.relu(x * b + 1.0)

    out = [("eager matmul", None, eager_matmul), ("eager elementwise", None, eager_elementwise)]

    if not args.no_compile:
        fn = torch.compile(lambda x, y: (x.sin() * y.cos()).sum(dim=-1) + 1.0)

        def compiled():
            for _ in range(args.iters):
                fn(a, b)
        out.append(("torch.compile (Triton)", compiled, compiled))

    static_in = torch.randn(args.size, args.size, device=dev)
    graph = torch.cuda.CUDAGraph()
    holder = {}

    def step(x):
        return torch.relu(x @ b + 1.0) * 2.0

    def warm_up():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step(static_in)
        torch.cuda.current_stream().wait_stream(s)

    def capture():
        with torch.cuda.graph(graph):
            holder["out"] = step(static_in)

    def replay():
        for _ in range(args.replays):
            graph.replay()

    out.append(("CUDA graph capture", warm_up, capture))
    out.append(("CUDA graph replay", None, replay))
    return out


def run_region(agent: Agent, tracer, name: str, setup, body) -> Region:
    import torch
    from torch.profiler import ProfilerActivity, profile

    if setup is not None:
        setup()
        torch.cuda.synchronize()
    r = Region(name)
    with tracer.start_as_current_span(name) as span:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            body()
            t0 = time.perf_counter()
            torch.cuda.synchronize()
            r.sync_wall_ms = (time.perf_counter() - t0) * 1e3
    agent.take(span, r)
    r.profiler_kernels = profiler_kernels(prof)
    return r


def call_costs(tracer, calls: int, rounds: int = 3) -> dict[str, float]:
    """Host time per call (ns, the median of `rounds` loops of `calls`) of a
    one-launch op, a one-kernel graph replay and an idle-GPU synchronize, in a
    span: what the probes add to each is the difference between this taken
    with the agent attached and without."""
    import torch

    x = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1.0)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        x.add_(1.0)
    ops = {"launch (x.add_)": lambda: x.add_(1.0), "graph replay": graph.replay,
           "synchronize": torch.cuda.synchronize}
    out = {}
    with tracer.start_as_current_span("call costs"):
        for name, op in ops.items():
            times = []
            for _ in range(rounds):
                for _ in range(min(calls, 500)):
                    op()
                torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                for _ in range(calls):
                    op()
                torch.cuda.synchronize()
                times.append((time.perf_counter_ns() - t0) / calls)
            out[name] = sorted(times)[rounds // 2]
    return out


def costs(args: argparse.Namespace, tracer) -> None:
    """The cost table: unattached and attached loops alternating (a fresh
    agent each time), medians side by side."""
    off, on = [call_costs(tracer, args.calls)], []
    for _ in range(args.rounds):
        agent = Agent(args.set)
        try:
            on.append(call_costs(tracer, args.calls))
        finally:
            agent.stop()
        off.append(call_costs(tracer, args.calls))
    print(f"{'host ns per call':<20}{'not attached':>14}{'attached':>10}{'added':>9}{'ratio':>8}   each run")
    for name in on[0]:
        base = statistics.median(r[name] for r in off)
        with_agent = statistics.median(r[name] for r in on)
        runs = " ".join(f"{r[name]:.0f}" for pair in zip(off, on + [None]) for r in pair if r)
        print(f"{name:<20}{base:>14.0f}{with_agent:>10.0f}{with_agent - base:>9.0f}"
              f"{with_agent / base:>8.3f}   {runs}")
    print("medians of the runs (unattached first, alternating); a launch is one entry-only "
          "uprobe, a replay one, a synchronize an entry and a return probe")


def nvidia_smi() -> list[dict]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    q = "uuid,utilization.gpu,memory.used,memory.total"
    out = subprocess.run([smi, f"--query-gpu={q}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    rows = []
    for line in out.strip().splitlines():
        uuid, util, used, total = (v.strip() for v in line.split(","))
        rows.append({"gpu": uuid, "sm_utilization_ratio": float(util) / 100,
                     "memory_used_bytes": int(float(used)) << 20,
                     "memory_total_bytes": int(float(total)) << 20})
    return rows


def nvml_vs_smi() -> list[tuple[str, str, object, object]]:
    from spanlet.nvml import NvmlPoller

    poller = NvmlPoller()
    st = poller.open()
    if not st.available:
        return [("-", "nvml", f"unavailable: {st.reason}", "")]
    poller.poll_once()
    ours = poller.snapshot()
    out = []
    for row in nvidia_smi():
        s = ours.get(row["gpu"])
        for key in ("sm_utilization_ratio", "memory_used_bytes", "memory_total_bytes"):
            out.append((row["gpu"], key, getattr(s, key, None) if s else None, row[key]))
    return out


def print_table(results: list[Region]) -> None:
    head = (f"{'region':<24}{'launches':>9}{'graph_l':>8}{'graph_k':>8}{'sum':>7}"
            f"{'profiler':>9}{'syncs':>6}{'wait ms':>9}{'wall ms':>9}")
    print(head)
    for r in results:
        total = r.launches + r.graph_kernels
        print(f"{r.name:<24}{r.launches:>9}{r.graph_launches:>8}{r.graph_kernels:>8}{total:>7}"
              f"{r.profiler_kernels:>9}{r.syncs:>6}{r.sync_wait_ms:>9.2f}{r.sync_wall_ms:>9.2f}"
              + ("  " + "; ".join(r.notes) if r.notes else ""))
    print("sum = launches + graph kernels, to compare with the profiler's kernels; spanlet counts "
          "launch calls (memset/memcpy kernels of the profiler left out), the capture region's "
          "launches are recorded, not run (0 expected on both sides); syncs: the region's "
          "torch.cuda.synchronize and the profiler's own when it stops, both in the span "
          "(wall ms times the first alone)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        raise SystemExit("gpu_check needs PyTorch (pip install torch)")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA GPU (torch.cuda.is_available() is false)")
    from opentelemetry.sdk.trace import TracerProvider

    from spanlet import SpanletSpanProcessor

    torch.ones(1, device="cuda").sum().item()   # libcuda mapped before the probes attach
    provider = TracerProvider()
    provider.add_span_processor(SpanletSpanProcessor())   # the marker mapped before they attach
    tracer = provider.get_tracer("spanlet.gpu_check")
    if args.costs:
        costs(args, tracer)
        return 0
    agent = Agent(args.set)
    try:
        print("hooked:", *agent.attached(), sep="\n  ")
        results = [run_region(agent, tracer, *r) for r in regions(args)]
    finally:
        agent.stop()
    print_table(results)
    print(f"\n{'gpu':<42}{'value':<22}{'spanlet (NVML)':>18}{'nvidia-smi':>16}")
    for gpu, key, ours, smi in nvml_vs_smi():
        print(f"{gpu:<42}{key:<22}{str(ours):>18}{str(smi):>16}")
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
