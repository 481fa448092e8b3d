"""What the mmap sandbox costs processes that never touch a pool: mmap+munmap
of an unrelated file and openat+close of unrelated paths (one outside /dev,
one under /dev/shm, which the probe normalises), per call, without and with
the probe attached, in one run (root and gcc needed). Prints ns per call,
the ns the probe adds and the ratio, then the time spent in each program per
run from the kernel's BPF statistics (kernel.bpf_stats_enabled is switched on
for that last pass only and put back), which machine noise does not blur."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spanlet import config  # noqa: E402
from spanlet.probes.sandbox.probe import SandboxProbe  # noqa: E402

ROUNDS = 15         # alternating without/with; medians of the rounds count
CALLS = 100_000     # per round and operation

# The loop runs in C so that interpreter time does not drown the probe's.
LOOP_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
                          return t.tv_sec * 1e9 + t.tv_nsec; }
int main(int argc, char **argv) {
    long n = atol(argv[2]);
    const char *path = argv[3];
    double t0 = now();
    if (!strcmp(argv[1], "mmap")) {
        int fd = open(path, O_RDONLY);
        for (long i = 0; i < n; i++) {
            void *p = mmap(0, 4096, PROT_READ, MAP_SHARED, fd, 0);
            if (p == MAP_FAILED) return 1;
            munmap(p, 4096);
        }
    } else {
        for (long i = 0; i < n; i++) {
            int fd = open(path, O_RDONLY);
            if (fd < 0) return 1;
            close(fd);
        }
    }
    printf("%.1f\n", (now() - t0) / n);
    return 0;
}
"""


def build(workdir: str) -> str:
    src, exe = os.path.join(workdir, "loop.c"), os.path.join(workdir, "loop")
    Path(src).write_text(LOOP_C)
    subprocess.run(["gcc", "-O2", "-o", exe, src], check=True)
    return exe


def run_all(exe: str, cases: list[tuple[str, str, str]]) -> list[float]:
    return [float(subprocess.run([exe, op, str(CALLS), path], check=True, capture_output=True,
                                 text=True).stdout) for _, op, path in cases]


def toggle(probe: SandboxProbe, attach: bool) -> None:
    for tp, fn in probe.tracepoints:
        if attach:
            probe.bpf.attach_tracepoint(tp=tp, fn_name=fn)
        else:
            probe.bpf.detach_tracepoint(tp)


def prog_ids(probe: SandboxProbe) -> dict[int, str]:
    out = {}
    for name, fn in probe.bpf.funcs.items():
        for line in Path(f"/proc/self/fdinfo/{fn.fd}").read_text().splitlines():
            if line.startswith("prog_id:"):
                out[int(line.split()[1])] = name.decode() if isinstance(name, bytes) else name
    return out


def program_ns(probe: SandboxProbe, exe: str, cases) -> dict[str, float] | None:
    """Mean ns per run of each program while the cases run once."""
    knob = Path("/proc/sys/kernel/bpf_stats_enabled")
    if not knob.exists():
        return None
    old = knob.read_text()
    knob.write_text("1")
    try:
        run_all(exe, cases)
        out = {}
        for pid, name in prog_ids(probe).items():
            info = json.loads(subprocess.run(["bpftool", "-j", "prog", "show", "id", str(pid)],
                                             check=True, capture_output=True, text=True).stdout)
            if info.get("run_cnt"):  # open/openat2 programs see no calls here
                out[name] = info.get("run_time_ns", 0) / info["run_cnt"]
        return out
    finally:
        knob.write_text(old)


def main() -> int:
    if os.geteuid() != 0:
        print("sandbox_bench: needs root to load the probe", file=sys.stderr)
        return 2
    cfg = config.load(env={})
    with tempfile.TemporaryDirectory(prefix="spanlet_bench_") as tmp, \
            tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="spanlet_bench_") as shm:
        exe = build(tmp)
        plain = os.path.join(tmp, "plain")
        for f in (plain, shm.name):
            with open(f, "wb") as fh:
                fh.truncate(4096)
        cases = [("mmap+munmap", "mmap", plain),
                 ("openat+close", "open", plain),
                 ("openat+close /dev/shm", "open", shm.name)]
        probe = SandboxProbe(cfg)
        without, with_ = [], []
        try:
            st = probe.start()
            if not st.attached:
                print(f"sandbox_bench: probe did not attach: {st.reason}", file=sys.stderr)
                return 1
            # Compiled once; rounds toggle the attachments so that many short
            # rounds alternate and machine noise hits both sides alike.
            for _ in range(ROUNDS):
                toggle(probe, attach=False)
                without.append(run_all(exe, cases))
                toggle(probe, attach=True)
                with_.append(run_all(exe, cases))
            per_prog = program_ns(probe, exe, cases)
            work = dict(getattr(probe, "work", {}))
        finally:
            probe.stop()
    print(f"mmap sandbox cost to unrelated calls (median of {ROUNDS} alternating rounds x "
          f"{CALLS} calls, C loop, default policy; 'added' is the median of the paired "
          f"differences, wall clock, so as noisy as the machine)")
    print(f"{'operation':<24}{'without ns':>12}{'with ns':>10}{'added ns':>10}{'ratio':>8}")
    for i, (name, _, _) in enumerate(cases):
        a = statistics.median(r[i] for r in without)
        b = statistics.median(r[i] for r in with_)
        added = statistics.median(w[i] - wo[i] for w, wo in zip(with_, without))
        print(f"{name:<24}{a:>12.0f}{b:>10.0f}{added:>10.0f}{b / a:>8.3f}")
    print(f"the agent's work for those calls: {work}")
    if per_prog:
        print("time in each program per run (kernel BPF statistics, includes their own "
              "accounting):")
        for name, ns in sorted(per_prog.items()):
            print(f"  {name:<22}{ns:>8.0f} ns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
