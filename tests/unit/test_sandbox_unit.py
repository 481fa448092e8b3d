"""Unit tests of the mmap sandbox's Python side: path normalisation, cgroup
resolution, policy → map contents, map syncing, counters and the /proc fd
scans, without root or BCC."""

from __future__ import annotations

import ctypes
import os
import re

import pytest

from spanlet import config
from spanlet.config import SandboxConfig, SandboxGrant, SandboxPool
from spanlet import cgroups
from spanlet.cgroups import CgroupError
from spanlet.probes.sandbox import policy, procfs
from spanlet.probes.sandbox import probe as sbx
from spanlet.probes.base import BPF_DIR, ProbeError, expand_source


# -- paths --------------------------------------------------------------------------
@pytest.mark.parametrize("raw, norm", [
    ("/dev/shm/tensor_pool/a", "/dev/shm/tensor_pool/a"),
    ("//dev//shm///tensor_pool/a", "/dev/shm/tensor_pool/a"),
    ("/./dev/./shm/./tensor_pool/./a", "/dev/shm/tensor_pool/a"),
    ("/dev/shm/tensor_pool/.", "/dev/shm/tensor_pool/"),
    ("/dev/shm/tensor_pool/.hidden", "/dev/shm/tensor_pool/.hidden"),
    ("/dev/shm/tensor_pool/a.", "/dev/shm/tensor_pool/a."),
    ("/dev/shm/x/../tensor_pool/a", "/dev/shm/x/../tensor_pool/a"),  # '..' is not resolved
    ("relative/./x", "relative/x"),
])
def test_normalise_path(raw, norm):
    assert policy.normalise_path(raw) == norm


@pytest.mark.parametrize("prefix, above", [
    ("/dev/shm/tensor_pool/", ["/dev/", "/dev/shm/"]),
    ("/dev/shm/tp", ["/dev/", "/dev/shm/"]),
    ("/pools/", []),
    ("/pools", []),
    ("/", []),
])
def test_ancestors(prefix, above):
    assert policy.ancestors(prefix) == above


