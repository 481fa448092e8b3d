"""Request anatomy (kernel.sched.*): threads of a real OTel-instrumented process,
pinned two to a CPU, spin a known CPU time, sleep, read a pipe and copy to
and from the device (through the stand-in libcuda, the GPU probe beside the
span context probe) inside their spans; each span's facts row holds exactly
its threads' time on a CPU, in the run queue and blocked, as the threads' own
clocks and schedstat tell (the run queue with whatever the hypervisor took from
their CPU, which schedstat leaves out), and the bytes they copied each way, quiet and with
a launch flood or a CPU hog beside them. Coroutines sharing a
thread (asyncio, uvloop) each get the CPU time of their own steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import anatomy
import cuda_standin
import switch_trace
from spanlet import config
from spanlet.probes.gpu import GpuProbe

pytestmark = pytest.mark.kernel
ROOT = Path(__file__).resolve().parents[2]
CHILD = ROOT / "tests" / "support" / "anatomy" / "child.py"
CPU = 1 if os.cpu_count() > 1 else 0
MS = 1_000_000


def close(got: int, want: int, rel: float) -> bool:
    return abs(got - want) <= max(rel * want, 1 * MS)


def between(got: int, inner: int, outer: int, rel: float) -> bool:
    """`got` within [inner, outer], give or take rel of it or 1 ms."""
    slack = max(rel * inner, 1 * MS)
    return inner - slack <= got <= outer + slack


@pytest.fixture(scope="module")
def spin(tmp_path_factory) -> Path:
    return anatomy.build(tmp_path_factory.mktemp("spin"))


@pytest.fixture(scope="module")
def probe():
    with anatomy.span_ctx_probe("sched.enabled=true") as p:
        yield p


@pytest.fixture(scope="module")
def gpu(probe, standin):
    """The GPU probe (default settings) on the span context probe's maps,
    attached to the stand-in libcuda that a workload maps (by file: the
    children that load it later are covered); (probe, the libcuda path)."""
    holder = cuda_standin.Workload(standin.workload)
    p = GpuProbe(config.load(env={}))
    try:
        holder.load(standin.lib_dir)
        st = p.start(pin_dir=probe.shared_pin_dir())
        assert st.attached and p.libraries(), st.reason
        yield p, standin.lib_dir / cuda_standin.DRIVER
    finally:
        p.stop()
        holder.close()


@pytest.fixture(scope="module")
def switches():
    trace = switch_trace.SwitchTrace()
    try:
        yield trace
    finally:
        trace.close()


run_child = anatomy.run_child


def rows_of(probe, spans) -> dict:
    """Each span's facts row (the agent takes a row once: taken here)."""
    out = {}
    for trace, span in spans:
        rows = probe.facts.take_rows(trace, span)
        assert len(rows) == 1, (trace.hex(), span, rows)
        out[(trace, span)] = rows[0]
    return out


def taken_ns(cpu: int) -> int:
    """What /proc/stat says was taken from a CPU's tasks so far: its irq,
    softirq and steal time (USER_HZ ticks, in ns)."""
    with open("/proc/stat") as f:
        for line in f:
            w = line.split()
            if w[0] == f"cpu{cpu}":
                return sum(map(int, w[6:9])) * TICK_NS
    raise AssertionError(f"no cpu{cpu} in /proc/stat")


TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


class Beside:
    """Load beside the child: a launch flood (a process launching through
    ctypes in a loop) or a CPU hog pinned to the children's CPU."""

    CODE = {"flood": "import ctypes, sys\nlib = ctypes.CDLL(sys.argv[1])\n"
                     "while True:\n    lib.spin_cpu_ns(1000)\n",
            "hog": f"import os\nos.sched_setaffinity(0, {{{CPU}}})\nwhile True:\n    pass\n"}

    def __init__(self, what: str, spin: Path):
        self.proc = None if what == "quiet" else subprocess.Popen(
            [sys.executable, "-c", self.CODE[what], str(spin)])

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


# What the split can miss, and how the test tells. (1) A switch the kernel did not
# trace (some kernels leave out the switches away from some tasks): the program
# cannot see it, so one slice of a thread's running time lands in its run-queue
# time, or its wake-up is unseen and run-queue time lands in its blocked time. The
# test records the CPUs' switches itself (switch_trace.py) and checks the split
# only of the spans that no untraced switch overlaps, running more rounds until
# SPANS_TO_CHECK of them are checked. (2) Time the hypervisor took from a virtual
# CPU while the thread held it (steal): the thread's own clock leaves it out, and
# so does the span's CPU time (the scheduler's runtime); the span counts it as run
# queue (runnable, not running), which the thread's schedstat wait does not. On a
# VM with much steal (CI's failed so: the spans' CPU time 10-80% above the
# threads' when it was timed by the clock) a span's run queue may exceed the
# thread's wait by what the kernel says was taken from the test's CPU during the
# run (/proc/stat: steal, and irq and softirq where the kernel accounts them
# apart), in USER_HZ ticks, so give or take a tick a field; no more, and only in
# a run where the kernel says something was taken. The share of the checked spans
# whose split may still be off: SPLIT_MISSES_ALLOWED. The total and the switch
# counts stay exact in every span.
SPLIT_MISSES_ALLOWED = 0.05
SPANS_TO_CHECK = 80
MAX_RUNS = 80
# A coroutine run's sum over its spans: beside a launch flood, twice in ~700 runs
# here (before untraced switches were told apart) a run's spans held one step's
# CPU (3 ms) less than the thread's steps, or 35 ms more (the root cause is not
# found; the process's exit is about that long). Checked runs whose sum is off by
# more than 3%: at most this many.
RUN_MISSES_ALLOWED = 2


