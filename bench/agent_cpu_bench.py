"""Agent CPU at 1,000 spans/s and 50,000 kernel events/s, as a share of one
core, side by side with the same agent idle: `spanlet run` in its own process,
a stand-in CUDA workload launching at a paced rate, and an OTLP client sending
spans in batches of 100. Three agent settings: launch_events=off (the
default: launches are counted in the kernel, per span in the span facts
map), sampled (a few records per span) and all (every launch is a
ring-buffer record decoded in Python).
CPU is read from /proc/<agent>/stat.

    sudo .venv/bin/python bench/agent_cpu_bench.py [--seconds 10]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support")]

import grpc  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc  # noqa: E402

import cuda_standin  # noqa: E402
from common import Agent, cpu_s, spans_request  # noqa: E402
from processes import free_port, stop_process  # noqa: E402


def send_spans(port: int, per_s: int, seconds: float, stop: threading.Event) -> int:
    stub = trace_service_pb2_grpc.TraceServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    rnd, sent, t0 = random.Random(1), 0, time.monotonic()
    batch = 100
    while not stop.is_set() and time.monotonic() - t0 < seconds:
        stub.Export(spans_request(batch, rnd, "bench", "text"))
        sent += batch
        ahead = sent / per_s - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)
    return sent


def measure(pid: int, seconds: float) -> float:
    c0, t0 = cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_s(pid) - c0) / (time.monotonic() - t0)


def run_once(a, mode: str, standin) -> tuple[float, float, int]:
    grpc_port, http_port = free_port(), free_port()
    with cuda_standin.Workload(standin.workload) as w:
        w.load(standin.lib_dir)
        agent = Agent(["tc.enabled=false", "sandbox.enabled=false", "store.enabled=false",
                       f"gpu.launch_events={mode}",
                       f"otlp.grpc_port={grpc_port}", f"otlp.http_port={free_port()}",
                       f"http_port={http_port}", "http_address=127.0.0.1"])
        try:
            if not agent.wait_running():
                raise SystemExit("the agent did not start:\n" + "".join(agent.tail))
            time.sleep(1)
            idle = measure(agent.proc.pid, a.seconds)
            stop = threading.Event()
            sent = [0]
            t = threading.Thread(target=lambda: sent.__setitem__(
                0, send_spans(grpc_port, a.spans, a.seconds + 1, stop)))
            t.start()
            n = int(a.events * (a.seconds + 1))
            w.send(f"paced {n} {a.events}", "go")
            time.sleep(0.5)
            loaded = measure(agent.proc.pid, a.seconds)
            w.until("done")
            stop.set()
            t.join()
        finally:
            stop_process(agent.proc, 15)
    return idle, loaded, sent[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--spans", type=int, default=1000)
    ap.add_argument("--events", type=int, default=50_000)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="spanlet-cpu-bench-") as tmp:
        standin = cuda_standin.build(Path(tmp))
        for mode in ("off", "sampled", "all"):
            rows.append((mode, *run_once(a, mode, standin)))
    print(f"agent CPU as a share of one core, {a.seconds:.0f} s each, "
          f"{a.spans:,} spans/s + {a.events:,} GPU launches/s:")
    for mode, idle, loaded, sent in rows:
        print(f"  launch_events={mode:8s} idle {idle:6.1%}  loaded {loaded:6.1%}  "
              f"(+{loaded - idle:.1%}; spans sent {sent:,})")
    print("goal: <= 3% of one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