# -- cgroups ------------------------------------------------------------------------
HYBRID_MOUNTINFO = """\
25 1 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def test_cgroup2_mount_found_among_v1_hierarchies():
    assert cgroups.cgroup2_mount(HYBRID_MOUNTINFO) == "/sys/fs/cgroup/unified"


def test_cgroup2_mount_with_escaped_space_and_optional_fields():
    line = "41 31 0:38 / /mnt/cg\\040two rw,relatime shared:9 master:2 - cgroup2 none rw\n"
    assert cgroups.cgroup2_mount(line) == "/mnt/cg two"


def test_no_cgroup2_mount_is_reported():
    with pytest.raises(CgroupError, match="no cgroup2"):
        cgroups.cgroup2_mount(HYBRID_MOUNTINFO.replace("cgroup2 cgroup2", "tmpfs tmpfs"))


@pytest.fixture
def fake_cgroups(tmp_path):
    mount = tmp_path / "cg"
    for d in ("", "pods", "pods/a", "pods/a/ctr"):
        (mount / d).mkdir(exist_ok=True)
        (mount / d / "cgroup.procs").write_text("")
    (mount / "not_a_cgroup").mkdir()
    return cgroups.CgroupResolver(str(mount)), mount


def test_cgroup_paths_resolve_three_ways(fake_cgroups):
    r, mount = fake_cgroups
    ino = (mount / "pods/a").stat().st_ino
    assert r.directory("pods/a") == mount / "pods/a"                 # relative to the mount
    assert r.directory("/pods/a") == mount / "pods/a"                # as /proc/<pid>/cgroup
    assert r.directory(str(mount / "pods/a")) == mount / "pods/a"    # a file system path
    assert r.id("pods/a") == r.id("/pods/a") == r.id(str(mount / "pods/a")) == ino


def test_missing_cgroup_names_the_directory(fake_cgroups):
    r, mount = fake_cgroups
    with pytest.raises(CgroupError) as e:
        r.id("pods/b")
    assert str(mount / "pods/b") in str(e.value)
    with pytest.raises(CgroupError, match="not a cgroup v2 directory"):
        r.id("not_a_cgroup")


# -- policy -------------------------------------------------------------------------
def _sb(pools, prefixes=("/dev/shm/tensor_pool/",), mode="audit") -> SandboxConfig:
    return SandboxConfig(mode=mode, prefixes=list(prefixes), pools=pools)


def _compile(sb, resolver=None, strict=True, ids=None):
    ids = ids or policy.PoolIds()
    cg = resolver.id if resolver else (lambda p: {"a": 100, "b": 200}[p])
    return policy.compile_policy(sb, ids, cg, strict)


def test_policy_map_contents(fake_cgroups):
    r, mount = fake_cgroups
    pol = _compile(_sb([
        SandboxPool(path="/dev/shm/tensor_pool/kv", max_bytes=1 << 30, grants=[
            SandboxGrant(pids=[41, 42], access="ro"),
            SandboxGrant(cgroups=["pods/a"], access="rw"),
        ]),
        SandboxPool(path="/dev/shm/tensor_pool//img", grants=[
            SandboxGrant(pids=[42], access="rw"),
            SandboxGrant(pids=[42], cgroups=["/pods/a/ctr"], access="ro"),
        ]),
    ]), r)
    a, ctr = (mount / "pods/a").stat().st_ino, (mount / "pods/a/ctr").stat().st_ino
    unlisted = policy.UNLISTED_POOL_BASE
    assert pol.prefixes == {"/dev/shm/tensor_pool/": (policy.PREFIX_FULL, unlisted, 21),
                            "/dev/": (policy.PREFIX_PARTIAL, 0, 5),
                            "/dev/shm/": (policy.PREFIX_PARTIAL, 0, 9)}
    assert pol.pools == {"/dev/shm/tensor_pool/kv": (1, 1 << 30),
                         "/dev/shm/tensor_pool/img": (2, 0)}   # normalised like the kernel does
    assert pol.grants == {
        (1, policy.GRANT_PID, 41): 1, (1, policy.GRANT_PID, 42): 1, (1, policy.GRANT_CGROUP, a): 2,
        (2, policy.GRANT_PID, 42): 2,          # ro and rw for one pid: the wider one
        (2, policy.GRANT_CGROUP, ctr): 1,
    }
    assert pol.pool_paths == {1: "/dev/shm/tensor_pool/kv", 2: "/dev/shm/tensor_pool/img",
                              unlisted: "/dev/shm/tensor_pool/*"}


def test_pool_ids_survive_policy_changes():
    ids = policy.PoolIds()
    p1 = _compile(_sb([SandboxPool(path="/dev/shm/tensor_pool/x"),
                       SandboxPool(path="/dev/shm/tensor_pool/y")]), ids=ids)
    p2 = _compile(_sb([SandboxPool(path="/dev/shm/tensor_pool/y"),
                       SandboxPool(path="/dev/shm/tensor_pool/z")]), ids=ids)
    assert p1.pools["/dev/shm/tensor_pool/y"] == p2.pools["/dev/shm/tensor_pool/y"] == (2, 0)
    assert p2.pools["/dev/shm/tensor_pool/z"] == (3, 0)


def test_directory_longer_than_a_prefix_answers_as_that_prefix():
    pol = _compile(_sb([], prefixes=["/dev", "/dev/shm/tensor_pool/", "/srv/a/b/c/"]))
    dev_id = pol.prefixes["/dev"][1]
    assert pol.prefixes["/dev/"] == (policy.PREFIX_FULL, dev_id, 5)
    assert pol.prefixes["/dev/shm/"] == (policy.PREFIX_FULL, dev_id, 9)
    assert pol.prefixes["/srv/a/b/"] == (policy.PREFIX_PARTIAL, 0, 9)
    assert pol.lookup("/dev/null") == pol.lookup("/dev/shm/x") == (dev_id, 0)


def test_policy_lookup_judges_paths_like_the_kernel():
    pol = _compile(_sb([SandboxPool(path="/dev/shm/tensor_pool/kv", max_bytes=4096)],
                       prefixes=["/dev/shm/tensor_pool/", "/dev/shm/tensor_pool/big/"]))
    assert pol.lookup("/dev/shm/tensor_pool/kv") == (1, 4096)
    assert pol.lookup("//dev/shm/./tensor_pool/kv") == (1, 4096)
    assert pol.lookup("/dev/shm/tensor_pool/other") == (policy.UNLISTED_POOL_BASE, 0)
    assert pol.lookup("/dev/shm/tensor_pool/big/x") == (policy.UNLISTED_POOL_BASE + 1, 0)
    assert pol.lookup("/dev/shm/tensor_pool_other") is None
    assert pol.lookup("/dev/null") is None


def test_missing_cgroup_is_a_config_error_naming_the_key(fake_cgroups):
    r, mount = fake_cgroups
    sb = _sb([SandboxPool(path="/dev/shm/tensor_pool/a"),
              SandboxPool(path="/dev/shm/tensor_pool/b", grants=[
                  SandboxGrant(pids=[7]), SandboxGrant(cgroups=["pods/a", "pods/gone"])])])
    with pytest.raises(ProbeError) as e:
        _compile(sb, r)
    msg = str(e.value)
    assert msg.startswith("sandbox.pools[1].grants[1].cgroups[1]: ")
    assert str(mount / "pods/gone") in msg
    # refresh() compiles leniently: the rest of the policy stands.
    pol = _compile(sb, r, strict=False)
    assert len(pol.problems) == 1 and "sandbox.pools[1].grants[1].cgroups[1]" in pol.problems[0]
    assert (2, policy.GRANT_CGROUP, (mount / "pods/a").stat().st_ino) in pol.grants


def test_duplicate_pool_is_a_config_error():
    sb = _sb([SandboxPool(path="/dev/shm/tensor_pool/a"),
              SandboxPool(path="/dev/shm/tensor_pool//a")])
    with pytest.raises(ProbeError, match=r"sandbox.pools\[1\].path.*sandbox.pools\[0\].path"):
        _compile(sb)


def test_config_rejects_what_the_sandbox_cannot_match():
    with pytest.raises(config.ConfigError, match=r"'\.\.'"):
        config.load(env={}, overrides=["sandbox.prefixes=/dev/shm/../tmp/"])
    with pytest.raises(config.ConfigError, match="sandbox.pools.0.grants.0"):
        config.load(env={"SPANLET_SANDBOX_POOLS":
                         '[{"path": "/dev/shm/tensor_pool/a", "grants": [{"pids": [0]}]}]'})


# -- consistency with the C side ----------------------------------------------------
def _c_defines() -> dict[str, int]:
    text = expand_source(BPF_DIR / "mmap_sandbox.bpf.c")
    return {m[1]: int(m[2], 0) for m in re.finditer(r"#define (SANDBOX_\w+) (\w+)", text)
            if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", m[2])}


def test_python_constants_match_the_program():
    d = _c_defines()
    assert (d["SANDBOX_PATH_MAX"], d["SANDBOX_PREFIX_FULL"], d["SANDBOX_PREFIX_PARTIAL"]) == (
        policy.PATH_MAX, policy.PREFIX_FULL, policy.PREFIX_PARTIAL)
    assert (d["SANDBOX_GRANT_PID"], d["SANDBOX_GRANT_CGROUP"]) == (policy.GRANT_PID, policy.GRANT_CGROUP)
    assert (d["SANDBOX_ACCESS_RO"], d["SANDBOX_ACCESS_RW"]) == (policy.ACCESS["ro"], policy.ACCESS["rw"])


def _expand_macro(text: str, name: str) -> str:
    """The C with each `name(args)` line replaced by what the macro, as the
    file defines it, makes of it (its parameters pasted where `##p` names them)."""
    m = re.search(rf"^#define {name}\(([^)]*)\)(.*?[^\\])\n", text, re.M | re.S)
    params = [p.strip() for p in m.group(1).split(",")]
    body = m.group(2).replace("\\\n", "\n")

    def expand(call: re.Match) -> str:
        out = body
        args = [a.strip() for a in call.group(1).split(",", len(params) - 1)]
        for p, a in zip(params, args):
            out = out.replace(f"##{p}##", a).replace(f"##{p}", a)
        return "\n".join(line.strip() for line in out.splitlines())
    return re.sub(rf"^{name}\((.*)\)$", expand, text, flags=re.M)


def _expand_open_syscalls(text: str) -> str:
    """The C with the sandbox's program-making macros expanded."""
    return _expand_macro(_expand_macro(text, "SANDBOX_OPEN_SYSCALL"), "SANDBOX_CHANGE_SYSCALL")


