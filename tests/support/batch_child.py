"""The two processes of a batching server for the batched-steps tests and
benches, each an OTel SDK app exporting over OTLP/gRPC:

    batch_child.py ENDPOINT LIBCUDA front|engine

front: the front end. Its SERVER spans are the requests; each request's W3C
trace context is what it hands to the engine.
    open N        start N SERVER spans -> "req TRACE_HEX SPAN_HEX TRACEPARENT" each
    close         end every open one
    paced RATE SECONDS   RATE requests/s of a SERVER span each (benches) -> "paced N"
engine: the engine loop, with the spanlet processor, the stand-in libcuda loaded.
    step LAUNCHES SYNC_US TRACEPARENT:WEIGHT ...   one step span (spanlet.batch.step)
                  linked to those requests (WEIGHT "-": no weight attribute), LAUNCHES
                  launches and one cuStreamSynchronize of SYNC_US inside
                  -> "step TRACE_HEX SPAN_HEX LAUNCHES"
both:
    flush         force_flush the provider -> "flushed"
    exit          shut the provider down and exit
Every command but flush prints "done" at its end.
"""

import ctypes
import sys
import time

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

import child_loop
from spanlet import SpanletSpanProcessor, batch

endpoint, libcuda, role = sys.argv[1], sys.argv[2], sys.argv[3]
provider = TracerProvider(resource=Resource.create({"service.name": f"batch-{role}"}))
if role == "engine":
    cuda = ctypes.CDLL(libcuda)
    _launch = cuda.cuLaunchKernel
    _launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    _sync = cuda.cuStreamSynchronize
    _sync.argtypes = [ctypes.c_void_p]
    marker = SpanletSpanProcessor()
    provider.add_span_processor(marker)
    assert marker.active, "marker library not loaded"
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True),
                                               schedule_delay_millis=50))
tracer = provider.get_tracer(f"batch-{role}")
open_spans = []


def hexes(span) -> str:
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x} {ctx.span_id:016x}"


def open_requests(n: int) -> None:
    for i in range(n):
        s = tracer.start_span(f"POST /generate {i}", kind=trace.SpanKind.SERVER,
                              context=trace.set_span_in_context(trace.INVALID_SPAN))
        open_spans.append(s)
        print(f"req {hexes(s)} {batch.request_headers(s)['traceparent']}", flush=True)


def close() -> None:
    while open_spans:
        open_spans.pop(0).end()


def step(launches: int, sync_us: int, requests: list) -> None:
    reqs = []
    for item in requests:
        tp, _, w = item.rpartition(":")
        headers = {"traceparent": tp}
        reqs.append(headers if w == "-" else (headers, float(w)))
    with batch.step(tracer, reqs, context=trace.set_span_in_context(trace.INVALID_SPAN)) as s:
        for _ in range(launches):
            _launch(0xF00D, 1, 1, 1, 1, 1, 1, 0, 0, None, None)
        if sync_us:
            _sync(sync_us)
    print(f"step {hexes(s)} {launches}", flush=True)


def paced(rate: float, seconds: float) -> None:
    t0, done, total = time.monotonic(), 0, int(rate * seconds)
    while done < total:
        due = t0 + done / rate
        if due > time.monotonic():
            time.sleep(due - time.monotonic())
        tracer.start_span("POST /generate", kind=trace.SpanKind.SERVER).end()
        done += 1
    print(f"paced {done}", flush=True)


child_loop.serve(provider, {
    "open": lambda a: open_requests(int(a[0])),
    "close": lambda a: close(),
    "step": lambda a: step(int(a[0]), int(a[1]), a[2:]),
    "paced": lambda a: paced(float(a[0]), float(a[1])),
})
