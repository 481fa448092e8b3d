"""An ASGI request's latency on uvicorn (uvloop, httptools) with FastAPI and its
OpenTelemetry instrumentation, with the spanlet processor and without it, side
by side in one run: the same server started each way in turn, the same
requests (CLIENTS keep-alive connections at once, each request awaiting
STEPS times on the loop), p50/p99 latency and requests per second.

No kernel uprobe is attached here (no root needed): the agent's uprobe adds
its own cost per mark (bench/uprobe_bench.py); a request on uvloop marks
twice per step that runs in its span.

Run: .venv/bin/python bench/asgi_bench.py [--requests N] [--clients C] [--steps S] [--rounds R]
"""

from __future__ import annotations

import argparse
import http.client
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

SERVER = r"""
import asyncio, os, sys
import uvicorn
from fastapi import FastAPI
from opentelemetry import trace
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

class Drop(SpanExporter):
    def export(self, spans):
        return SpanExportResult.SUCCESS

port, steps, spanlet = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "on"
provider = TracerProvider()
if spanlet:
    from spanlet import SpanletSpanProcessor
    provider.add_span_processor(SpanletSpanProcessor())
provider.add_span_processor(BatchSpanProcessor(Drop()))
trace.set_tracer_provider(provider)
app = FastAPI()

@app.get("/infer")
async def infer():
    for _ in range(steps):
        await asyncio.sleep(0)
    return {"ok": True}

FastAPIInstrumentor.instrument_app(app)
uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(spanlet: bool, steps: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(steps), "on" if spanlet else "off"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    sys.exit("the server did not start")


def cpu_s(pid: int) -> float:
    """User and system CPU seconds of `pid` so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load(port: int, requests: int, clients: int) -> tuple[list[float], float]:
    """Latencies (s) of `requests` GETs over `clients` keep-alive connections, and the wall time."""
    latencies: list[float] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        mine = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.request("GET", "/infer")
            c.getresponse().read()
            mine.append(time.perf_counter() - t0)
        c.close()
        with lock:
            latencies.extend(mine)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(requests // clients,)) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="awaits per request (default 4)")
    ap.add_argument("--rounds", type=int, default=3, help="server starts each way, alternating")
    args = ap.parse_args()
    runs = {"off": [], "on": []}
    cpu = {"off": [], "on": []}        # the server's CPU µs a request
    for _ in range(args.rounds):
        for way in ("off", "on"):
            proc, port = serve(way == "on", args.steps)
            try:
                load(port, args.requests // 4, args.clients)          # warm-up
                c0 = cpu_s(proc.pid)
                runs[way].append(load(port, args.requests, args.clients))
                cpu[way].append((cpu_s(proc.pid) - c0) / args.requests * 1e6)
            finally:
                proc.terminate()
                proc.wait(10)

    def figures(way: str) -> tuple[float, float, float]:
        p50 = statistics.median(statistics.median(lat) for lat, _ in runs[way])
        p99 = statistics.median(sorted(lat)[int(len(lat) * 0.99)] for lat, _ in runs[way])
        rps = statistics.median(len(lat) / wall for lat, wall in runs[way])
        return p50 * 1e6, p99 * 1e6, rps

    off, on = figures("off"), figures("on")
    print(f"ASGI requests on uvicorn + uvloop + FastAPI (OTel-instrumented), {args.clients} connections, "
          f"{args.steps} awaits a request; median of {args.rounds} server starts each way, alternating; "
          f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    c_off, c_on = statistics.median(cpu["off"]), statistics.median(cpu["on"])
    print(f"  {'':<28} {'p50 µs':>10} {'p99 µs':>10} {'req/s':>10} {'server CPU µs/req':>18}")
    print(f"  {'without spanlet':<28} {off[0]:10.1f} {off[1]:10.1f} {off[2]:10.0f} {c_off:18.1f}")
    print(f"  {'with SpanletSpanProcessor':<28} {on[0]:10.1f} {on[1]:10.1f} {on[2]:10.0f} {c_on:18.1f}")
    print(f"  {'added (with - without)':<28} {on[0] - off[0]:10.1f} {on[1] - off[1]:10.1f} "
          f"{on[2] / off[2]:9.3f}x {c_on - c_off:18.1f}")


if __name__ == "__main__":
    main()
