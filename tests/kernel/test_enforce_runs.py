"""The sandbox in enforce mode over 1,000 runs: one probe load, children forked
in batches by a small C helper (tests/support/enforce_fork.c), a mix of
processes granted by pid or by cgroup, bystanders and violators, each doing
one mmap. Every violator dies of SIGKILL (seen by waitpid), no one else dies;
the survivors hold their mappings while the sweep runs, and it kills no one;
the violation counters and events match the violators exactly."""

from __future__ import annotations

import random
import secrets
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from spanlet import events
from spanlet.config import SandboxGrant
from spanlet.cgroups import CgroupResolver, cgroup2_mount
from sandbox_harness import KIB, Harness, _own_cgroup

pytestmark = [pytest.mark.kernel,
              pytest.mark.filterwarnings("ignore:not a bytes object:DeprecationWarning")]

SUPPORT = Path(__file__).resolve().parents[1] / "support"
RUNS, BATCH = 1000, 100
R, RW, RX = 1, 3, 5
SHARED, PRIVATE = 1, 2

# kind: (cgroup, pool ("-": anonymous), open mode, prot, flags, length, pid grant on "ro",
#        rule broken (None: allowed))
KINDS = {
    "pid grant ro, shared read": (None, "ro", "r", R, SHARED, 64 * KIB, True, None),
    "cgroup grant rw, shared write": ("rw", "rw", "rw", RW, SHARED, 64 * KIB, False, None),
    "cgroup grant ro, private write (copy on write)": ("ro", "ro", "r", RW, PRIVATE, 64 * KIB, False, None),
    "cgroup grant ro, capped pool at its limit": ("ro", "capped", "r", R, SHARED, 64 * KIB, False, None),
    "bystander: unrelated file, shared write": ("denied", "outside", "rw", RW, SHARED, 8 * KIB, False, None),
    "bystander: anonymous memory": ("denied", "-", "r", RW, PRIVATE, 64 * KIB, False, None),
    "no grant": ("denied", "ro", "r", R, SHARED, 4 * KIB, False, "unauthorized"),
    "unlisted file under the prefix": ("denied", "unlisted", "r", R, SHARED, 4 * KIB, False, "unauthorized"),
    "pid grant ro, shared write": (None, "ro", "rw", RW, SHARED, 4 * KIB, True, "write_on_readonly"),
    "cgroup grant rw, executable": ("rw", "rw", "r", RX, PRIVATE, 4 * KIB, False, "exec"),
    "cgroup grant ro, over the capped pool's limit": ("ro", "capped", "r", R, SHARED, 128 * KIB, False,
                                                      "oversize"),
}


class Forker:
    """The C helper, driven line by line."""

    def __init__(self, exe: Path):
        self.proc = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)

    def send(self, *lines: str) -> None:
        self.proc.stdin.write("".join(f"{ln}\n" for ln in lines))
        self.proc.stdin.flush()

    def line(self, word: str) -> list[str]:
        ln = self.proc.stdout.readline()
        assert ln.split(" ", 1)[0].strip() == word, ln
        return ln.split()[1:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send("exit")
            self.proc.wait(30)
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def forker(tmp_path_factory):
    exe = tmp_path_factory.mktemp("enforce") / "enforce_fork"
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", "-o", str(exe), str(SUPPORT / "enforce_fork.c")],
                   check=True, capture_output=True)
    f = Forker(exe)
    try:
        yield f
    finally:
        f.close()


@pytest.fixture(scope="module")
def groups():
    """cgroups "ro", "rw" and "denied" under a test cgroup; removed at the end
    (the forked children are all gone by then)."""
    resolver = CgroupResolver(cgroup2_mount(Path("/proc/self/mountinfo").read_text()))
    top = Path(resolver.mount) / f"spanlet_enforce_{secrets.token_hex(4)}"
    made = [top] + [top / n for n in ("ro", "rw", "denied")]
    try:
        for d in made:
            d.mkdir()
        yield resolver, top
    finally:
        for d in reversed(made):
            if d.exists():
                d.rmdir()


