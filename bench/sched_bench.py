"""What the request anatomy (the scheduler's tracepoints, sched.enabled) costs a
context switch, side by side in one run: two processes pinned to one CPU
ping-pong a byte over two pipes (every round trip two switches), with no
agent, with the agent and sched.enabled false, and with sched.enabled true;
each with the two processes outside any span and inside one (marked through
a C build of the marker's probed function, named as the extension is, so
that the agent attaches to it: the C loop cannot load a Python extension). Rounds alternate
the agent's settings; medians of the rounds count. Root and gcc needed.

    sudo .venv/bin/python bench/sched_bench.py [--rounds R] [--trips N]

The agent runs in this process with its probes as configured, TC off (pipes
never reach it) and the store off. Goal: the anatomy adds <= 100 ns a switch,
outside and inside spans. Wall times on a shared VM are noisy; the kernel's
own statistics of the anatomy's programs (kernel.bpf_stats_enabled, switched
on for the agent's rounds and put back) give their time a switch exactly,
the tracepoint's dispatch left out.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spanlet import config  # noqa: E402
from spanlet.probes.span_ctx import SCHED_PROGRAMS  # noqa: E402

PINGPONG_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
                          return t.tv_sec * 1e9 + t.tv_nsec; }
int main(int argc, char **argv) {
    long trips = atol(argv[1]);
    void (*mark)(uint64_t, uint64_t, uint64_t, uint32_t) = 0;
    if (strcmp(argv[2], "-")) {        /* inside a span: the marker, as an instrumented thread calls it */
        void *lib = dlopen(argv[2], RTLD_NOW);
        if (!lib || !(mark = (void (*)(uint64_t, uint64_t, uint64_t, uint32_t))dlsym(lib, "spanlet_mark")))
            return 2;
        printf("ready\n");
        fflush(stdout);
        char go[8];
        if (!fgets(go, sizeof go, stdin))         /* the agent attached to the marker */
            return 2;
    }
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(0, &one);
    sched_setaffinity(0, sizeof one, &one);
    int ab[2], ba[2];
    if (pipe(ab) || pipe(ba))
        return 2;
    char c = 'x';
    pid_t child = fork();
    if (child == 0) {
        if (mark)
            mark(0x1111, 0x2222, 0x3333, 1);
        for (long i = 0; i < trips; i++) {
            if (read(ab[0], &c, 1) != 1 || write(ba[1], &c, 1) != 1)
                _exit(1);
        }
        _exit(0);
    }
    if (mark)
        mark(0x1111, 0x2222, 0x4444, 1);
    double t0 = now();
    for (long i = 0; i < trips; i++) {
        if (write(ab[1], &c, 1) != 1 || read(ba[0], &c, 1) != 1)
            return 1;
    }
    double t1 = now();
    if (mark)
        mark(0, 0, 0, 0);
    int st;
    waitpid(child, &st, 0);
    printf("%.1f\n", (t1 - t0) / (2.0 * trips));
    return 0;
}
"""


# spanlet_mark as native/spanlet_marker.c makes it (the probe-site NOP), without Python.
MARKER_C = r"""
#include <stdint.h>
__attribute__((visibility("default"), noinline, used, noipa))
void spanlet_mark(uint64_t a, uint64_t b, uint64_t c, uint32_t d)
{
    __asm__ volatile(".byte 0x0f, 0x1f, 0x44, 0x00, 0x00" : : "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
"""


def build(out: Path) -> tuple[Path, Path]:
    """The ping-pong program and a marker library it can load."""
    src, exe = out / "pingpong.c", out / "pingpong"
    src.write_text(PINGPONG_C)
    subprocess.run(["gcc", "-O2", "-o", str(exe), str(src), "-ldl"], check=True)
    msrc, lib = out / "marker.c", out / "libspanlet_marker.bench.so"
    msrc.write_text(MARKER_C)
    subprocess.run(["gcc", "-O2", "-fcf-protection=none", "-shared", "-fPIC", "-o", str(lib), str(msrc)],
                   check=True)
    return exe, lib