def test_optional_open_calls_follow_the_kernel(cfg, monkeypatch):
    monkeypatch.setattr(sbx, "tracepoint_exists", lambda tp: "openat2" in tp)
    probe = sbx.SandboxProbe(cfg)
    flags = probe.cflags()
    assert "-DSANDBOX_TP_OPENAT2" in flags and "-DSANDBOX_TP_OPEN" not in flags
    assert probe.tracepoints == list(sbx.REQUIRED_TRACEPOINTS) + [
        ("syscalls:sys_enter_openat2", "sbx_openat2_in"),
        ("syscalls:sys_exit_openat2", "sbx_openat2_out")]
    # Every program the loader may attach exists in the C source.
    text = _expand_open_syscalls((BPF_DIR / "mmap_sandbox.bpf.c").read_text())
    pairs = list(sbx.REQUIRED_TRACEPOINTS) + [p for ps in sbx.OPTIONAL_TRACEPOINTS.values()
                                              for p in ps]
    for tp, fn in pairs:
        struct = "tracepoint__" + tp.replace(":", "__")
        assert re.search(rf"^int {fn}\(struct {struct} \*args\)", text, re.M), fn
        assert len(fn) <= 15  # what bpftool shows of a program name


def test_mode_is_a_compile_flag(cfg):
    assert "-DSANDBOX_ENFORCE" not in sbx.SandboxProbe(cfg).cflags()
    cfg.sandbox = SandboxConfig(mode="enforce")
    flags = sbx.SandboxProbe(cfg).cflags()
    assert "-DSANDBOX_ENFORCE" in flags
    assert f"-DSANDBOX_MAX_POOLS={policy.MAX_POOLS}" in flags


