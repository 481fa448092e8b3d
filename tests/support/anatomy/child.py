"""A serving process for the request-anatomy tests: the real OTel SDK with the
spanlet processor (the production marker, uprobed by the test's agent).

    child.py LIBSPIN threads CPU THREADS SPANS CPU_MS SLEEP_MS PIPE_MS [LIBCUDA]
        THREADS threads pinned to CPU, each running SPANS spans: in each, spin
        CPU_MS of its own CPU time (C, the GIL let go), sleep SLEEP_MS, read a
        pipe that another thread writes PIPE_MS later and, with LIBCUDA (a
        libcuda shaped like the real one), copy to and from the device
        (cuMemcpyHtoD_v2, cuMemcpyDtoH_v2: bytes distinct per thread and
        span). Per span prints "span TRACE SPAN", twice RUN_NS WAIT_NS WALL_NS
        SWITCHES INVOLUNTARY, then H2D_BYTES D2H_BYTES: the thread's own CPU
        time (CLOCK_THREAD_CPUTIME_ID: schedstat's run field lags up to a tick
        for a running thread), its /proc/thread-self/schedstat wait (run
        queue), its monotonic time and its context switches
        (/proc/thread-self/status), read just inside the span's edges, then
        just outside them: the span's own figures lie between the two (equal
        where nothing ran between a mark and a read); then the bytes it copied
        each way (0 without LIBCUDA), the monotonic times of the two
        outside readings (when the span's edges were, give or take), and the
        throttled time that the cgroup's cpu.stat gained between the two
        inside readings, with SPANLET_TEST_CPU_STAT naming that cpu.stat (0
        without): the throttling of the span's own time, and nothing that the
        process ran outside its spans (its exit, say).
    child.py LIBSPIN coroutines LOOP TASKS STEPS STEP_MS
        TASKS coroutines on one asyncio or uvloop loop, each in its span,
        each step spinning STEP_MS of CPU; per span prints
        "span TRACE SPAN CPU_NS START END": the thread CPU time of its own
        steps, and the monotonic times just outside the span's edges.
Then "done".
"""

import asyncio
import ctypes
import os
import sys
import threading
import time

from opentelemetry.sdk.trace import TracerProvider
from spanlet import SpanletSpanProcessor

spin = ctypes.CDLL(sys.argv[1]).spin_cpu_ns
spin.argtypes = [ctypes.c_longlong]
provider = TracerProvider()
provider.add_span_processor(SpanletSpanProcessor())
tracer = provider.get_tracer("anatomy")
out = threading.Lock()
MS = 1_000_000


def schedstat() -> tuple[int, int]:
    """(CPU ns, run-queue wait ns) of the calling thread so far."""
    with open("/proc/thread-self/schedstat") as f:
        wait = int(f.read().split()[1])
    return time.thread_time_ns(), wait


def switches() -> tuple[int, int]:
    """(all, involuntary) context switches of the calling thread so far."""
    with open("/proc/thread-self/status") as f:
        kv = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
    vol, inv = int(kv["voluntary_ctxt_switches"]), int(kv["nonvoluntary_ctxt_switches"])
    return vol + inv, inv


CPU_STAT = os.environ.get("SPANLET_TEST_CPU_STAT")


def throttled_ns() -> int:
    """The throttled time in the cgroup's cpu.stat (v2 throttled_usec, v1
    throttled_time ns), 0 without SPANLET_TEST_CPU_STAT."""
    if not CPU_STAT:
        return 0
    with open(CPU_STAT) as f:
        stat = dict(line.split() for line in f)
    return int(stat["throttled_usec"]) * 1000 if "throttled_usec" in stat else int(stat["throttled_time"])


def reading() -> tuple[int, ...]:
    """(CPU ns, run-queue ns, monotonic ns, switches, involuntary switches) of the calling thread."""
    cpu, wait = schedstat()
    return (cpu, wait, time.monotonic_ns(), *switches())


def say(span, *numbers) -> None:
    ctx = span.get_span_context()
    with out:
        print(f"span {ctx.trace_id:032x} {ctx.span_id:016x}", *numbers, flush=True)


def copies(cuda, index: int, span_no: int) -> tuple[int, int]:
    """Copy to the device and back (bytes distinct per thread and span): (h2d, d2h)."""
    if cuda is None:
        return 0, 0
    h2d, d2h = 1000 * (index + 1) + span_no, 3000 * (index + 1) + span_no
    host = ctypes.create_string_buffer(max(h2d, d2h))
    device = ctypes.c_ulonglong(0x7f0000001000)
    assert cuda.cuMemcpyHtoD_v2(device, host, ctypes.c_size_t(h2d)) == 0
    assert cuda.cuMemcpyDtoH_v2(host, device, ctypes.c_size_t(d2h)) == 0
    return h2d, d2h


def worker(index: int, cpu: int, spans: int, cpu_ms: float, sleep_ms: float, pipe_ms: float,
           start: threading.Barrier, cuda):
    os.sched_setaffinity(0, {cpu})          # this thread only
    start.wait()
    for span_no in range(spans):
        r, w = os.pipe()
        before = reading()
        with tracer.start_as_current_span("request") as span:
            start, throttled_start = reading(), throttled_ns()
            spin(int(cpu_ms * MS))
            copied = copies(cuda, index, span_no)
            time.sleep(sleep_ms / 1000)
            threading.Timer(pipe_ms / 1000, os.write, (w, b"x")).start()
            os.read(r, 1)
            end, throttled = reading(), throttled_ns() - throttled_start
        after = reading()
        os.close(r)
        os.close(w)
        say(span, *(e - s for e, s in zip(end, start)), *(a - b for a, b in zip(after, before)), *copied,
            before[2], after[2], throttled)


def threads(cpu, n, spans, cpu_ms, sleep_ms, pipe_ms, libcuda="") -> None:
    cuda = ctypes.CDLL(libcuda) if libcuda else None
    start = threading.Barrier(int(n))
    ts = [threading.Thread(target=worker, args=(i, int(cpu), int(spans), float(cpu_ms), float(sleep_ms),
                                                float(pipe_ms), start, cuda)) for i in range(int(n))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def coroutines(loop_name, tasks, steps, step_ms) -> None:
    async def one() -> None:
        start = time.monotonic_ns()
        with tracer.start_as_current_span("coroutine") as span:
            mine = 0
            for _ in range(int(steps)):
                t0 = time.thread_time_ns()
                spin(int(float(step_ms) * MS))
                mine += time.thread_time_ns() - t0
                await asyncio.sleep(0)
        say(span, mine, start, time.monotonic_ns())

    async def main() -> None:
        await asyncio.gather(*(one() for _ in range(int(tasks))))
    if loop_name == "uvloop":
        import uvloop
        uvloop.run(main())
    else:
        asyncio.run(main())


print("ready", os.getpid(), flush=True)
sys.stdin.readline()       # "go": the test's agent has attached to this process
{"threads": threads, "coroutines": coroutines}[sys.argv[2]](*sys.argv[3:])
print("done", flush=True)
