"""An ASGI model server for the per-coroutine tests: FastAPI under uvicorn on
uvloop (httptools), as `pip install 'uvicorn[standard]'` runs it, nothing of
spanlet named in "zero-code" mode (run under `opentelemetry-instrument`,
whose FastAPI instrumentation makes the server spans); in "explicit" mode the
app makes its tracer provider with the spanlet processor and instruments
itself with FastAPIInstrumentor.

GET /infer/N?together=K: the request waits until K requests are in (so that
they interleave on the one event loop), then launches N stand-in kernels, one
per step, awaiting between them; prints "served TRACE_HEX SPAN_HEX N" with its
server span. FLOOD=1: a thread launches kernels outside any span all along.
On stdin "flush" force-flushes the tracer provider and prints "flushed".

argv: MODE PORT LIBCUDA; prints "listening PORT".
"""

import asyncio
import ctypes
import os
import sys
import threading
import time

import uvicorn
from fastapi import FastAPI
from opentelemetry import trace

mode, port, libcuda = sys.argv[1], int(sys.argv[2]), sys.argv[3]
launch_kernel = ctypes.CDLL(libcuda).cuLaunchKernel
launch_kernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
app = FastAPI()
if mode == "explicit":
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from spanlet import SpanletSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": os.environ["OTEL_SERVICE_NAME"]}))
    provider.add_span_processor(SpanletSpanProcessor())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), schedule_delay_millis=50))
    trace.set_tracer_provider(provider)
    FastAPIInstrumentor.instrument_app(app)

arrived: dict[int, int] = {}
together_event: dict[int, asyncio.Event] = {}


@app.get("/infer/{n}")
async def infer(n: int, together: int = 1, round: int = 0):
    arrived[round] = arrived.get(round, 0) + 1
    event = together_event.setdefault(round, asyncio.Event())
    if arrived[round] >= together:
        event.set()
    await asyncio.wait_for(event.wait(), 30)
    for _ in range(n):
        launch_kernel(0xF00D, 1, 1, 1, 1, 1, 1, 0, 0, None, None)
        await asyncio.sleep(0)
    ctx = trace.get_current_span().get_span_context()
    print(f"served {ctx.trace_id:032x} {ctx.span_id:016x} {n}", flush=True)
    return {"launches": n}


def flood() -> None:
    while True:
        for _ in range(20):
            launch_kernel(0xF00D, 1, 1, 1, 1, 1, 1, 0, 0, None, None)
        time.sleep(0.001)


def stdin_commands() -> None:
    for line in sys.stdin:
        if line.strip() == "flush":
            trace.get_tracer_provider().force_flush()
            print("flushed", flush=True)


if os.environ.get("FLOOD") == "1":
    threading.Thread(target=flood, daemon=True, name="flood").start()
threading.Thread(target=stdin_commands, daemon=True).start()
print(f"listening {port}", flush=True)
uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning")
