"""A serving process for the span-join tests: the real OpenTelemetry SDK with
the spanlet processor, exporting over OTLP gRPC to the agent, and kernel
launches through the stand-in libcuda. Driven on stdin:

    ready PID                      printed once both libraries are loaded
    work THREADS SPANS             each thread runs SPANS spans; span j of thread t
                                   launches 10*t + j + 1 kernels and syncs (t+1)*2000 µs
    flush                          export everything, print "flushed"
    exit
For each span it prints "span SPAN_ID_HEX LAUNCHES SYNC_US SYNC_NS_MEASURED" (the
last: the sync call as timed around it in this process, an upper bound).
"""

import ctypes
import sys
import threading
import time

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from spanlet import SpanletSpanProcessor

endpoint, libcuda = sys.argv[1], sys.argv[2]
cuda = ctypes.CDLL(libcuda)
launch = cuda.cuLaunchKernel
launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
sync = cuda.cuStreamSynchronize
sync.argtypes = [ctypes.c_void_p]

provider = TracerProvider(resource=Resource.create({"service.name": "span-child"}))
marker = SpanletSpanProcessor()
provider.add_span_processor(marker)
# a long delay: spans leave only on "flush", after the test saw their events
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True),
                                               schedule_delay_millis=600_000))
tracer = provider.get_tracer("span-child")
out_lock = threading.Lock()


def worker(t: int, spans: int, barrier: threading.Barrier) -> None:
    for j in range(spans):
        barrier.wait()  # interleave the threads' spans
        n, sync_us = 10 * t + j + 1, (t + 1) * 2000
        with tracer.start_as_current_span(f"t{t}-s{j}", attributes={"mm.modality": "image"}) as s:
            for _ in range(n):
                launch(0xF00D, 1, 1, 1, 1, 1, 1, 0, 0, None, None)
            t0 = time.monotonic_ns()
            sync(sync_us)
            took = time.monotonic_ns() - t0
        with out_lock:
            print(f"span {s.get_span_context().span_id:016x} {n} {sync_us} {took}", flush=True)


assert marker.active, "marker library not loaded"
print(f"ready {__import__('os').getpid()}", flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "work":
        threads, spans = int(cmd[1]), int(cmd[2])
        barrier = threading.Barrier(threads)
        ts = [threading.Thread(target=worker, args=(t, spans, barrier)) for t in range(threads)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        print("worked", flush=True)
    elif cmd[0] == "flush":
        provider.force_flush()
        print("flushed", flush=True)
    elif cmd[0] == "exit":
        break
provider.shutdown()