# -- maps ---------------------------------------------------------------------------
class FakeTable(dict):
    """Enough of a BCC table: Key/Leaf ctypes types and item access."""

    def __init__(self, key, leaf):
        super().__init__()
        self.Key, self.Leaf = key, leaf
        self.writes = 0

    def __setitem__(self, k, v):
        self.writes += 1
        super().__setitem__(bytes(k), bytes(v))

    def __delitem__(self, k):
        super().__delitem__(bytes(k))


class _Path(ctypes.Structure):
    _fields_ = [("path", ctypes.c_char * policy.PATH_MAX)]


class _LpmKey(ctypes.Structure):
    _fields_ = [("prefixlen", ctypes.c_uint32), ("p", _Path)]


class _Prefix(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_uint32), ("unlisted_pool_id", ctypes.c_uint32)]


class _GrantKey(ctypes.Structure):
    _fields_ = [("pool_id", ctypes.c_uint32), ("kind", ctypes.c_uint32), ("id", ctypes.c_uint64)]


def test_prefix_key_layout():
    t = FakeTable(_LpmKey, _Prefix)
    k = policy._prefix_key(t, "/dev/")
    assert k.prefixlen == 40
    assert bytes(k.p)[:6] == b"/dev/\0" and not any(bytes(k.p)[5:])


