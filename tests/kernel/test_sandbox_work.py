"""The sandbox's work in /proc does not follow processes and fds that have
nothing to do with a pool: with many processes holding many unrelated open
files, the agent's periodic work (refresh(), due in full) and its notice
reader touch none of them, while a full sweep (sweep(), only at start, on a
policy change or after lost notices) visits every one of their fds; an
mmap by one of them is one notice, resolved by looking at that fd and that
mapping only. Counted by the /proc paths the agent looks at, not timed."""

from __future__ import annotations

import os
from collections import Counter

import pytest

import fd_holders
from spanlet.probes.sandbox import procfs
from sandbox_harness import KIB, Child

pytestmark = [pytest.mark.kernel,
              pytest.mark.filterwarnings("ignore:not a bytes object:DeprecationWarning")]

PROCESSES, FDS, FILES = 40, 250, 25


@pytest.fixture(scope="module")
def holders(tmp_path_factory):
    folder = tmp_path_factory.mktemp("holders")
    exe = fd_holders.build(folder)
    h = fd_holders.Holders(exe, PROCESSES, FDS, fd_holders.files(folder / "files", FILES), FILES)
    try:
        yield h
    finally:
        h.end()


@pytest.fixture
def watch_proc(monkeypatch):
    """watch_proc(pids) -> the /proc paths of those processes that anything
    in this process stats, reads a link of, lists or opens from then on (the
    agent's calls, and nothing else here looks there), in order."""
    def start(pids) -> list[str]:
        wanted = {str(p) for p in pids}
        seen: list[str] = []

        def counting(fn):
            def call(path, *a, **kw):
                if isinstance(path, str) and path.startswith("/proc/") and \
                        path[6:].split("/", 1)[0] in wanted:
                    seen.append(path)
                return fn(path, *a, **kw)
            return call

        for name in ("stat", "readlink", "listdir", "scandir"):
            monkeypatch.setattr(os, name, counting(getattr(os, name)))
        monkeypatch.setattr(procfs, "open", counting(open), raising=False)
        return seen
    return start


def _refresh_due(probe) -> None:
    """refresh() with every periodic step due."""
    probe._last_sweep = probe._last_walk = float("-inf")
    probe.refresh()


def test_periodic_work_does_not_touch_unrelated_fds(audit, pools, holders, watch_proc):
    audit.grant(pools.config())
    seen = watch_proc(holders.pids)
    for _ in range(3):
        _refresh_due(audit.probe)
        audit.probe.settle()
    assert seen == [], "refresh or the notice reader looked at unrelated processes"

    # The full sweep (which the periodic work no longer runs) does look at
    # every fd of every one of them: the watch above can see it.
    audit.probe.sweep()
    per_pid = Counter(int(p.split("/")[2]) for p in seen if "/fd/" in p)
    assert set(per_pid) == set(holders.pids)
    assert min(per_pid.values()) >= FDS


def test_an_unrelated_mmap_costs_that_fd_and_mapping_only(audit, pools, watch_proc):
    """A bystander holding 200 fds maps one unrelated file: a notice, and the
    agent looks at that fd, not at the others."""
    audit.grant(pools.config())
    child = Child([{"op": "open", "path": str(pools.outside), "as": str(i)} for i in range(200)]
                  + [{"op": "go"}, {"op": "map", "fd": "7", "len": 8 * KIB}])
    try:
        fd7 = child.before_go[7]["fd"]
        audit.probe.settle()
        before = dict(audit.probe.work)
        seen = watch_proc([child.pid])
        (mapped,) = child.go()
        assert mapped["ok"]
        audit.probe.settle()
        assert child.wait() == 0
        after = audit.probe.work
        assert after["notices"] > before["notices"] and after["sweeps"] == before["sweeps"]
        fds = {p for p in seen if "/fd/" in p or p.endswith("/fd")}
        assert fds == {f"/proc/{child.pid}/fd/{fd7}"}, sorted(seen)
    finally:
        child.end()


def test_lost_notices_bring_a_full_sweep_bounded_in_time(audit, pools):
    """Notices lost to a full ring: refresh() sweeps in full, then not again
    before sandbox.sweep_interval_s, nor before ten times the last sweep's
    duration."""
    p = audit.probe
    audit.grant(pools.config())
    p._last_sweep = float("-inf")
    p._lost_seen = p.lost_notices() - 1        # as if one notice had been lost
    sweeps = p.work["sweeps"]
    p.refresh()
    assert p.work["sweeps"] == sweeps + 1 and p._lost_seen == p.lost_notices()
    p._lost_seen -= 1
    p.refresh()                                 # within sandbox.sweep_interval_s: not yet
    assert p.work["sweeps"] == sweeps + 1
    p._last_sweep -= p.cfg.sandbox.sweep_interval_s
    p.sweep_seconds = p.cfg.sandbox.sweep_interval_s   # a sweep that took that long
    p.refresh()                                 # due by the interval, not by 10 x its cost
    assert p.work["sweeps"] == sweeps + 1
    p._last_sweep -= 10 * p.sweep_seconds
    p.refresh()
    assert p.work["sweeps"] == sweeps + 2
