"""A WSGI model server for the zero-code tests: wsgiref behind the real
OpenTelemetry WSGI instrumentation (opentelemetry-instrumentation-wsgi), nothing
of spanlet named; run under `opentelemetry-instrument`. Its listening socket
lives in a test network namespace; its spans go over OTLP to the agent on this
host's loopback (OTEL_EXPORTER_OTLP_* settings). POST /infer/N launches N
stand-in kernels and answers RESPONSE_BYTES; "flush" on stdin force-flushes
the tracer provider and prints "flushed".

argv: NETNS ADDRESS PORT LIBCUDA RESPONSE_BYTES; prints "listening", then
"served SPAN_HEX N" per request.
"""

import contextlib
import ctypes
import os
import sys
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from opentelemetry import trace
from opentelemetry.instrumentation.wsgi import OpenTelemetryMiddleware

ns, address, port, libcuda, response_bytes = sys.argv[1:6]
launch_kernel = ctypes.CDLL(libcuda).cuLaunchKernel
launch_kernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
body = b"x" * int(response_bytes)


def app(environ, start_response):
    n = int(environ["PATH_INFO"].rsplit("/", 1)[1])
    environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
    for _ in range(n):
        launch_kernel(0xF00D, 1, 1, 1, 1, 1, 1, 0, 0, None, None)
    span = trace.get_current_span().get_span_context()
    print(f"served {span.span_id:016x} {n}", flush=True)
    start_response("200 OK", [("Content-Type", "application/octet-stream"),
                              ("Content-Length", str(len(body)))])
    return [body]


@contextlib.contextmanager
def inside(netns: str):
    """This thread in network namespace `netns` (sockets made there stay there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    here = os.open("/proc/self/ns/net", os.O_RDONLY)
    there = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(there, 0x40000000) != 0:       # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns {netns}")
        yield
    finally:
        libc.setns(here, 0x40000000)
        os.close(here)
        os.close(there)


class Handler(WSGIRequestHandler):
    protocol_version = "HTTP/1.1"     # keep-alive: the requests share one connection

    def log_message(self, *args):
        pass


with inside(ns):
    httpd = make_server(address, int(port), OpenTelemetryMiddleware(app), handler_class=Handler)
threading.Thread(target=httpd.serve_forever, daemon=True).start()
print("listening", flush=True)
for line in sys.stdin:
    if line.strip() == "flush":
        trace.get_tracer_provider().force_flush()
        print("flushed", flush=True)
