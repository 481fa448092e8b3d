"""The kernel's own record of the CPUs' context switches (tracefs, in an
instance of the test's own, removed on close), to find the switches it did
not trace. On each CPU every switch starts the task that the next switch
stops; where the chain breaks (a switch stops a task that the previous one
did not start) a switch in between went untraced: some kernels leave out the
switches away from some tasks. The span context program cannot see such a
switch either, so a slice of a thread that was in the run queue then can land
in its run-queue time instead of its CPU time (and a wake-up then unseen, its
run-queue time in its blocked time). The request-anatomy tests check the split
of a span's time only where no such break overlaps it."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOTS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
LINE = re.compile(r"\[(\d+)\]\s+\S+\s+(\d+)\.(\d+): sched_switch: (.*) ==> (.*)$")
PID = re.compile(r"(?:prev|next)_pid=(\d+)")


def mono_ns(sec: str, frac: str) -> int:
    return int(sec) * 1_000_000_000 + int(frac.ljust(9, "0")[:9])


def breaks(text: str) -> list[tuple[int, int]]:
    """(after, before) in CLOCK_MONOTONIC ns: each stretch of a CPU in which a
    switch went untraced (between the last switch that started another task
    and the one that stopped a task it did not start)."""
    started: dict[str, tuple[str, int]] = {}
    out = []
    for line in text.splitlines():
        m = LINE.search(line)
        if not m:
            continue
        cpu, ts = m.group(1), mono_ns(m.group(2), m.group(3))
        prev, nxt = PID.search(m.group(4)), PID.search(m.group(5))
        if not prev or not nxt:
            continue
        last = started.get(cpu)
        if last is not None and last[0] != prev.group(1):
            out.append((last[1], ts))
        started[cpu] = (nxt.group(1), ts)
    return out


class SwitchTrace:
    """sched_switch in a tracefs instance of this process's, on the monotonic
    clock (the one a child's time.monotonic_ns() reads)."""

    def __init__(self):
        root = next((r for r in ROOTS if (r / "instances").is_dir()), None)
        assert root is not None, "tracefs is not mounted (scripts/setup.sh mounts it)"
        self.dir = root / "instances" / f"spanlet-test-switches-{os.getpid()}"
        self.dir.mkdir()
        try:
            (self.dir / "buffer_size_kb").write_text("16384")
            (self.dir / "trace_clock").write_text("mono")
            (self.dir / "events" / "sched" / "sched_switch" / "enable").write_text("1")
            (self.dir / "tracing_on").write_text("1")
        except BaseException:
            self.close()
            raise

    def clear(self) -> None:
        (self.dir / "trace").write_text("")

    def breaks(self) -> list[tuple[int, int]]:
        """Since the last clear; the whole time when the buffer overran."""
        overrun = sum(int(line.split()[1]) for stats in self.dir.glob("per_cpu/cpu*/stats")
                      for line in stats.read_text().splitlines() if line.startswith("overrun:"))
        if overrun:
            return [(0, 1 << 63)]
        return breaks((self.dir / "trace").read_text())

    def close(self) -> None:
        if not self.dir.exists():
            return
        (self.dir / "tracing_on").write_text("0")
        (self.dir / "events" / "sched" / "sched_switch" / "enable").write_text("0")
        self.dir.rmdir()


def overlaps(windows: list[tuple[int, int]], start: int, end: int) -> bool:
    return any(a < end and b > start for a, b in windows)
