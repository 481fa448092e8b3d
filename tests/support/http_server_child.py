"""An instrumented HTTP/1.1 server for the network-join test: its listening
socket lives in a test network namespace, its spans go over OTLP to the agent
on this host's loopback. Serves REQUESTS requests on one keep-alive
connection: each gets a SERVER span whose parent comes from the request's
traceparent, and a body of RESPONSE_BYTES. The connection stays open; on
"flush" from stdin the spans are exported and "flushed" printed.

argv: NETNS ADDRESS PORT OTLP_ENDPOINT RESPONSE_BYTES REQUESTS
"""

import sys


from netns import inside  # noqa: E402
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # noqa: E402

import socket  # noqa: E402

ns, address, port, endpoint, response_bytes, requests = sys.argv[1:7]
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
tracer = provider.get_tracer("http-child")
with inside(ns):
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((address, int(port)))
    srv.listen(1)
print("listening", flush=True)
conn, _ = srv.accept()
buf = b""
body = b"x" * int(response_bytes)
for _ in range(int(requests)):
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
    if b"\r\n\r\n" not in buf:
        break
    head, buf = buf.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(buf) < length:
        buf += conn.recv(65536)
    buf = buf[length:]
    ctx = TraceContextTextMapPropagator().extract(headers)
    with tracer.start_as_current_span("handle", context=ctx, kind=SpanKind.SERVER) as span:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
    print(f"served {span.get_span_context().span_id:016x}", flush=True)
for line in sys.stdin:
    if line.strip() == "flush":
        provider.force_flush()
        print("flushed", flush=True)
        break
provider.shutdown()
conn.close()