def test_1000_runs_kill_every_violator_and_no_one_else(forker, groups, pools):
    resolver, top = groups
    cg_name = {n: f"{top.name}/{n}" for n in ("ro", "rw", "denied")}
    cg_id = {n: resolver.id(p) for n, p in cg_name.items()}
    cg_id[None] = resolver.id(_own_cgroup())

    def policy(pid_grants: list[int]):
        return pools.config({
            "ro": [SandboxGrant(cgroups=[cg_name["ro"]], access="ro")]
            + ([SandboxGrant(pids=pid_grants, access="ro")] if pid_grants else []),
            "rw": [SandboxGrant(cgroups=[cg_name["rw"]], access="rw")],
            "capped": [SandboxGrant(cgroups=[cg_name["ro"]], access="ro")]}, mode="enforce")

    plan = [k for k in KINDS for _ in range(RUNS // len(KINDS))]
    plan += list(KINDS)[: RUNS - len(plan)]
    random.Random(8).shuffle(plan)
    assert len(plan) == RUNS

    h = Harness(policy([]))
    outcome: Counter = Counter()
    expected_violations: Counter = Counter()
    violator_pids: dict[int, str] = {}
    try:
        assert h.probe.cfg.sandbox.mode == "enforce"
        for start in range(0, RUNS, BATCH):
            batch = plan[start:start + BATCH]
            lines = []
            for kind in batch:
                cg, pool, mode, prot, flags, length, _, _ = KINDS[kind]
                procs = str(top / cg / "cgroup.procs") if cg else "-"
                path = "-" if pool == "-" else (str(pools.outside) if pool == "outside"
                                                 else pools.path(pool))
                lines.append(f"{procs} {path} {mode} {prot} {flags} {length}")
            forker.send(f"batch {len(batch)}", *lines)
            pids = [int(p) for p in forker.line("pids")]
            h.grant(policy([pid for pid, kind in zip(pids, batch) if KINDS[kind][6]]))

            forker.send("go")
            held = {int(i) for i in forker.line("held")}
            # The survivors hold their mappings: the sweep judges them all
            # again and kills no one.
            h.probe.sweep()
            forker.send("release")
            status = {}
            for _ in batch:
                pid, st = forker.line("status")
                status[int(pid)] = st
            forker.line("done")

            for i, (pid, kind) in enumerate(zip(pids, batch)):
                rule = KINDS[kind][7]
                if rule:
                    outcome["violator killed" if status[pid] == "signal9" else
                            f"violator {status[pid]}"] += 1
                    assert i not in held, kind       # it never returned from mmap
                    violator_pids[pid] = kind
                    expected_violations[(cg_id[KINDS[kind][0]], rule, "kill")] += 1
                else:
                    outcome["spared" if status[pid] == "exit0" else f"spared {status[pid]}"] += 1
                    assert i in held, kind
            h.probe.drain()

        violators = sum(1 for k in plan if KINDS[k][7])
        print(f"\n{RUNS} runs: {violators} violators, {RUNS - violators} allowed or bystanders: "
              f"{dict(outcome)}")
        assert outcome == {"violator killed": violators, "spared": RUNS - violators}
        assert h.probe.violations() == dict(expected_violations)
        assert h.probe.sweep_violations() == {}
        # One event per violator, with its rule, and the kill.
        got = Counter()
        for e in h.got:
            if e.hdr.pid in violator_pids:
                assert events.Action(e.action).name == "kill"
                got[(violator_pids[e.hdr.pid], events.Rule(e.rule).name)] += 1
        assert got == Counter({(k, KINDS[k][7]): n for k, n in Counter(plan).items() if KINDS[k][7]})
        assert h.probe.events_dropped() == 0
    finally:
        h.stop()
