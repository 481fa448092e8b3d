"""The client of the zero-code WSGI test: urllib3, instrumented by the real
opentelemetry-instrumentation-urllib3 under `opentelemetry-instrument` (which
puts the traceparent on each request); nothing of spanlet named. Sends one
POST per argument on one keep-alive connection, inside a root span of its own.

argv: URL BODY_BYTES N...; prints "trace TRACE_HEX", then "done".
"""

import sys

import urllib3
from opentelemetry import trace

url, size, counts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
pool = urllib3.PoolManager(maxsize=1)
with trace.get_tracer("client").start_as_current_span("client-root") as root:
    for n in counts:
        r = pool.request("POST", f"{url}/infer/{n}", body=b"p" * size,
                         headers={"Content-Type": "image/png"})
        assert r.status == 200 and len(r.data) > 0
print(f"trace {root.get_span_context().trace_id:032x}", flush=True)
print("done", flush=True)