def program_ns(agent) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of the anatomy's programs so far (their fdinfo,
    bpf stats on)."""
    if agent is None:
        return 0, 0
    span_ctx = next(p for p in agent.probes if p.name == "span_ctx")
    t = n = 0
    for name in SCHED_PROGRAMS:
        fd = span_ctx.bpf.program_fd(name)
        if fd >= 0:
            info = dict(line.split(":", 1) for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines()
                        if ":" in line)
            t += int(info.get("run_time_ns", 0))
            n += int(info.get("run_cnt", 0))
    return t, n


def pingpong(exe: Path, trips: int, marker: str | None, agent=None) -> float:
    """ns per switch; with `marker`, both processes inside a span (the agent's
    uprobe on the marker attached first, when an agent runs)."""
    proc = subprocess.Popen([str(exe), str(trips), marker or "-"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    if marker:
        assert proc.stdout.readline().strip() == "ready"
        if agent is not None:
            span_ctx = next(p for p in agent.probes if p.name == "span_ctx")
            deadline = time.monotonic() + 10
            while not span_ctx.libraries and time.monotonic() < deadline:
                time.sleep(0.05)
            assert span_ctx.libraries, "the agent did not attach to the marker"
        proc.stdin.write("go\n")
        proc.stdin.flush()
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return float(out.split()[-1])


def start_agent(sched: bool, tmp: Path):
    from spanlet.daemon import Daemon
    cfg = config.load(env={}, overrides=[
        f"sched.enabled={str(sched).lower()}", "tc.enabled=false", "store.enabled=false",
        "nvml.enabled=false", "discovery.interval_s=0.2", "http_port=0", "http_address=127.0.0.1",
        "otlp.grpc_port=0", "otlp.http_port=0", f"admin_socket={tmp / 'admin.sock'}",
        f"data_dir={tmp / 'data'}"])
    d = Daemon(cfg)
    d.check_node()
    d.start()
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--trips", type=int, default=200_000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="spanlet-sched-bench-"))
    exe, marker = build(tmp)
    ways = ("no agent", "agent, sched off", "agent, sched on")
    runs: dict[tuple[str, str], list[float]] = {(w, s): [] for w in ways for s in ("outside", "inside")}
    programs: dict[str, list[float]] = {"outside": [], "inside": []}
    stats = Path("/proc/sys/kernel/bpf_stats_enabled")
    stats_was = stats.read_text().strip()
    try:
        stats.write_text("1")
        for _ in range(args.rounds):
            for way in ways:
                agent = None if way == "no agent" else start_agent(way == "agent, sched on", tmp)
                try:
                    for where, m in (("outside", None), ("inside", str(marker))):
                        t0, _ = program_ns(agent)
                        runs[way, where].append(pingpong(exe, args.trips, m, agent))
                        t1, _ = program_ns(agent)
                        if way == "agent, sched on":
                            programs[where].append((t1 - t0) / (2 * args.trips))
                finally:
                    if agent is not None:
                        agent.stop()
    finally:
        stats.write_text(stats_was)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"Context switch cost: 2 processes ping-pong over pipes on one CPU, {args.trips} round trips, "
          f"median of {args.rounds} rounds alternating")
    print(f"  {'ns a switch':<24} {'outside spans':>14} {'inside spans':>14}")
    for way in ways:
        print(f"  {way:<24} {med[way, 'outside']:14.1f} {med[way, 'inside']:14.1f}")
    for label, a, b in (("agent (sched off) adds", "no agent", "agent, sched off"),
                        ("the anatomy adds", "agent, sched off", "agent, sched on"),
                        ("the whole agent adds", "no agent", "agent, sched on")):
        print(f"  {label:<24} {med[b, 'outside'] - med[a, 'outside']:14.1f} "
              f"{med[b, 'inside'] - med[a, 'inside']:14.1f}")
    print(f"  {'anatomy programs (bpf stats)':<24} {statistics.median(programs['outside']):14.1f} "
          f"{statistics.median(programs['inside']):14.1f}   <- ns a switch in the anatomy's programs"
          " (the whole system's switches during the run, over the ping-pong's)")


if __name__ == "__main__":
    main()
