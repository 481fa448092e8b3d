"""Hostile paths to tensor pools against the real mmap sandbox: symlinks (into
a pool from outside, out of the prefix from inside, onto a pool from inside),
'..', paths relative to a directory fd or the working directory, hard links,
dup'd and inherited fds, pools replaced while mapped, mprotect after the
mmap, mappings inherited across fork. For each, what the check at the mmap
call does, what the agent's resolution of the kernel's notices adds (by
inode, from /proc, as the call happens; each test prints how long that took:
"detected in"), that the full sweep (SandboxProbe.sweep) does not count it
again, and that a bystander is never counted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spanlet import events
from spanlet.config import SandboxGrant
from spanlet.probes.sandbox.policy import NOT_A_POOL
from sandbox_harness import KIB, Child, Harness, Pools, _delta

pytestmark = [pytest.mark.kernel,
              pytest.mark.filterwarnings("ignore:not a bytes object:DeprecationWarning")]

# The child: like test_sandbox's, with the ways a pool can be reached without
# naming it. Steps run in order; "go" waits for the test.
CHILD = r'''
import ctypes, json, os, signal, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PROT = {"r": 1, "rw": 3, "rx": 5}
FLAGS = {"shared": 1, "private": 2}
MAP_FAILED = ctypes.c_void_p(-1).value
def say(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()
fds, maps = {}, {}
def mmap(step):
    name = step.get("fd", "f")
    fd = -1 if name == "anon" else fds[name]
    addr = libc.mmap(None, step["len"], PROT[step.get("prot", "r")],
                     FLAGS[step.get("flags", "shared")] | (0x20 if fd == -1 else 0), fd, 0)
    return addr, (0 if addr != MAP_FAILED else ctypes.get_errno())
say({"pid": os.getpid(), "tid": threading.get_native_id()})
for step in json.loads(sys.argv[1]):
    op = step["op"]
    if op == "go":
        say({"waiting": True})
        if sys.stdin.readline().strip() != "go":
            sys.exit(3)
    elif op == "chdir":
        os.chdir(step["path"])
    elif op == "open":
        flags = os.O_RDWR if step.get("mode") == "rw" else os.O_RDONLY
        if step.get("dir"):
            fd = os.open(step["path"], flags, dir_fd=fds[step["dir"]])   # openat(dirfd, ...)
        else:
            fd = os.open(step["path"], flags | step.get("extra", 0))
        fds[step.get("as", "f")] = fd
        say({"fd": fd})
    elif op == "dup":
        fds[step["as"]] = os.dup(fds[step.get("fd", "f")])
        say({"fd": fds[step["as"]]})
    elif op == "map":
        addr, err = mmap(step)
        if err == 0 and step.get("keep"):
            maps[step["keep"]] = (addr, step["len"])
        elif err == 0:
            libc.munmap(addr, step["len"])
        say({"ok": err == 0, "errno": err})
    elif op == "mprotect":
        addr, n = maps[step["m"]]
        rc = libc.mprotect(addr, n, PROT[step["prot"]])
        say({"ok": rc == 0, "errno": 0 if rc == 0 else ctypes.get_errno()})
    elif op == "fork_map":   # a child of this process maps an inherited fd and stays
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            libc.prctl(1, 9)   # PR_SET_PDEATHSIG: SIGKILL when this process's parent ends
            addr, err = mmap(step)
            os.write(w, json.dumps({"gpid": os.getpid(), "ok": err == 0}).encode() + b"\n")
            while True:
                signal.pause()
        say(json.loads(os.read(r, 4096)))
'''


class HostileChild(Child):
    """test_sandbox's Child with the script above."""

    def __init__(self, steps: list[dict]):  # not super().__init__: that runs test_sandbox's script
        self.proc = subprocess.Popen([sys.executable, "-S", "-c", CHILD, json.dumps(steps)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._buf = b""
        hello = self._line()
        assert hello is not None, "child died before saying hello"
        self.pid, self.tid = hello["pid"], hello["tid"]
        self.before_go = self._until_waiting()


@pytest.fixture
def spawn():
    made: list[HostileChild] = []
    grandchildren: list[int] = []

    def _spawn(steps: list[dict]) -> HostileChild:
        child = HostileChild(steps)
        made.append(child)
        return child

    _spawn.grandchildren = grandchildren
    yield _spawn
    for pid in grandchildren:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for child in made:
        child.end()


class Names:
    """Extra names for the pools: made by the tests, removed at the end."""

    def __init__(self, pools: Pools):
        self.pools = pools
        self.token = pools.dir.name.rsplit("_", 1)[1]
        self.made: list[Path] = []
        self.dirs: list[Path] = []

    def outside(self, kind: str) -> Path:
        """A name outside every prefix, in /dev/shm (so a hard link works)."""
        return Path(f"/dev/shm/spanlet_sbx_{kind}_{self.token}")

    def symlink(self, at: Path | str, to: Path | str) -> Path:
        at = Path(at)
        os.symlink(to, at)
        self.made.append(at)
        return at

    def hardlink(self, at: Path | str, to: Path | str) -> Path:
        at = Path(at)
        os.link(to, at)
        self.made.append(at)
        return at

    def folder(self, at: Path) -> Path:
        at.mkdir()
        self.dirs.append(at)
        return at

    def remove(self) -> None:
        for p in self.made:
            p.unlink(missing_ok=True)
        for d in self.dirs:
            d.rmdir()


@pytest.fixture
def names(pools):
    n = Names(pools)
    try:
        yield n
    finally:
        n.remove()


@pytest.fixture
def bystander(pools, spawn):
    """A process that keeps an unrelated file mapped (writable, shared) while
    the test runs: neither the call nor the sweep may ever count it."""
    child = spawn([{"op": "open", "path": str(pools.outside), "mode": "rw"},
                   {"op": "map", "len": 8 * KIB, "prot": "rw", "keep": "m"},
                   {"op": "open", "path": "/dev/null", "as": "n"},
                   {"op": "go"}])
    assert [m for m in child.before_go if "ok" in m] == [{"ok": True, "errno": 0}]
    return child


class Counts:
    """The sandbox's counters before a step, and what changed after it."""

    def __init__(self, h: Harness):
        self.h = h
        self.kernel, self.sweep = h.probe.violations(), h.probe.sweep_violations()
        self.unresolved = h.probe.unresolved_opens()

    def delta(self) -> tuple[dict, dict, int]:
        p = self.h.probe
        return (_delta(self.kernel, p.violations()), _delta(self.sweep, p.sweep_violations()),
                p.unresolved_opens() - self.unresolved)


def _rule_events(h: Harness, child) -> list[tuple[str, int, int]]:
    return [(events.Rule(e.rule).name, e.pool_id, e.fd) for e in h.events_of(child)]


DETECT_TIMEOUT_S = 10.0


def detected(what: str, since: float, done) -> float:
    """Seconds from `since` (the offending call returned) until done() held,
    as the probe's notice reader works on its own; printed, not asserted
    (timing is the bench's business): a test fails only if it never holds."""
    while not done():
        assert time.monotonic() - since < DETECT_TIMEOUT_S, f"{what}: not detected"
        time.sleep(0.0005)
    took = time.monotonic() - since
    print(f"\ndetected in {took * 1e3:.1f} ms: {what}")
    return took


# -- reaching a pool by another way than its name -------------------------------------
def bypass_steps(names: Names, how: str) -> tuple[list[dict], int]:
    """Steps that open pool "ro" the `how` way (as fd "f") and map it, keeping
    the mapping; then, after a "go", map it again through the same fd. Also
    how many '..' opens the kernel counts as unresolved."""
    pools = names.pools
    ro = pools.path("ro")
    if how == "symlink outside the prefix":
        link = names.outside("link")
        if not link.is_symlink():
            names.symlink(link, ro)
        opening = [{"op": "open", "path": str(link)}]
    elif how == "'..' under the prefix":
        sub = pools.dir / "sub"
        if not sub.exists():
            names.folder(sub)
        opening = [{"op": "open", "path": f"{pools.prefix}sub/../ro"}]
    elif how == "'..' from a folder above the prefix":
        up = names.outside("dir")
        if not up.exists():
            names.folder(up)
        opening = [{"op": "open", "path": f"{up}/../{pools.dir.name}/ro"}]
    elif how == "relative to a directory fd":
        opening = [{"op": "open", "path": pools.prefix, "as": "d", "extra": os.O_DIRECTORY},
                   {"op": "open", "path": "ro", "dir": "d"}]
    elif how == "relative to the working directory":
        opening = [{"op": "chdir", "path": pools.prefix}, {"op": "open", "path": "./ro"}]
    elif how == "hard link outside the prefix":
        link = names.outside("hl")
        if not link.exists():
            names.hardlink(link, ro)
        opening = [{"op": "open", "path": str(link)}]
    elif how == "dup of a pool fd":
        opening = [{"op": "open", "path": ro, "as": "orig"}, {"op": "dup", "fd": "orig", "as": "f"}]
    else:
        raise AssertionError(how)
    steps = [{"op": "go"}, *opening,
             {"op": "map", "len": 4 * KIB, "keep": "m1"},
             {"op": "go"},
             {"op": "map", "len": 4 * KIB}]
    return steps, int(how == "'..' under the prefix")


BYPASSES = ["symlink outside the prefix", "'..' under the prefix", "'..' from a folder above the prefix",
            "relative to a directory fd", "relative to the working directory",
            "hard link outside the prefix", "dup of a pool fd"]


@pytest.mark.parametrize("how", BYPASSES)
def test_pool_reached_without_its_name(how, audit, pools, names, spawn, bystander, own_cgroup_id):
    """The call does not see the pool (no event, nothing counted by the
    kernel); the kernel notices the mmap of an fd it does not know, and the
    agent finds the mapping by inode at once and counts it once, for the
    offender only (a granted process doing the same is not counted), and
    hands the fd to the kernel, so that the next mmap through it is checked
    at the call. The full sweep after it counts nothing more."""
    steps, unresolved = bypass_steps(names, how)
    offender, granted = spawn(steps), spawn(steps)
    audit.grant(pools.config({"ro": [SandboxGrant(pids=[granted.pid], access="ro")]}))
    ro_id = audit.pool_id(pools.path("ro"))
    before = Counts(audit)
    found = {(own_cgroup_id, "unauthorized", "audit"): 1}
    results = {offender: offender.go()}
    detected(how, time.monotonic(), lambda: before.delta()[1] == found)
    results[granted] = granted.go()
    audit.probe.settle()
    for c, res in results.items():
        assert res[-1] == {"ok": True, "errno": 0}, res
    fd = {c: res[-2]["fd"] for c, res in results.items()}
    # At the call: nothing seen (the '..' under the prefix counted as unresolved).
    assert (_rule_events(audit, offender), _rule_events(audit, granted)) == ([], [])
    assert before.delta() == ({}, found, 2 * unresolved)
    assert all(audit.pool_fd_known(c, fd[c]) for c in (offender, granted))

    # Through the adopted fd the next mmap is judged at the call, as its pool.
    for c in (offender, granted):
        assert c.go() == [{"ok": True, "errno": 0}]
    assert _rule_events(audit, offender) == [("unauthorized", ro_id, fd[offender])]
    assert _rule_events(audit, granted) == []
    audit.probe.settle()
    audit.probe.sweep()  # the first mapping is not counted twice, the second was judged
    assert before.delta() == ({(own_cgroup_id, "unauthorized", "audit"): 1}, found,
                              2 * unresolved)
    assert _rule_events(audit, bystander) == []
    for c in (offender, granted):
        assert c.wait() == 0


def test_pool_mapped_by_a_forked_child_through_an_inherited_fd(audit, pools, spawn, bystander,
                                                               own_cgroup_id):
    parent = spawn([{"op": "go"}, {"op": "open", "path": pools.path("ro")},
                    {"op": "fork_map", "len": 4 * KIB}, {"op": "go"}])  # (its child holds stdout)
    audit.grant(pools.config({"ro": [SandboxGrant(pids=[parent.pid], access="ro")]}))
    before = Counts(audit)
    opened, forked = parent.go()
    t0 = time.monotonic()
    spawn.grandchildren.append(forked["gpid"])
    assert forked["ok"]
    # The fd was tracked for the parent (granted), not for its child, whose
    # mmap the kernel noticed.
    found = {(own_cgroup_id, "unauthorized", "audit"): 1}
    detected("inherited fd", t0, lambda: before.delta()[1] == found)
    audit.probe.settle()
    audit.probe.sweep()
    assert before.delta() == ({}, found, 0)
    table = audit.probe.bpf["sandbox_pool_fds"]
    assert any(k.tgid == forked["gpid"] and k.fd == opened["fd"] for k in table)
    assert _rule_events(audit, bystander) == []


def test_pool_mapping_inherited_across_fork(audit, pools, spawn, bystander, own_cgroup_id):
    """A granted process maps a pool (judged at the call), then forks: the
    child holds the mapping without any mmap of its own; the kernel notices
    the fork of a process that maps a pool, and the agent judges the child's
    maps (its pid has no grant)."""
    parent = spawn([{"op": "go"}, {"op": "open", "path": pools.path("ro")},
                    {"op": "map", "len": 4 * KIB, "keep": "m"},
                    {"op": "fork_map", "fd": "anon", "len": 4 * KIB}, {"op": "go"}])
    audit.grant(pools.config({"ro": [SandboxGrant(pids=[parent.pid], access="ro")]}))
    before = Counts(audit)
    opened, mapped, forked = parent.go()
    t0 = time.monotonic()
    spawn.grandchildren.append(forked["gpid"])
    assert mapped["ok"] and forked["ok"]
    found = {(own_cgroup_id, "unauthorized", "audit"): 1}
    detected("mapping inherited across fork", t0, lambda: before.delta()[1] == found)
    audit.probe.settle()
    audit.probe.sweep()
    assert before.delta() == ({}, found, 0)
    assert _rule_events(audit, parent) == [] and _rule_events(audit, bystander) == []


# -- names under the prefix that the path string judges wrong -----------------------
def test_symlink_in_the_prefix_pointing_out_of_it(audit, pools, names, spawn, bystander,
                                                  own_cgroup_id):
    """The agent watches the prefix's folder: a symlink made there that
    points out of every pool becomes, at once, an alias that leads to no
    pool (no periodic walk needed): what is opened through it is not tracked,
    not counted. (Opened before the agent saw it, the path string would
    judge it a file of the prefix without grants.)"""
    audit.grant(pools.config())
    t0 = time.monotonic()
    evil = names.symlink(pools.dir / "evil", pools.outside)
    detected("symlink in the prefix: alias", t0,
             lambda: audit.probe.index.aliases == {str(evil): (NOT_A_POOL, 0)})
    steps = [{"op": "go"}, {"op": "open", "path": str(evil)},
             {"op": "map", "len": 4 * KIB, "keep": "m"}, {"op": "go"}]
    child = spawn(steps)
    before = Counts(audit)
    (opened, mapped) = child.go()
    assert mapped["ok"]
    audit.probe.settle()
    assert _rule_events(audit, child) == [] and not audit.pool_fd_known(child, opened["fd"])
    audit.probe.sweep()
    assert before.delta() == ({}, {}, 0)
    assert _rule_events(audit, bystander) == []


@pytest.mark.parametrize("kind", ["symlink", "hard link"])
def test_other_name_of_a_pool_in_the_prefix(kind, audit, pools, names, spawn, own_cgroup_id):
    """Another name under the prefix for pool "rw": the agent sees it made
    and writes it as an alias of "rw" at once, so the call judges it as "rw"
    itself (granted: nothing; not granted: "rw" by id)."""
    rw = pools.path("rw")
    steps = [{"op": "go"}, {"op": "open", "path": pools.path("alias"), "mode": "rw"},
             {"op": "map", "len": 4 * KIB, "prot": "rw"}]
    granted, stranger = spawn(steps), spawn(steps)
    audit.grant(pools.config({"rw": [SandboxGrant(pids=[granted.pid], access="rw")]}))
    rw_id = audit.pool_id(rw)
    t0 = time.monotonic()
    (names.symlink if kind == "symlink" else names.hardlink)(pools.path("alias"), rw)
    detected(f"{kind} in the prefix: alias", t0,
             lambda: audit.probe.index.aliases == {pools.path("alias"): (rw_id, 0)})
    before = Counts(audit)
    for c in (granted, stranger):
        (opened, mapped) = c.go()
        assert mapped["ok"] and c.wait() == 0
    audit.probe.settle()
    assert _rule_events(audit, granted) == []
    assert _rule_events(audit, stranger) == [("unauthorized", rw_id, opened["fd"])]
    assert before.delta() == ({(own_cgroup_id, "unauthorized", "audit"): 1}, {}, 0)


# -- pools replaced while mapped ----------------------------------------------------------
@pytest.mark.parametrize("how", ["rename over", "unlink and recreate"])
def test_pool_replaced_while_mapped(how, audit, pools, spawn, own_cgroup_id):
    """A mapping stays on the file it was made of. An fd opened before the
    replacement keeps naming the pool (judged at the call as that pool, even
    after a sweep); the mapping of the old file is no pool mapping for the
    sweep; a process that opens the name now gets the new file, a pool."""
    path = pools.path("capped")
    old = spawn([{"op": "go"}, {"op": "open", "path": path},
                 {"op": "map", "len": 4 * KIB, "keep": "m"}, {"op": "go"},
                 {"op": "map", "len": 4 * KIB}])
    audit.grant(pools.config())
    capped_id = audit.pool_id(path)
    before = Counts(audit)
    (opened, first) = old.go()
    assert first["ok"]
    if how == "rename over":
        new = Path(path + ".new")
        new.write_bytes(bytes(128 * KIB))
        os.rename(new, path)
    else:
        os.unlink(path)
        Path(path).write_bytes(bytes(128 * KIB))
    audit.probe.sweep()
    assert audit.pool_fd_known(old, opened["fd"])
    (second,) = old.go()
    assert second["ok"] and old.wait() == 0
    fresh = spawn([{"op": "go"}, {"op": "open", "path": path}, {"op": "map", "len": 4 * KIB}])
    (fresh_fd, mapped) = fresh.go()
    assert mapped["ok"] and fresh.wait() == 0
    assert _rule_events(audit, old) == [("unauthorized", capped_id, opened["fd"])] * 2
    assert _rule_events(audit, fresh) == [("unauthorized", capped_id, fresh_fd["fd"])]
    assert before.delta() == ({(own_cgroup_id, "unauthorized", "audit"): 3}, {}, 0)


# -- permissions changed after the mmap ----------------------------------------------------
def test_mprotect_after_an_allowed_mmap(audit, pools, spawn, bystander, own_cgroup_id):
    """A read-only grant, a read-only shared mapping (allowed at the call),
    then mprotect to read-write: the kernel notices the mprotect of a process
    that maps a pool, and the agent finds the writable shared mapping of a
    read-only pool in its maps; counted once while it stays mapped."""
    child = spawn([{"op": "go"}, {"op": "open", "path": pools.path("ro"), "mode": "rw"},
                   {"op": "map", "len": 8 * KIB, "keep": "m"}, {"op": "go"},
                   {"op": "mprotect", "m": "m", "prot": "rw"}, {"op": "go"}])
    audit.grant(pools.config({"ro": [SandboxGrant(pids=[child.pid], access="ro")]}))
    before = Counts(audit)
    (_, mapped) = child.go()
    assert mapped["ok"]
    audit.probe.settle()
    audit.probe.sweep(full=True)
    assert before.delta() == ({}, {}, 0)
    assert child.go() == [{"ok": True, "errno": 0}]
    found = {(own_cgroup_id, "write_on_readonly", "audit"): 1}
    detected("mprotect to read-write", time.monotonic(), lambda: before.delta()[1] == found)
    audit.probe.settle()
    assert before.delta() == ({}, found, 0)
    audit.probe.sweep(full=True)   # still mapped: still one
    assert before.delta() == ({}, found, 0)
    assert _rule_events(audit, child) == [] and _rule_events(audit, bystander) == []


# -- enforce -----------------------------------------------------------------------------
def test_enforce_kills_the_bypassing_offender_only(pools, names, spawn, bystander, own_cgroup_id):
    """Enforce: the offender that reached the pool through a symlink is killed
    as soon as the agent resolved the notice of its mmap (no sweep)."""
    link = names.symlink(names.outside("elink"), pools.path("ro"))
    steps = [{"op": "go"}, {"op": "open", "path": str(link)},
             {"op": "map", "len": 4 * KIB, "keep": "m"}, {"op": "go"}]
    offender, granted = spawn(steps), spawn(steps)
    h = Harness(pools.config({"ro": [SandboxGrant(pids=[granted.pid], access="ro")]}, mode="enforce"))
    try:
        for c in (offender, granted):
            assert c.go()[-1] == {"ok": True, "errno": 0}   # not seen at the call
            t0 = time.monotonic()
            if c is offender:
                detected("enforce: killed", t0, lambda: offender.proc.poll() is not None)
        h.probe.settle()
        assert offender.wait() == -signal.SIGKILL
        assert granted.proc.poll() is None and bystander.proc.poll() is None
        assert h.probe.sweep_violations() == {(own_cgroup_id, "unauthorized", "kill"): 1}
        assert h.probe.violations() == {}
        assert granted.go() == [] and granted.wait() == 0
    finally:
        h.stop()
