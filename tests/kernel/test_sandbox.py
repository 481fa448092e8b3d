"""Real-kernel tests of the mmap sandbox (bpf/mmap_sandbox.bpf.c): child
processes open and map pool files under a test-only prefix in /dev/shm, and
each rule, grant kind, mode and the span stamping is checked event by event
and against the violation counters."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from pathlib import Path

import pytest

from spanlet import config, events
from spanlet.config import SandboxGrant
from spanlet.cgroups import CgroupResolver, cgroup2_mount
from spanlet.probes.sandbox.probe import SandboxProbe
from sandbox_harness import CAPPED_MAX, KIB, SYSCALLS, Child, Harness, _delta, _own_cgroup

pytestmark = [pytest.mark.kernel,
              # BCC 0.26 warns about every str argument (it wants bytes).
              pytest.mark.filterwarnings("ignore:not a bytes object:DeprecationWarning")]

PROT = {"r": 1, "rw": 3, "rx": 5, "rwx": 7}
MAP_FLAGS = {"shared": 1, "private": 2}




@pytest.fixture
def spawn():
    """Children of one test, ended by pid at teardown whatever happened."""
    made: list[Child] = []

    def _spawn(steps: list[dict]) -> Child:
        child = Child(steps)
        made.append(child)
        return child

    yield _spawn
    for child in made:
        child.end()


@pytest.fixture(scope="module")
def cgroups():
    """A test cgroup with a child cgroup under the cgroup2 mount."""
    resolver = CgroupResolver(cgroup2_mount(Path("/proc/self/mountinfo").read_text()))
    name = f"spanlet_sbx_{secrets.token_hex(4)}"
    outer = Path(resolver.mount) / name
    inner = outer / "inner"
    home = resolver.directory(_own_cgroup())
    try:
        outer.mkdir()
        inner.mkdir()
        yield resolver, name, outer, inner
    finally:
        for d in (inner, outer):
            if not d.exists():
                continue
            for pid in (d / "cgroup.procs").read_text().split():
                try:  # a straggler goes home so that the directory can go
                    (home / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            d.rmdir()


def _move(child: Child, cgroup_dir: Path) -> None:
    (cgroup_dir / "cgroup.procs").write_text(str(child.pid))
    assert str(child.pid) in (cgroup_dir / "cgroup.procs").read_text().split()


def _assert_one_event(evs, *, rule: str, child: Child, pool_id: int, length: int, prot: int,
                      flags: int, fd: int, action: str = "audit", cgroup_id: int | None = None,
                      max_bytes: int = 0):
    assert len(evs) == 1, [e.as_dict() for e in evs]
    e = evs[0]
    assert e.kind == events.Kind.SANDBOX
    assert events.Rule(e.rule).name == rule
    assert events.Action(e.action).name == action
    assert (e.hdr.pid, e.hdr.tid) == (child.pid, child.tid)
    assert (e.pool_id, e.len, e.prot, e.flags, e.fd) == (pool_id, length, prot, flags, fd)
    assert e.pool_max_bytes == max_bytes
    assert e.addr == 0
    if cgroup_id is not None:
        assert e.hdr.cgroup_id == cgroup_id
    return e


# pool, grant (None: none), open mode, len, offset, prot, flags, expected rule
RULE_CASES = {
    "ro_grant_read": ("ro", "ro", "ro", 64 * KIB, 0, "r", "shared", None),
    "ro_grant_private_write_is_cow": ("ro", "ro", "ro", 64 * KIB, 0, "rw", "private", None),
    "rw_grant_shared_write": ("rw", "rw", "rw", 64 * KIB, 0, "rw", "shared", None),
    "capped_exactly_max": ("capped", "ro", "ro", CAPPED_MAX, 0, "r", "shared", None),
    "no_grant": ("ro", None, "ro", 64 * KIB, 0, "r", "shared", "unauthorized"),
    "ro_grant_shared_write": ("ro", "ro", "rw", 64 * KIB, 0, "rw", "shared", "write_on_readonly"),
    "exec": ("rw", "rw", "ro", 4 * KIB, 0, "rx", "private", "exec"),
    "oversize_by_len": ("capped", "ro", "ro", 2 * CAPPED_MAX, 0, "r", "shared", "oversize"),
    "oversize_by_offset": ("capped", "ro", "ro", CAPPED_MAX, 4 * KIB, "r", "shared", "oversize"),
    # Several rules broken at once: the first in the documented order wins.
    "all_broken_no_grant": ("capped", None, "rw", 2 * CAPPED_MAX, 0, "rwx", "shared",
                            "unauthorized"),
    "all_broken_ro_grant": ("capped", "ro", "rw", 2 * CAPPED_MAX, 0, "rwx", "shared",
                            "write_on_readonly"),
    "exec_and_oversize_rw_grant": ("capped", "rw", "rw", 2 * CAPPED_MAX, 0, "rwx", "shared",
                                   "exec"),
}


@pytest.mark.parametrize("case", list(RULE_CASES))
def test_rule(case, audit, pools, spawn, own_cgroup_id):
    pool, access, open_mode, length, off, prot, flags, rule = RULE_CASES[case]
    child = spawn([
        {"op": "go"},
        {"op": "open", "path": pools.path(pool), "mode": open_mode, "as": "f"},
        {"op": "open", "path": str(pools.outside), "mode": "rw", "as": "o"},
        {"op": "map", "fd": "f", "len": length, "off": off, "prot": prot, "flags": flags},
        # Neither a plain file nor anonymous memory is ever reported.
        {"op": "map", "fd": "o", "len": 8 * KIB, "prot": "rwx", "flags": "shared"},
        {"op": "map", "fd": "anon", "len": 4 * KIB, "prot": "rwx", "flags": "private"},
        {"op": "close", "fd": "f"},
        {"op": "close", "fd": "o"},
    ])
    grants = {pool: [SandboxGrant(pids=[child.pid], access=access)]} if access else {}
    audit.grant(pools.config(grants))
    before = audit.probe.violations()
    opened, _, mapped, outside, anon = child.go()
    assert child.wait() == 0
    # Audit never stands in the way (an exec mapping may still fail where
    # /dev/shm is mounted noexec, as in many containers).
    assert mapped["ok"] or (rule == "exec" and mapped["errno"] == 1), mapped
    assert outside["ok"] and anon["ok"]

    evs = audit.events_of(child)
    if rule is None:
        assert evs == []
        assert _delta(before, audit.probe.violations()) == {}
        return
    _assert_one_event(evs, rule=rule, child=child, pool_id=audit.pool_id(pools.path(pool)),
                      length=length, prot=PROT[prot], flags=MAP_FLAGS[flags], fd=opened["fd"],
                      cgroup_id=own_cgroup_id, max_bytes=CAPPED_MAX if pool == "capped" else 0)
    assert _delta(before, audit.probe.violations()) == {(own_cgroup_id, rule, "audit"): 1}


def test_unlisted_file_and_unnormalised_paths(audit, pools, spawn, own_cgroup_id):
    """A file under the prefix that no pool names is a pool without grants;
    '//' and '/./' anywhere in the path do not hide a configured pool."""
    ro = pools.path("ro")
    odd = [ro.replace("/dev/", "//dev/./"),                 # before the first directory
           ro.replace("/dev/shm/", "/dev/./shm/"),          # after /dev/
           ro.replace("/dev/shm/", "/dev/shm//"),           # after /dev/shm/
           ro.replace("/ro", "/./ro")]                      # inside the prefix
    steps = [{"op": "go"}, {"op": "open", "path": pools.path("unlisted"), "as": "u"},
             {"op": "map", "fd": "u", "len": 8 * KIB}]
    for i, path in enumerate(odd):
        steps += [{"op": "open", "path": path, "as": str(i)},
                  {"op": "map", "fd": str(i), "len": 4 * KIB}]
    child = spawn(steps)
    # The child may map rw and capped; ro is granted to someone else.
    mine = [SandboxGrant(pids=[child.pid], access="rw")]
    audit.grant(pools.config({"ro": [SandboxGrant(pids=[os.getpid()])],
                              "rw": mine, "capped": mine}))
    before = audit.probe.violations()
    results = child.go()
    assert child.wait() == 0 and all(r["ok"] for r in results[1::2])
    fds = [r["fd"] for r in results[0::2]]

    unlisted_id = audit.probe.policy.prefixes[pools.prefix][1]
    assert audit.probe.pool_path(unlisted_id) == pools.prefix + "*"
    u_ev, *odd_evs = audit.events_of(child)
    _assert_one_event([u_ev], rule="unauthorized", child=child, pool_id=unlisted_id,
                      length=8 * KIB, prot=1, flags=1, fd=fds[0])
    assert len(odd_evs) == len(odd)
    for ev, fd in zip(odd_evs, fds[1:]):
        _assert_one_event([ev], rule="unauthorized", child=child,
                          pool_id=audit.pool_id(ro), length=4 * KIB, prot=1, flags=1, fd=fd)
    assert audit.probe.pool_path(odd_evs[0].pool_id) == ro
    assert _delta(before, audit.probe.violations()) == {
        (own_cgroup_id, "unauthorized", "audit"): 1 + len(odd)}


@pytest.mark.parametrize("syscall", sorted(SYSCALLS))
def test_other_open_syscalls_are_watched(syscall, audit, pools, spawn):
    """A pool opened with open(2) or openat2(2) directly is still a pool."""
    child = spawn([{"op": "go"},
                   {"op": "open_sys", "syscall": syscall, "path": pools.path("ro")},
                   {"op": "map", "len": 4 * KIB}])
    audit.grant(pools.config())
    opened, mapped = child.go()
    assert mapped["ok"] and child.wait() == 0
    _assert_one_event(audit.events_of(child), rule="unauthorized", child=child,
                      pool_id=audit.pool_id(pools.path("ro")), length=4 * KIB, prot=1, flags=1,
                      fd=opened["fd"])


def test_grants_by_cgroup_cover_descendants(audit, pools, spawn, cgroups, own_cgroup_id):
    resolver, name, outer, inner = cgroups
    steps = [
        {"op": "go"},
        {"op": "open", "path": pools.path("ro"), "mode": "rw", "as": "a"},
        {"op": "open", "path": pools.path("rw"), "mode": "rw", "as": "b"},
        {"op": "map", "fd": "a", "len": 4 * KIB, "prot": "r"},
        {"op": "map", "fd": "a", "len": 4 * KIB, "prot": "rw"},
        {"op": "map", "fd": "b", "len": 4 * KIB, "prot": "rw"},
    ]
    in_outer, in_inner, outside = spawn(steps), spawn(steps), spawn(steps)
    _move(in_outer, outer)
    _move(in_inner, inner)
    outer_id, inner_id = resolver.id(name), resolver.id(f"{name}/inner")
    assert outer_id == outer.stat().st_ino and inner_id != outer_id
    # ro: the outer cgroup, named relative to the mount, read-only.
    # rw: the inner one, named as /proc/<pid>/cgroup shows it, read-write.
    audit.grant(pools.config({"ro": [SandboxGrant(cgroups=[name], access="ro")],
                              "rw": [SandboxGrant(cgroups=[f"/{name}/inner"], access="rw")]}))
    before = audit.probe.violations()
    for child in (in_outer, in_inner, outside):
        assert all(r["ok"] for r in child.go()[2:])
        assert child.wait() == 0

    ro_id, rw_id = audit.pool_id(pools.path("ro")), audit.pool_id(pools.path("rw"))
    ev_outer = audit.events_of(in_outer)
    ev_inner = audit.events_of(in_inner)
    ev_outside = audit.events_of(outside)
    # outer: ro read fine, ro shared write breaks the ro grant, rw not granted.
    assert [(events.Rule(e.rule).name, e.pool_id, e.hdr.cgroup_id) for e in ev_outer] == [
        ("write_on_readonly", ro_id, outer_id), ("unauthorized", rw_id, outer_id)]
    # inner: the outer grant covers it for ro; its own grant allows rw.
    assert [(events.Rule(e.rule).name, e.pool_id, e.hdr.cgroup_id) for e in ev_inner] == [
        ("write_on_readonly", ro_id, inner_id)]
    # elsewhere: nothing granted.
    assert [(events.Rule(e.rule).name, e.pool_id, e.hdr.cgroup_id) for e in ev_outside] == [
        ("unauthorized", ro_id, own_cgroup_id), ("unauthorized", ro_id, own_cgroup_id),
        ("unauthorized", rw_id, own_cgroup_id)]
    assert _delta(before, audit.probe.violations()) == {
        (outer_id, "write_on_readonly", "audit"): 1,
        (outer_id, "unauthorized", "audit"): 1,
        (inner_id, "write_on_readonly", "audit"): 1,
        (own_cgroup_id, "unauthorized", "audit"): 3,
    }


def test_fds_opened_before_start_are_found(pools, spawn, own_cgroup_id):
    """An agent restart must not leave running processes outside the sandbox."""
    child = spawn([
        {"op": "open", "path": pools.path("ro"), "as": "f"},
        {"op": "go"},
        {"op": "map", "fd": "f", "len": 4 * KIB},
    ])
    (opened,) = child.before_go
    late = Harness(pools.config())
    try:
        assert late.pool_fd_known(child, opened["fd"])
        (mapped,) = child.go()
        assert mapped["ok"] and child.wait() == 0
        _assert_one_event(late.events_of(child), rule="unauthorized", child=child,
                          pool_id=late.pool_id(pools.path("ro")), length=4 * KIB, prot=1,
                          flags=1, fd=opened["fd"], cgroup_id=own_cgroup_id)
    finally:
        late.stop()


def test_refresh_forgets_fds_closed_without_close(audit, pools, spawn):
    """close_range(2) is not close(2): the fd number stays remembered as a pool
    until refresh() sweeps it, after which its reuse (a memfd) is nobody's
    business."""
    child = spawn([
        {"op": "go"},
        {"op": "open", "path": pools.path("ro"), "as": "keep"},
        {"op": "open", "path": pools.path("ro"), "as": "gone"},
        {"op": "close_range", "fd": "gone"},
        {"op": "memfd", "as": "m", "size": 8 * KIB},
        {"op": "go"},
        {"op": "map", "fd": "m", "len": 8 * KIB, "prot": "rw"},
        {"op": "map", "fd": "keep", "len": 4 * KIB},
    ])
    audit.grant(pools.config())
    keep, gone, closed, memfd = child.go()
    assert closed["closed"] == gone["fd"] == memfd["fd"]  # the number was reused
    assert audit.pool_fd_known(child, memfd["fd"])
    audit.probe.refresh()
    assert not audit.pool_fd_known(child, memfd["fd"])
    assert audit.pool_fd_known(child, keep["fd"])  # a live pool fd stays
    m_map, keep_map = child.go()
    assert m_map["ok"] and keep_map["ok"] and child.wait() == 0
    evs = audit.events_of(child)
    assert [(e.fd, events.Rule(e.rule).name) for e in evs] == [(keep["fd"], "unauthorized")]


def test_enforce_kills_offender_and_spares_bystander(pools, spawn, own_cgroup_id):
    bystander = spawn([
        {"op": "go"},
        {"op": "open", "path": pools.path("ro")},
        {"op": "map", "len": 64 * KIB},
        {"op": "go"},
        {"op": "map", "len": 64 * KIB},
    ])
    offender = spawn([
        {"op": "go"},
        {"op": "open", "path": pools.path("ro")},
        {"op": "map", "len": 64 * KIB},
        {"op": "map", "len": 64 * KIB},
    ])
    sb = pools.config({"ro": [SandboxGrant(pids=[bystander.pid], access="ro")]}, mode="enforce")
    h = Harness(sb)
    try:
        (_, first) = bystander.go()
        assert first["ok"]
        opened, *rest = offender.go()
        assert rest == []  # it never said how its mmap went
        assert offender.wait() == -9
        (second,) = bystander.go()
        assert second["ok"] and bystander.wait() == 0
        assert h.events_of(bystander) == []
        _assert_one_event(h.events_of(offender), rule="unauthorized", action="kill",
                          child=offender, pool_id=h.pool_id(pools.path("ro")), length=64 * KIB,
                          prot=1, flags=1, fd=opened["fd"], cgroup_id=own_cgroup_id)
        assert h.probe.violations() == {(own_cgroup_id, "unauthorized", "kill"): 1}
    finally:
        h.stop()


def test_violation_carries_the_threads_span_and_lands_in_its_row(pools, spawn):
    from spanlet.probes.span_ctx import SpanCtxProbe

    cfg = config.load(env={})
    span_ctx = SpanCtxProbe(cfg)
    assert span_ctx.start().attached, span_ctx.status.reason
    h = None
    try:
        h = Harness(pools.config(), pin_dir=span_ctx.shared_pin_dir())
        child = spawn([{"op": "go"}, {"op": "open", "path": pools.path("ro")},
                       {"op": "map", "len": 4 * KIB}])
        bare = spawn([{"op": "go"}, {"op": "open", "path": pools.path("ro")},
                      {"op": "map", "len": 4 * KIB}])
        trace_id, span_id = secrets.token_bytes(16), int.from_bytes(secrets.token_bytes(8), "big")
        span_ctx.set(child.tid, trace_id, span_id, events.Modality.image)
        for c in (child, bare):
            c.go()
            assert c.wait() == 0
        (ev,) = h.events_of(child)
        assert (bytes(ev.hdr.trace_id), ev.hdr.span_id) == (trace_id, span_id)
        assert ev.hdr.modality == events.Modality.image
        (ev_bare,) = h.events_of(bare)
        assert (bytes(ev_bare.hdr.trace_id), ev_bare.hdr.span_id) == (bytes(16), 0)
        # the violation is counted in its span's facts row, and only there
        row = span_ctx.facts.take(trace_id, span_id)
        assert row is not None and row.violations == 1 and row.pid == child.pid
        assert (row.launches, row.syncs, row.sync_wait_ns) == (0, 0, 0)
        assert row.cgroup_id == ev.hdr.cgroup_id
        assert [r for r in span_ctx.facts.rows() if r.pid in (child.pid, bare.pid)] == []
    finally:
        if h is not None:
            h.stop()
        span_ctx.stop()


def _bpftool_prog_ids() -> dict[int, str]:
    out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True,
                         check=True).stdout
    return {p["id"]: p.get("name", "") for p in json.loads(out)}


def _prog_id(fd: int) -> int:
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("prog_id:"):
            return int(line.split()[1])
    raise AssertionError(f"fd {fd} is not a BPF program")


def test_stop_removes_every_program(pools):
    h = Harness(pools.config())
    ids = {_prog_id(f.fd) for f in h.probe.bpf.funcs.values()}
    shown = _bpftool_prog_ids()
    names = {fn for _, fn in h.probe.tracepoints}
    assert {"sbx_openat_in", "sbx_openat_out", "sbx_mmap", "sbx_close"} <= names
    assert len(h.probe.status.attachments) == len(names) == len(ids)
    assert {shown[i] for i in ids} == names
    h.stop()
    h.stop()  # safe twice
    # The kernel frees a program when its last reference goes; allow it a
    # moment under load instead of asserting on the first listing.
    deadline = time.monotonic() + 5
    while ids & _bpftool_prog_ids().keys() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ids & _bpftool_prog_ids().keys()
    assert h.probe.bpf is None and not h.probe.status.attached


def test_grant_of_missing_cgroup_is_a_config_error(pools):
    name = f"spanlet_sbx_missing_{secrets.token_hex(4)}"
    cfg = config.load(env={})
    cfg.sandbox = pools.config({"rw": [SandboxGrant(pids=[1]),
                                       SandboxGrant(cgroups=[name], access="rw")]})
    probe = SandboxProbe(cfg)
    st = probe.start()
    assert not st.attached and probe.bpf is None
    mount = cgroup2_mount(Path("/proc/self/mountinfo").read_text())
    assert "sandbox.pools[1].grants[1].cgroups[0]" in st.reason
    assert str(Path(mount) / name) in st.reason
