"""A process with the spanlet processor that holds spans open for the OTel
shared context map test. On stdin: "open" starts a span and makes it current
in the main thread -> "span PID TID TRACE_HEX SPAN_HEX"; "close" ends it ->
"closed"; "exit"."""

import os
import sys
import threading

from opentelemetry.sdk.trace import TracerProvider

from spanlet import SpanletSpanProcessor

provider = TracerProvider()
provider.add_span_processor(SpanletSpanProcessor())
tracer = provider.get_tracer("otel-map-child")
print("ready", os.getpid(), flush=True)
cm = None
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "open":
        cm = tracer.start_as_current_span("held")
        span = cm.__enter__()
        ctx = span.get_span_context()
        print(f"span {os.getpid()} {threading.get_native_id()} {ctx.trace_id:032x} "
              f"{ctx.span_id:016x}", flush=True)
    elif cmd == "close":
        cm.__exit__(None, None, None)
        print("closed", flush=True)
    elif cmd == "exit":
        break
