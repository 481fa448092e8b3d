"""A serving process for the request totals' end-to-end test: the real OTel SDK
with the spanlet processor, exporting OTLP/gRPC to the agent. On "request" a
request: a SERVER span (as an HTTP server's instrumentation makes it) whose
two INTERNAL children each spin CHILD_MS of CPU time, the server span itself
SERVER_MS; prints "request TRACE_HEX SPAN_HEX". On "flush" the spans go out
now; prints "flushed".

argv: LIBSPIN ENDPOINT CHILD_MS SERVER_MS; prints "ready" first.
"""

import ctypes
import sys

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind

from spanlet import SpanletSpanProcessor

spin = ctypes.CDLL(sys.argv[1]).spin_cpu_ns
spin.argtypes = [ctypes.c_longlong]
endpoint, child_ns, server_ns = sys.argv[2], int(sys.argv[3]) * 1_000_000, int(sys.argv[4]) * 1_000_000
provider = TracerProvider(resource=Resource.create({"service.name": "request-tree"}))
provider.add_span_processor(SpanletSpanProcessor())
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True),
                                               schedule_delay_millis=50))
tracer = provider.get_tracer("request-tree")


def one_request() -> None:
    with tracer.start_as_current_span("POST /infer", kind=SpanKind.SERVER,
                                      attributes={"mm.modality": "text", "slo.class": "gold"}) as server:
        spin(server_ns)
        for step in ("tokenize", "generate"):
            with tracer.start_as_current_span(step):
                spin(child_ns)
    ctx = server.get_span_context()
    print(f"request {ctx.trace_id:032x} {ctx.span_id:016x}", flush=True)


print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "request":
        one_request()
    elif line.strip() == "flush":
        provider.force_flush()
        print("flushed", flush=True)