def test_map_sync_writes_changes_and_removes_stale_entries():
    t = FakeTable(_GrantKey, ctypes.c_uint8)
    m = policy.MapSync(t, policy._grant_key, policy._u8)
    m.sync({(1, 1, 10): 1, (1, 2, 99): 2})
    assert t.writes == 2 and len(t) == 2
    m.sync({(1, 1, 10): 1, (1, 2, 99): 1, (2, 1, 10): 2})
    assert t.writes == 4 and len(t) == 3   # unchanged entries are not rewritten
    m.sync({(2, 1, 10): 2}, remove=False)
    assert len(t) == 3
    m.sync({(2, 1, 10): 2})
    assert len(t) == 1 and bytes(policy._grant_key(t, (2, 1, 10))) in t
    assert m.written == {(2, 1, 10): 2}


class _VKey:
    def __init__(self, cg, rule, action):
        self.cgroup_id, self.rule, self.action = cg, rule, action


def test_violations_are_summed_over_cpus_and_named():
    items = [(_VKey(7, 1, 1), [ctypes.c_uint64(2), ctypes.c_uint64(3)]),
             (_VKey(7, 4, 2), [0, 1]),
             (_VKey(8, 2, 1), [0, 0])]
    assert sbx.sum_violations(items) == {(7, "unauthorized", "audit"): 5,
                                         (7, "oversize", "kill"): 1,
                                         (8, "write_on_readonly", "audit"): 0}


# -- fds from /proc -----------------------------------------------------------------
@pytest.fixture
def fake_proc(tmp_path):
    proc = tmp_path / "proc"
    links = {
        "100/fd/3": "/dev/shm/tensor_pool/kv",
        "100/fd/4": "/dev/shm/tensor_pool/other (deleted)",
        "100/fd/5": "/usr/lib/libc.so.6",
        "100/fd/6": "socket:[1234]",
        "200/fd/9": "/dev/shm/tensor_pool/kv",
    }
    for rel, target in links.items():
        (proc / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, proc / rel)
    (proc / "self").mkdir()
    (proc / "300").mkdir()  # a kernel thread: no fd folder to read
    return proc


def _kv_policy():
    return _compile(_sb([SandboxPool(path="/dev/shm/tensor_pool/kv", max_bytes=8192)]))


def test_scan_finds_pool_fds_opened_before_start(fake_proc):
    found = dict(procfs.scan_pool_fds(_kv_policy(), str(fake_proc)))
    assert found == {(100, 3): (1, 8192), (100, 4): (policy.UNLISTED_POOL_BASE, 0),
                     (200, 9): (1, 8192)}


def test_sweep_finds_fds_that_went_away_or_changed(fake_proc):
    remembered = [((100, 3), (1, 8192)),                   # still the pool
                  ((100, 5), (1, 8192)),                   # number now holds libc
                  ((200, 9), (1, 4096)),                   # the pool's size changed
                  ((555, 3), (1, 8192))]                   # process gone
    assert dict(procfs.stale_pool_fds(remembered, _kv_policy(), str(fake_proc))) == {
        (100, 5): None, (200, 9): (1, 8192), (555, 3): None}


def _head_match(heads, path: str) -> bool:
    """sandbox_head_may_match() of the kernel side, over the table."""
    raw = path.encode()[:policy.HEAD_LEN]
    if not raw or raw[:1] != b"/":
        return False
    if any(raw[i:i + 1] == b"/" and raw[i + 1:i + 2] in (b"/", b".") for i in range(len(raw) - 1)):
        return True
    raw = raw.ljust(policy.HEAD_LEN, b"\0")
    w0, w1 = int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")
    return any(w0 & m0 == v0 and w1 & m1 == v1 for v0, v1, m0, m1 in heads)


