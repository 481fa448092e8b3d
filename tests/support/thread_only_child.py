"""A serving process whose requests run on something spanlet follows per
thread only (for the thread-only kernel test). argv[1]: what to pretend to run
on: "gevent" (a gevent.monkey module that says it patched), "trio" (a trio
module whose current_task() answers, as inside a trio run) or "asyncio"
(nothing of the kind: every span followed per coroutine). On stdin: "span"
starts and ends one span -> "done"; "exit"."""

import os
import sys
import types

from opentelemetry.sdk.trace import TracerProvider

what = sys.argv[1]
if what == "gevent":
    monkey = types.ModuleType("gevent.monkey")
    monkey.is_anything_patched = lambda: True
    sys.modules["gevent"], sys.modules["gevent.monkey"] = types.ModuleType("gevent"), monkey
elif what == "trio":
    trio = types.ModuleType("trio")
    trio.lowlevel = types.SimpleNamespace(current_task=lambda: object())
    sys.modules["trio"] = trio

from spanlet import SpanletSpanProcessor  # noqa: E402

provider = TracerProvider()
provider.add_span_processor(SpanletSpanProcessor())
tracer = provider.get_tracer("thread-only-child")
print("ready", os.getpid(), flush=True)
for line in sys.stdin:
    if line.strip() == "span":
        with tracer.start_as_current_span("request"):
            pass
        print("done", flush=True)
    elif line.strip() == "exit":
        break
