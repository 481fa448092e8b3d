"""A plain OpenTelemetry app for the zero-code tests: the OTel API only, nothing
of spanlet named anywhere; run under `opentelemetry-instrument`, which makes its
tracer provider from OTEL_* settings. Each span launches a known number of
stand-in kernels (threads, like a serving process).

    plain_otel_app.py LIBCUDA THREADS SPANS [LINGER_S]
    prints "span TRACE_HEX SPAN_HEX N" per span (N: its launches), then "done";
    span j of thread t launches 1 + t*SPANS + j. LINGER_S: seconds to wait,
    libraries loaded, before the first span (the agent finds a new library in
    the maps of a process alive at its next discovery round: a run that ends
    within a fraction of a second may be gone by then).
"""

import ctypes
import sys
import threading
import time

from opentelemetry import trace

libcuda, t_count, spans = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
linger_s = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
launch_kernel = ctypes.CDLL(libcuda).cuLaunchKernel
launch_kernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
tracer = trace.get_tracer("plain-app")
out = threading.Lock()
barrier = threading.Barrier(t_count)


def worker(t: int) -> None:
    for j in range(spans):
        barrier.wait()    # the threads' spans overlap
        n = 1 + t * spans + j
        with tracer.start_as_current_span(f"t{t}-s{j}") as span:
            for _ in range(n):
                launch_kernel(0xF00D, 1, 1, 1, 1, 1, 1, 0, 0, None, None)
        ctx = span.get_span_context()
        with out:
            print(f"span {ctx.trace_id:032x} {ctx.span_id:016x} {n}", flush=True)


time.sleep(linger_s)
threads = [threading.Thread(target=worker, args=(t,)) for t in range(t_count)]
for th in threads:
    th.start()
for th in threads:
    th.join()
print("done", flush=True)
# the auto-instrumentation's provider exports what is left at exit (atexit shutdown)