def test_prefix_heads_let_only_paths_that_may_be_under_a_prefix_through():
    pol = _compile(_sb([], prefixes=("/dev/shm/tensor_pool/", "/pools/", "/dev/shm/tensor_pool/b/")))
    heads = policy.prefix_heads(pol.prefixes)
    assert len(heads) == 2   # the first 16 bytes of the two /dev/shm prefixes are the same
    through = ["/dev/shm/tensor_pool/kv", "/dev/shm/tensor_", "/pools/a", "/pools/",
               "//dev/shm/tensor_pool/kv", "/dev/./shm/x", "/dev/shm//tensor_pool/kv",
               "/a/../dev/shm/tensor_pool/kv", "/dev/shm/.x"]
    stopped = ["/dev/shm/tensor", "/dev/shm/spanlet_bench_1", "/dev/null", "/pool", "/poolsx/a",
               "relative/dev/shm/tensor_pool/kv", "./pools/a", "", "/usr/lib/libc.so.6"]
    assert [p for p in through if not _head_match(heads, p)] == []
    assert [p for p in stopped if _head_match(heads, p)] == []
    # Whatever normalises to a path under a prefix gets through.
    for p in through + stopped:
        if pol.lookup(p) is not None:
            assert _head_match(heads, p), p


def _bytes_eq(w: int, c: int) -> int:
    """sandbox_bytes_eq() of the kernel side, on 64-bit words."""
    low7, full = 0x7F7F7F7F7F7F7F7F, (1 << 64) - 1
    x = w ^ (c * 0x0101010101010101)
    return ~(((x & low7) + low7) | x | low7) & full


def _has_pair_words(raw: bytes) -> bool:
    """The word-wise "'/' then '/' or '.'" test of sandbox_head_may_match()."""
    raw = raw.ljust(16, b"\0")
    w0, w1 = int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")
    full = (1 << 64) - 1
    s0, s1 = _bytes_eq(w0, ord("/")), _bytes_eq(w1, ord("/"))
    f0, f1 = s0 | _bytes_eq(w0, ord(".")), s1 | _bytes_eq(w1, ord("."))
    return bool((((s0 << 8) & full) & f0) | (((s1 << 8) & full) & f1) | ((s0 >> 56) & f1))


def test_word_wise_pair_test_is_the_byte_loop():
    import random
    rnd = random.Random(20)
    cases = [b"/dev/sh//x", b"/dev/sh/.x", b"/abcdef/", b"/abcdef/x", b"/abcdefg/.", b"x" * 15 + b"/",
             b"/./", b"//", b"/", b"/a.b/c.d/e", b"/\xff/\x80.", b"/\x2e\x2f\xaf"]
    cases += [bytes(rnd.choice(b"/.a\xaf\x2e\x00") for _ in range(16)) for _ in range(5000)]
    for raw in cases:
        raw = raw[:16]
        raw = raw.split(b"\0", 1)[0]
        loop = any(raw[i] == ord("/") and raw[i + 1] in b"/." for i in range(len(raw) - 1))
        assert _has_pair_words(raw) == loop, raw


def test_index_knows_the_file_systems_pools_can_be_on(tmp_path):
    made, later = tmp_path / "pools", tmp_path / "not_yet" / "deeper"
    made.mkdir()
    (made / "kv").write_bytes(b"x")
    pol = _compile(_sb([], prefixes=(f"{made}/", f"{later}/")))
    idx = procfs.index_pools(pol)
    # the folder that exists, and the nearest existing one above the one not made yet
    assert idx.devices == {os.stat(made).st_dev, os.stat(tmp_path).st_dev}
    assert f"{made}/" in idx.folders and not any(f.startswith(str(later)) for f in idx.folders)
    assert (os.stat(made / "kv").st_dev, os.stat(made / "kv").st_ino) in idx.by_inode