@pytest.mark.parametrize("beside", ["quiet", "flood", "hog"])
def test_each_span_holds_its_threads_cpu_run_queue_and_blocked_time(probe, gpu, spin, switches, beside):
    """Runs of 4 spans each: every span's cpu + run queue + blocked time, its
    switches and its copied bytes each way exact; its cpu and run queue time
    each exact for all but a few of the 80 spans or more whose time the kernel
    traced every switch of."""
    libcuda = gpu[1]
    split_misses, checked, runs = [], 0, 0
    while checked < SPANS_TO_CHECK:
        assert runs < MAX_RUNS, f"the kernel left switches untraced beside all but {checked} spans of {runs} runs"
        runs += 1
        switches.clear()
        load = Beside(beside, spin)
        try:
            taken = taken_ns(CPU)
            spans = run_child(probe, spin, "threads", str(CPU), "2", "2", "20", "5", "10", str(libcuda))
            taken = taken_ns(CPU) - taken
        finally:
            load.close()
        untraced = switches.breaks()
        assert len(spans) == 4
        rows = rows_of(probe, spans)
        over = {}          # the checked spans' run queue above the thread's wait (steal, if any)
        for key, figures in spans.items():
            (cpu, wait, wall, switched, involuntary), (cpu_o, wait_o, wall_o, switched_o, involuntary_o) = (
                figures[:5], figures[5:10])
            (h2d, d2h), (start, end) = figures[10:12], figures[12:14]
            r = rows[key]
            total = r.cpu_ns + r.runqueue_ns + r.blocked_ns
            seen = (f"ours: cpu {r.cpu_ns} rq {r.runqueue_ns} blocked {r.blocked_ns} total {total} switches "
                    f"{r.switches} preemptions {r.preemptions}; the thread's, inside then outside the edges: "
                    f"{figures}")
            assert between(total, wall, wall_o, 0.02), ("cpu + run queue + blocked", seen)
            # switches as the kernel counts the thread's (nvcsw + nivcsw, nivcsw)
            assert switched <= r.switches <= switched_o and involuntary <= r.preemptions <= involuntary_o, seen
            assert r.iowait_ns <= r.blocked_ns and r.blocked_ns >= 5 * MS, seen   # the sleep at least
            # the copies, exact each way (distinct per thread and span), timed inside the span
            assert (r.memcpy_h2d_bytes, r.memcpy_d2h_bytes, r.memcpy_d2d_bytes, r.memcpy_other_bytes,
                    r.memcpy_calls) == (h2d, d2h, 0, 0, 2), seen
            assert 0 < r.memcpy_ns <= wall_o, seen
            if switch_trace.overlaps(untraced, start, end):
                continue
            checked += 1
            if not (between(r.cpu_ns, cpu, cpu_o, 0.02) and r.runqueue_ns >= wait - max(0.02 * wait, MS)):
                split_misses.append(seen)
            elif not between(r.runqueue_ns, wait, wait_o, 0.02):
                over[key] = (r.runqueue_ns - wait_o, seen)
        # what the run queue holds beyond the threads' waits: at most what was taken from their CPU
        if over and (not taken or sum(o for o, _ in over.values()) > taken + 3 * TICK_NS):
            split_misses.extend(f"{seen}; taken from the CPU in the run: {taken}" for _, seen in over.values())
        # two threads on one CPU: much of their time is the run queue, taken by preemption
        assert sum(f[1] for f in spans.values()) >= 10 * MS
        assert sum(r.preemptions for r in rows.values()) >= 1
    assert len(split_misses) <= SPLIT_MISSES_ALLOWED * checked, "\n".join(split_misses)


@pytest.mark.parametrize("beside", ["quiet", "flood", "hog"])
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_coroutines_on_one_thread_each_get_the_cpu_of_their_own_steps(probe, spin, switches, loop, beside):
    """Runs of 4 coroutines, 8 steps each: each coroutine's cpu_ns is the
    thread CPU time of its own steps, in all but the allowed share of the 80
    spans or more whose time the kernel traced every switch of."""
    misses, checked, runs, off_runs = [], 0, 0, []
    while checked < SPANS_TO_CHECK:
        assert runs < MAX_RUNS, f"the kernel left switches untraced beside all but {checked} spans of {runs} runs"
        runs += 1
        switches.clear()
        load = Beside(beside, spin)
        try:
            spans = run_child(probe, spin, "coroutines", loop, "4", "8", "3")
        finally:
            load.close()
        untraced = switches.breaks()
        assert len(spans) == 4
        rows = rows_of(probe, spans)
        if any(switch_trace.overlaps(untraced, start, end) for _, start, end in spans.values()):
            continue
        for key, (mine, _, _) in spans.items():
            assert mine >= 24 * MS
            checked += 1
            if not close(rows[key].cpu_ns, mine, 0.03):
                misses.append((rows[key].cpu_ns, mine))
        # the steps' CPU all lands on the coroutines' spans, none lost, none counted
        # twice: in all but the known gap's runs (RUN_MISSES_ALLOWED)
        ours, theirs = sum(rows[k].cpu_ns for k in spans), sum(f[0] for f in spans.values())
        if not close(ours, theirs, 0.03):
            off_runs.append((ours, theirs, [(rows[k].cpu_ns, rows[k].runqueue_ns, rows[k].blocked_ns,
                                              spans[k][0]) for k in spans]))
    assert len(misses) <= SPLIT_MISSES_ALLOWED * checked, misses
    assert len(off_runs) <= RUN_MISSES_ALLOWED, off_runs
