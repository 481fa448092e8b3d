"""Loader of bpf/mmap_sandbox.bpf.c: compiles the sandbox policy of the config
into the program's maps, keeps it current (cgroup ids, stale fds), and reads
the violation counters (metric 5) back. Its programs show as sbx_* in
`bpftool prog show`.

At the call, pools are recognised by the path string given to the open call,
normalised for repeated '/' and '.' components only (the kernel side's header
comment has the full list of what that misses). Behind it runs a sweep by
inode, from /proc (sweep(): at start, then every sandbox.sweep_interval_s from
refresh()): it writes the symlinks and hard links found under the prefixes
into the kernel's pool table as aliases, adopts pool fds the open did not show
(fork, dup, SCM_RIGHTS, symlinks and hard links elsewhere, relative or '..'
paths) so that their next mmap is checked at the call, and judges the pool
mappings in /proc/<pid>/maps that the call did not judge, or that have more
permissions now (mprotect): those are counted as sweep violations, apart
from the call's, and in enforce mode their process is killed. Fds dropped
without close(2) are forgotten by refresh(). 32-bit compat syscalls are not
checked."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from spanlet import events
from spanlet.config import Config, SandboxConfig
from spanlet.kernel import TRACEFS
from spanlet.cgroups import CgroupError, CgroupResolver, cgroup2_mount  # noqa: F401
from spanlet.discovery import PF_KTHREAD
from spanlet.probes.base import Probe, ProbeError, percpu_sum

log = logging.getLogger(__name__)

# Mirrors of the constants in bpf/mmap_sandbox.bpf.c.
PATH_MAX = 256
PREFIX_FULL = 1
PREFIX_PARTIAL = 2
GRANT_PID = 1
GRANT_CGROUP = 2
ACCESS = {"ro": 1, "rw": 2}
# Files under a prefix that no pool names get the pool id of their prefix,
# counted from here, so that an event still says which prefix it fell under.
UNLISTED_POOL_BASE = 0x8000_0000
# Map sizes, passed to the program as -D flags.
MAX_PREFIX_ENTRIES = 1024
MAX_POOLS = 4096
MAX_GRANTS = 65536
MAX_POOL_FDS = 65536
MAX_JUDGED_MAPS = 65536
# Pool id of an alias that leads to no pool (a symlink under a prefix that
# points elsewhere): the kernel does not track what is opened through it.
NOT_A_POOL = 0
# How often refresh() runs the sweep of /proc (fds, maps, the prefixes'
# folders): it reads every process's fd links and the maps of those whose
# mapped size changed, so it runs less often than refresh() itself.
# Entries of the prefixes' folders looked at per sweep, at most.
WALK_LIMIT = 10_000
PROT_READ, PROT_WRITE, PROT_EXEC = 1, 2, 4
MAP_SHARED, MAP_PRIVATE, MAP_SHARED_VALIDATE, MAP_TYPE = 1, 2, 3, 0x0F

# (tracepoint, program) pairs. Without any required one the sandbox has a
# hole (an untracked fd, a stale one, an unchecked mmap), so it runs complete
# or not at all; the optional ones close side doors (a direct open(2) or
# openat2(2) call) where the kernel has them, each behind its -D flag.
REQUIRED_TRACEPOINTS = (
    ("syscalls:sys_enter_openat", "sbx_openat_in"),
    ("syscalls:sys_exit_openat", "sbx_openat_out"),
    ("syscalls:sys_enter_mmap", "sbx_mmap"),
    ("syscalls:sys_exit_mmap", "sbx_mmap_out"),
    ("syscalls:sys_enter_close", "sbx_close"),
)
OPTIONAL_TRACEPOINTS = {
    "SANDBOX_TP_OPENAT2": (("syscalls:sys_enter_openat2", "sbx_openat2_in"),
                           ("syscalls:sys_exit_openat2", "sbx_openat2_out")),
    "SANDBOX_TP_OPEN": (("syscalls:sys_enter_open", "sbx_open_in"),
                        ("syscalls:sys_exit_open", "sbx_open_out")),
}
TRACEFS_DIRS = (TRACEFS, Path("/sys/kernel/debug/tracing"))


def tracepoint_exists(tp: str) -> bool:
    """Checked in tracefs, as BCC does, without importing BCC."""
    category, event = tp.split(":")
    # os.path.isdir: an unreadable tracefs (not root) is "no", not an error.
    return any(os.path.isdir(d / "events" / category / event) for d in TRACEFS_DIRS)


# -- paths ------------------------------------------------------------------------
def normalise_path(path: str) -> str:
    """Repeated '/' collapsed and '.' components dropped, nothing else: the
    exact rule of sandbox_normalise() in the kernel, so that both sides agree
    on a pool's name ('..' is left alone: it needs the file system)."""
    out: list[str] = []
    prev = ""
    for i, c in enumerate(path):
        if c == "/" and prev == "/":
            continue
        if c == "." and prev == "/":
            nxt = path[i + 1] if i + 1 < len(path) else ""
            if nxt in ("/", ""):
                continue
        out.append(c)
        prev = c
    return "".join(out)


def ancestors(prefix: str) -> list[str]:
    """'/dev/shm/tensor_pool/' → ['/dev/', '/dev/shm/']: the directories above
    a prefix (the root aside). The kernel normalises a path only when '/' or
    '.' follows the deepest of them that the path starts with."""
    out, end = [], prefix.find("/", 1)
    while 0 < end < len(prefix) - 1:
        out.append(prefix[: end + 1])
        end = prefix.find("/", end + 1)
    return out


def _check_path(key: str, path: str) -> None:
    if not path.startswith("/"):
        raise ProbeError(f"{key}: {path!r} is not an absolute path")
    if "/../" in path + "/":
        raise ProbeError(f"{key}: {path!r} contains '..', which the sandbox does not resolve")
    if len(path.encode()) >= PATH_MAX:
        raise ProbeError(f"{key}: {path!r} is {len(path.encode())} bytes; at most {PATH_MAX - 1}")


# -- policy -----------------------------------------------------------------------
class PoolIds:
    """Pool ids that stay the same for a path across policy updates, so fds
    remembered in the kernel keep naming the right pool."""

    def __init__(self) -> None:
        self._pools: dict[str, int] = {}
        self._prefixes: dict[str, int] = {}

    def pool(self, path: str) -> int:
        return self._pools.setdefault(path, len(self._pools) + 1)

    def prefix(self, prefix: str) -> int:
        return self._prefixes.setdefault(prefix, UNLISTED_POOL_BASE + len(self._prefixes))


@dataclass
class Policy:
    """The maps' contents, as plain Python values."""
    # LPM entry (a path prefix) → (PREFIX_FULL or PREFIX_PARTIAL, unlisted pool id,
    # bytes of the entry)
    prefixes: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    # normalised pool path → (pool id, max bytes)
    pools: dict[str, tuple[int, int]] = field(default_factory=dict)
    # (pool id, GRANT_PID or GRANT_CGROUP, tgid or cgroup id) → ACCESS value
    grants: dict[tuple[int, int, int], int] = field(default_factory=dict)
    # pool id → path, for the readers of events ('<prefix>*' for unlisted files)
    pool_paths: dict[int, str] = field(default_factory=dict)
    # config keys of cgroups that could not be resolved (non-strict compile)
    problems: list[str] = field(default_factory=list)

    def lookup(self, path: str) -> tuple[int, int] | None:
        """(pool id, max bytes) of a path as the kernel would judge it."""
        path = normalise_path(path)
        best = ""
        for prefix, (kind, _, _) in self.prefixes.items():
            if kind == PREFIX_FULL and path.startswith(prefix) and len(prefix) > len(best):
                best = prefix
        if not best:
            return None
        return self.pools.get(path, (self.prefixes[best][1], 0))


def compile_policy(sb: SandboxConfig, ids: PoolIds,
                   cgroup_id: Callable[[str], int], strict: bool = True) -> Policy:
    """The sandbox section → map contents. A cgroup that cannot be resolved
    raises ProbeError naming its key (strict), or is listed in `problems`."""
    pol = Policy()
    for i, raw in enumerate(sb.prefixes):
        _check_path(f"sandbox.prefixes[{i}]", raw)
        prefix = normalise_path(raw)
        pid = ids.prefix(prefix)
        pol.prefixes[prefix] = (PREFIX_FULL, pid, len(prefix.encode()))
        pol.pool_paths[pid] = prefix + "*"
    fulls = list(pol.prefixes)
    for above in sorted({a for prefix in fulls for a in ancestors(prefix)} - set(fulls)):
        # The trie answers with its longest entry: a directory that is longer
        # than a real prefix it starts with must answer as that prefix would.
        covering = [p for p in fulls if above.startswith(p)]
        if covering:
            pol.prefixes[above] = pol.prefixes[max(covering, key=len)][:2] + (len(above.encode()),)
        else:
            pol.prefixes[above] = (PREFIX_PARTIAL, 0, len(above.encode()))
    if len(pol.prefixes) > MAX_PREFIX_ENTRIES:
        raise ProbeError(f"sandbox.prefixes: {len(pol.prefixes)} prefixes and directories above "
                         f"them; at most {MAX_PREFIX_ENTRIES}")
    first_key: dict[str, str] = {}
    for i, pool in enumerate(sb.pools):
        key = f"sandbox.pools[{i}]"
        _check_path(f"{key}.path", pool.path)
        path = normalise_path(pool.path)
        if path in first_key:
            raise ProbeError(f"{key}.path: {pool.path!r} is the same pool as {first_key[path]}")
        first_key[path] = f"{key}.path"
        pool_id = ids.pool(path)
        pol.pools[path] = (pool_id, pool.max_bytes)
        pol.pool_paths[pool_id] = path
        for j, grant in enumerate(pool.grants):
            access = ACCESS[grant.access]
            targets = [(GRANT_PID, tgid, f"{key}.grants[{j}].pids[{k}]")
                       for k, tgid in enumerate(grant.pids)]
            for k, cg in enumerate(grant.cgroups):
                gkey = f"{key}.grants[{j}].cgroups[{k}]"
                try:
                    targets.append((GRANT_CGROUP, cgroup_id(cg), gkey))
                except (ProbeError, CgroupError) as e:
                    if strict:
                        raise ProbeError(f"{gkey}: {e}") from None
                    pol.problems.append(f"{gkey}: {e}")
            for kind, ident, _ in targets:
                gk = (pool_id, kind, ident)
                pol.grants[gk] = max(access, pol.grants.get(gk, 0))
    if len(pol.pools) > MAX_POOLS:
        raise ProbeError(f"sandbox.pools: {len(pol.pools)} pools; at most {MAX_POOLS}")
    if len(pol.grants) > MAX_GRANTS:
        raise ProbeError(f"sandbox.pools[*].grants: {len(pol.grants)} (pool, pid or cgroup) "
                         f"pairs; at most {MAX_GRANTS}")
    return pol


# -- maps -------------------------------------------------------------------------
def _set_path(holder, path: str) -> None:
    """Write `path` into holder.path (a zeroed char[PATH_MAX])."""
    data = path.encode()
    offset = type(holder).path.offset
    ctypes.memmove(ctypes.addressof(holder) + offset, data, len(data))


def _prefix_key(table, prefix: str):
    k = table.Key()
    k.prefixlen = len(prefix.encode()) * 8
    _set_path(k.p, prefix)
    return k


def _prefix_leaf(table, v: tuple[int, int, int]):
    leaf = table.Leaf()
    leaf.kind, leaf.unlisted_pool_id, leaf.len = v
    return leaf


def _pool_key(table, path: str):
    k = table.Key()
    _set_path(k, path)
    return k


def _pool_ref(table, v: tuple[int, int]):
    leaf = table.Leaf()
    leaf.pool_id, leaf.max_bytes = v
    return leaf


def _grant_key(table, k: tuple[int, int, int]):
    key = table.Key()
    key.pool_id, key.kind, key.id = k
    return key


def _u8(table, v: int):
    return table.Leaf(v)


def _fd_key(table, k: tuple[int, int]):
    key = table.Key()
    key.tgid, key.fd = k
    return key


class MapSync:
    """Brings one BPF map to a wanted content with the fewest writes, keeping
    what it last wrote so that entries of an older policy are removed."""

    def __init__(self, table, key: Callable, leaf: Callable):
        self.table, self._key, self._leaf = table, key, leaf
        self.written: dict = {}

    def sync(self, wanted: dict, remove: bool = True) -> None:
        for k, v in wanted.items():
            if self.written.get(k) != v:
                self.table[self._key(self.table, k)] = self._leaf(self.table, v)
                self.written[k] = v
        if remove:
            for k in [k for k in self.written if k not in wanted]:
                try:
                    del self.table[self._key(self.table, k)]
                except KeyError:
                    pass
                del self.written[k]


def sum_violations(items: Iterable) -> dict[tuple[int, str, str], int]:
    """(key, per-CPU values) pairs of spanlet_sandbox_violations_total →
    {(cgroup id, rule, action): count} with rule and action by name."""
    out: dict[tuple[int, str, str], int] = {}
    for key, values in items:
        n = sum(int(getattr(v, "value", v)) for v in values)
        rule = events.Rule(key.rule).name
        action = events.Action(key.action).name
        k = (int(key.cgroup_id), rule, action)
        out[k] = out.get(k, 0) + n
    return out


# -- fds from /proc ---------------------------------------------------------------
_DELETED = " (deleted)"


def _fd_target(link: str) -> str | None:
    try:
        target = os.readlink(link)
    except OSError:
        return None
    return target[: -len(_DELETED)] if target.endswith(_DELETED) else target


Inodes = dict[tuple[int, int], tuple[int, int]]


def fd_pool(link: str, policy: Policy, by_inode: Inodes | None = None) -> tuple[int, int] | None:
    """(pool id, max bytes) of the file an fd link (/proc/<pid>/fd/<n>) leads
    to: by its inode when `by_inode` knows it (a hard link or symlink reaches
    a pool under any name), else by the path the kernel shows for it."""
    target = _fd_target(link)
    if not target or not target.startswith("/"):
        return None
    if by_inode:
        try:
            st = os.stat(link)
        except OSError:
            return None
        ref = by_inode.get((st.st_dev, st.st_ino))
        if ref is not None:
            return ref
    return policy.lookup(target)


def scan_pool_fds(policy: Policy, proc: str = "/proc",
                  by_inode: Inodes | None = None) -> Iterator[tuple[tuple[int, int], tuple[int, int]]]:
    """((tgid, fd), (pool id, max bytes)) of every open fd that names a pool."""
    try:
        pids = [d for d in os.listdir(proc) if d.isdigit()]
    except OSError:
        return
    for pid in pids:
        fd_dir = f"{proc}/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue  # gone, or a kernel thread
        for fd in fds:
            ref = fd_pool(f"{fd_dir}/{fd}", policy, by_inode)
            if ref is not None:
                yield (int(pid), int(fd)), ref


def stale_pool_fds(entries: Iterable[tuple[tuple[int, int], tuple[int, int]]], policy: Policy,
                   proc: str = "/proc", by_inode: Inodes | None = None
                   ) -> Iterator[tuple[tuple[int, int], tuple[int, int] | None]]:
    """Remembered pool fds whose /proc entry no longer names that pool: with
    None when the fd is gone or is no pool, else with the pool it names now."""
    for (tgid, fd), ref in entries:
        now = fd_pool(f"{proc}/{tgid}/fd/{fd}", policy, by_inode)
        if now != ref:
            yield (tgid, fd), now


# -- the sweep: pools by inode --------------------------------------------------
@dataclass
class PoolIndex:
    """The pool files as they are on disk now."""
    by_inode: Inodes = field(default_factory=dict)      # (st_dev, st_ino) → (pool id, max bytes)
    # normalised path → (pool id or NOT_A_POOL, max bytes): names under a
    # prefix that the path string alone would judge wrong
    aliases: dict[str, tuple[int, int]] = field(default_factory=dict)
    truncated: bool = False                              # WALK_LIMIT was reached


def _under_prefix(prefix: str, limit: int) -> Iterator[tuple[str, os.DirEntry]]:
    """Files, symlinks and the like whose path starts with `prefix` (symlinked
    folders are not followed)."""
    top = prefix[: prefix.rfind("/") + 1]
    stack, seen = [top], 0
    while stack:
        folder = stack.pop()
        try:
            it = os.scandir(folder)
        except OSError:
            continue
        with it:
            for e in it:
                seen += 1
                if seen > limit:
                    raise OverflowError(prefix)
                path = folder + e.name
                try:
                    is_dir = e.is_dir(follow_symlinks=False)
                except OSError:
                    continue
                if is_dir:
                    if (path + "/").startswith(prefix) or prefix.startswith(path + "/"):
                        stack.append(path + "/")
                elif path.startswith(prefix):
                    yield path, e


def index_pools(policy: Policy, limit: int = WALK_LIMIT) -> PoolIndex:
    """Stat the configured pools and walk the prefixes: every regular file
    under a prefix by inode (a configured pool's, else its prefix's unlisted
    id), and as aliases the names that reach a pool under another name (hard
    links, symlinks) or lead out of every pool (symlinks)."""
    idx = PoolIndex()
    for path, ref in policy.pools.items():
        try:
            st = os.stat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            idx.by_inode[(st.st_dev, st.st_ino)] = ref
    links: list[str] = []
    for prefix, (kind, _, _) in policy.prefixes.items():
        if kind != PREFIX_FULL:
            continue
        try:
            for path, entry in _under_prefix(prefix, limit):
                if entry.is_symlink():
                    links.append(path)
                    continue
                st = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    continue
                key = (st.st_dev, st.st_ino)
                by_path = policy.lookup(path)
                ref = idx.by_inode.setdefault(key, by_path)
                if ref != by_path:
                    idx.aliases[path] = ref           # a hard link of a pool
        except OverflowError:
            idx.truncated = True
    for path in links:
        try:
            st = os.stat(path)
        except OSError:
            continue                                  # dangling
        if not stat.S_ISREG(st.st_mode):
            continue
        ref = idx.by_inode.get((st.st_dev, st.st_ino))
        if ref is None:                               # outside every prefix
            ref = policy.lookup(os.path.realpath(path)) or (NOT_A_POOL, 0)
        if ref != policy.lookup(path):
            idx.aliases[path] = ref
    for path in [p for p in idx.aliases if len(p.encode()) >= PATH_MAX or normalise_path(p) != p]:
        del idx.aliases[path]
    return idx


@dataclass(frozen=True)
class PoolMapping:
    """One line of /proc/<pid>/maps that maps a pool file."""
    start: int
    end: int
    prot: int
    shared: bool
    offset: int
    inode: tuple[int, int]


_MAPS_LINE = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) ([-r][-w][-x][sp]) ([0-9a-f]+) "
                        rb"([0-9a-f]+):([0-9a-f]+) (\d+) ", re.M)


def pool_mappings(maps: bytes, by_inode: Inodes) -> list[PoolMapping]:
    """The mappings of pool files in the text of a /proc/<pid>/maps."""
    devs = {b" %02x:%02x " % (os.major(d), os.minor(d)) for d, _ in by_inode}
    if not any(d in maps for d in devs):
        return []
    out = []
    for m in _MAPS_LINE.finditer(maps):
        start, end, perms, off, major, minor, ino = m.groups()
        key = (os.makedev(int(major, 16), int(minor, 16)), int(ino))
        if key not in by_inode:
            continue
        prot = ((PROT_READ if perms[0:1] == b"r" else 0) | (PROT_WRITE if perms[1:2] == b"w" else 0)
                | (PROT_EXEC if perms[2:3] == b"x" else 0))
        out.append(PoolMapping(int(start, 16), int(end, 16), prot, perms[3:4] == b"s",
                               int(off, 16), key))
    return out


def rule_of(access: int, prot: int, shared: bool, length: int, offset: int, max_bytes: int) -> int:
    """sandbox_rule() of the kernel side, for a mapping as /proc shows it
    (its length rounded up to pages, so is the limit)."""
    if access == 0:
        return events.Rule.unauthorized
    if access == ACCESS["ro"] and prot & PROT_WRITE and shared:
        return events.Rule.write_on_readonly
    if prot & PROT_EXEC:
        return events.Rule.exec
    if max_bytes:
        page = os.sysconf("SC_PAGE_SIZE")
        limit = -(-max_bytes // page) * page
        if length > limit or offset > limit - length:
            return events.Rule.oversize
    return 0


def judged_cover(m: PoolMapping, judged: list[tuple[int, int, int, int]]) -> bool:
    """Whether the mmap check judged this mapping with at least the
    permissions it has now: judged holds (address, length, prot, flags)."""
    page = os.sysconf("SC_PAGE_SIZE")
    for addr, length, prot, flags in judged:
        end = addr + -(-length // page) * page
        shared = flags & MAP_TYPE in (MAP_SHARED, MAP_SHARED_VALIDATE)
        if addr <= m.start and m.end <= end and not m.prot & ~prot and (shared or not m.shared):
            return True
    return False


@dataclass
class _ProcMaps:
    starttime: bytes
    vsize: bytes
    read_at: float
    kernel_thread: bool = False
    pools: list[PoolMapping] = field(default_factory=list)


def _read_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _stat_fields(proc: str, pid: int) -> list[bytes] | None:
    """Fields of /proc/<pid>/stat after the command name (index 0 is field 3)."""
    raw = _read_bytes(f"{proc}/{pid}/stat")
    return raw.rpartition(b")")[2].split() if raw else None


# -- the probe --------------------------------------------------------------------
class SandboxProbe(Probe):
    """mmap sandbox over the tensor pools of cfg.sandbox (see module doc)."""

    name = "mmap_sandbox"

    def __init__(self, cfg: Config, sink=None, clock=None,
                 cgroups: CgroupResolver | None = None, proc: str = "/proc"):
        super().__init__(cfg, sink, clock)
        self.cgroups = cgroups or CgroupResolver()
        self.proc = proc
        self.ids = PoolIds()
        self.policy = Policy()
        self._maps: dict[str, MapSync] = {}
        self._policy_lock = threading.Lock()
        self._problems: list[str] = []
        self.tracepoints: list[tuple[str, str]] = list(REQUIRED_TRACEPOINTS)
        # the sweep (see the module doc)
        self.index = PoolIndex()
        self._last_sweep = float("-inf")
        self._proc_maps: dict[int, _ProcMaps] = {}
        self._reported: set[tuple] = set()       # sweep violations still mapped
        self._swept: dict[tuple[int, str, str], int] = {}
        self.adopted_fds = 0                      # pool fds the sweep gave the kernel
        self.sweep_seconds = 0.0                  # how long the last sweep took

    def cflags(self) -> list[str]:
        flags = super().cflags() + [f"-DSANDBOX_MAX_PREFIX_ENTRIES={MAX_PREFIX_ENTRIES}",
                                    f"-DSANDBOX_MAX_POOLS={MAX_POOLS}",
                                    f"-DSANDBOX_MAX_GRANTS={MAX_GRANTS}",
                                    f"-DSANDBOX_MAX_POOL_FDS={MAX_POOL_FDS}",
                                    f"-DSANDBOX_MAX_JUDGED_MAPS={MAX_JUDGED_MAPS}"]
        if self.cfg.sandbox.mode == "enforce":
            flags.append("-DSANDBOX_ENFORCE")
        self.tracepoints = list(REQUIRED_TRACEPOINTS)
        for flag, pairs in OPTIONAL_TRACEPOINTS.items():
            if all(tracepoint_exists(tp) for tp, _ in pairs):
                flags.append(f"-D{flag}")
                self.tracepoints += pairs
        return flags

    # -- policy ----------------------------------------------------------------------
    def compile_policy(self, sb: SandboxConfig | None = None, strict: bool = True) -> Policy:
        return compile_policy(sb or self.cfg.sandbox, self.ids, self.cgroups.id, strict)

    def compile(self, shared_span_ctx: bool = False) -> None:
        # Configuration problems first: they must not wait for a compile.
        self.policy = self.compile_policy()
        super().compile(shared_span_ctx)

    def _push(self, policy: Policy) -> None:
        """Grants and pools before prefixes, so that a path recognised as a
        pool is never judged against a half-written policy."""
        if not self._maps:
            b = self.bpf
            self._maps = {
                "grants": MapSync(b["sandbox_grants"], _grant_key, _u8),
                "pools": MapSync(b["sandbox_pools"], _pool_key, _pool_ref),
                "prefixes": MapSync(b["sandbox_prefixes"], _prefix_key, _prefix_leaf),
            }
        m = self._maps
        pools = self._pool_entries(policy)
        m["grants"].sync(policy.grants, remove=False)
        m["pools"].sync(pools, remove=False)
        m["prefixes"].sync(policy.prefixes)
        m["pools"].sync(pools)
        m["grants"].sync(policy.grants)
        self.policy = policy

    def _pool_entries(self, policy: Policy) -> dict[str, tuple[int, int]]:
        """The configured pools, and the aliases of the last sweep (never
        over a configured path), within the table's size."""
        out = dict(policy.pools)
        for path, ref in self.index.aliases.items():
            if len(out) >= MAX_POOLS:
                log.warning("mmap_sandbox: pool table full: %d aliases left out",
                            len(self.index.aliases) - (len(out) - len(policy.pools)))
                break
            out.setdefault(path, ref)
        return out

    def apply_policy(self, sb: SandboxConfig | None = None) -> None:
        """Push a (new) sandbox section into the running program; raises
        ProbeError for a bad one and leaves the old policy in place. The mode
        (audit/enforce) is compiled in and needs a restart."""
        if sb is not None and sb.mode != self.cfg.sandbox.mode:
            raise ProbeError(f"sandbox.mode: {self.cfg.sandbox.mode} → {sb.mode} needs a restart")
        policy = self.compile_policy(sb)
        with self._policy_lock:
            if sb is not None:
                self.cfg.sandbox = sb
            if self.bpf is not None:
                self._push(policy)
                self._sweep()      # open fds and mappings follow a changed policy
            else:
                self.policy = policy

    def _attach(self) -> None:
        self._maps = {}
        self.status.attachments, self.status.failed_attachments = [], []
        self._push(self.policy)
        for tp, fn in self.tracepoints:  # as compiled (cflags)
            try:
                self.bpf.attach_tracepoint(tp=tp, fn_name=fn)
                self.status.attachments.append(f"tracepoint:{tp}")
            except Exception as e:
                self.status.failed_attachments.append(f"tracepoint:{tp}: {e}")
                raise ProbeError(f"cannot attach tracepoint {tp}: {e}") from None
        self._sweep()  # also adopts the pool fds opened before the probe started
        if self.adopted_fds:
            log.info("mmap_sandbox: %d pool fds were open before start", self.adopted_fds)

    def _fds_table(self):
        return self.bpf["sandbox_pool_fds"]

    def _sweep_fds(self) -> None:
        table = self._fds_table()
        entries = [((k.tgid, k.fd), (v.pool_id, v.max_bytes)) for k, v in table.items()]
        for k, now in stale_pool_fds(entries, self.policy, self.proc, self.index.by_inode):
            if now is None:
                try:
                    del table[_fd_key(table, k)]
                except KeyError:
                    pass
            else:
                table[_fd_key(table, k)] = _pool_ref(table, now)

    def refresh(self) -> None:
        """Follow cgroups that were recreated (new ids), and forget pool fds
        that went away without close(2). Never raises: a failure is logged and
        the last policy stays in force."""
        with self._policy_lock:
            if self.bpf is None:
                return
            try:
                policy = self.compile_policy(strict=False)
                if policy.problems != self._problems:
                    for p in policy.problems:
                        log.warning("mmap_sandbox: grant skipped: %s", p)
                    self._problems = policy.problems
                self._push(policy)
                self._sweep_fds()
                if time.monotonic() - self._last_sweep >= self.cfg.sandbox.sweep_interval_s:
                    self._sweep()
            except Exception as e:
                log.warning("mmap_sandbox: refresh failed: %s", e)

    # -- the sweep -------------------------------------------------------------------
    def sweep(self, full: bool = False) -> None:
        """Run the sweep now (refresh() runs it every sandbox.sweep_interval_s); full:
        read every process's maps, not only those whose mapped size changed
        (mprotect changes none)."""
        with self._policy_lock:
            if self.bpf is not None:
                if full:
                    self._proc_maps.clear()
                self._sweep()

    def _sweep(self) -> None:
        """Never raises: a sweep that fails is logged, and the next one tries
        again (the check at the call is not affected)."""
        t0 = time.monotonic()
        self._last_sweep = t0
        try:
            self._sweep_once()
        except Exception as e:
            log.warning("mmap_sandbox: sweep failed: %s", e)
        self.sweep_seconds = time.monotonic() - t0

    def _sweep_once(self) -> None:
        index = index_pools(self.policy)
        if index.truncated and not self.index.truncated:
            log.warning("mmap_sandbox: more than %d entries under the prefixes: the sweep "
                        "looks at the first ones only", WALK_LIMIT)
        if index.by_inode.keys() != self.index.by_inode.keys():
            self._proc_maps.clear()             # other inodes to look for: read every maps again
        self.index = index
        self._push(self.policy)                 # the aliases
        self._sweep_fds()                       # what the aliases and inodes say now
        self._adopt_fds()
        self._judge_mappings()

    def _adopt_fds(self) -> None:
        """Give the kernel every open pool fd it does not know (or knows as
        another pool), so that their next mmap is checked at the call."""
        table = self._fds_table()
        known = {(k.tgid, k.fd): (v.pool_id, v.max_bytes) for k, v in table.items()}
        for k, ref in scan_pool_fds(self.policy, self.proc, self.index.by_inode):
            if known.get(k) == ref:
                continue
            try:
                table[_fd_key(table, k)] = _pool_ref(table, ref)
            except Exception as e:  # full: the kernel side counts its own misses
                log.warning("mmap_sandbox: cannot adopt pool fd %s: %s", k, e)
                return
            if k not in known:
                self.adopted_fds += 1

    def _pids(self) -> list[int]:
        try:
            with os.scandir(self.proc) as it:
                return [int(e.name) for e in it if e.name.isdigit()]
        except OSError:
            return []

    def _pool_maps_of(self, pid: int, now: float) -> _ProcMaps | None:
        """The pool mappings of a process, its maps read again only when its
        mapped size changed (or the pool inodes did)."""
        fields = _stat_fields(self.proc, pid)
        if not fields or len(fields) < 21:
            return None
        starttime, vsize = fields[19], fields[20]
        seen = self._proc_maps.get(pid)
        if seen is not None and seen.starttime == starttime and (seen.kernel_thread or (
                seen.vsize == vsize and now - seen.read_at < self.cfg.discovery.full_rescan_s)):
            return seen
        seen = self._proc_maps[pid] = _ProcMaps(starttime, vsize, now,
                                                bool(int(fields[6]) & PF_KTHREAD))
        if not seen.kernel_thread and self.index.by_inode:
            maps = _read_bytes(f"{self.proc}/{pid}/maps")
            seen.pools = pool_mappings(maps, self.index.by_inode) if maps else []
        return seen

    def _judged(self, alive: set[int] | None = None) -> dict[int, list[tuple[int, int, int, int]]]:
        """{tgid: [(address, length, prot, flags)]} of the mappings the call
        judged; with `alive`, those of processes gone are deleted (a reused
        pid must not inherit them)."""
        from spanlet.probes.tc import dump_table  # the batch reader of BCC hash tables

        table = self.bpf["sandbox_judged_maps"]
        out: dict[int, list] = {}
        for key, v in dump_table(table).items():
            k = table.Key.from_buffer_copy(key)
            if alive is not None and k.tgid not in alive and not os.path.exists(
                    f"{self.proc}/{k.tgid}"):  # not one born since the pids were listed
                try:
                    del table[k]
                except KeyError:
                    pass
                continue
            out.setdefault(k.tgid, []).append((k.addr, v.len, v.prot, v.flags))
        return out

    def _process_cgroup(self, pid: int) -> tuple[int, list[int]]:
        """(cgroup id, ids of it and every cgroup above it) of a process."""
        raw = _read_bytes(f"{self.proc}/{pid}/cgroup") or b""
        path = next((line[3:].decode(errors="replace") for line in raw.splitlines()
                     if line.startswith(b"0::")), None)
        if path is None:
            return 0, []
        mount = self.cgroups.mount.rstrip("/")
        parts = [p for p in path.split("/") if p]
        ids = []
        for i in range(len(parts) + 1):
            try:
                ids.append(os.stat(mount + "/" + "/".join(parts[:i])).st_ino)
            except OSError:
                break
        return (ids[-1] if len(ids) == len(parts) + 1 else 0), ids

    def _access(self, pid: int, pool_id: int, cgroups: list[int]) -> int:
        grants = self.policy.grants
        best = grants.get((pool_id, GRANT_PID, pid), 0)
        for cg in cgroups:
            best = max(best, grants.get((pool_id, GRANT_CGROUP, cg), 0))
        return best

    def _judge_mappings(self) -> None:
        """Pool mappings the call did not judge (or judged with fewer
        permissions): judged here by the same rules, each counted once while
        it stays mapped; in enforce mode its process is killed."""
        now = time.monotonic()
        pids = self._pids()
        alive = set(pids)
        candidates: dict[tuple, tuple] = {}
        judged = self._judged(alive)
        for pid in pids:
            seen = self._pool_maps_of(pid, now)
            if seen is None or not seen.pools:
                continue
            cgroup, ancestry = None, []
            for m in seen.pools:
                if judged_cover(m, judged.get(pid, [])):
                    continue
                if cgroup is None:
                    cgroup, ancestry = self._process_cgroup(pid)
                pool_id, max_bytes = self.index.by_inode[m.inode]
                rule = rule_of(self._access(pid, pool_id, ancestry), m.prot, m.shared,
                               m.end - m.start, m.offset, max_bytes)
                if rule:
                    candidates[(pid, seen.starttime, m)] = (cgroup, rule)
        for pid in [p for p in self._proc_maps if p not in alive]:
            del self._proc_maps[pid]
        new = [k for k in candidates if k not in self._reported]
        if new:  # a mapping made while this sweep ran may be judged meanwhile
            judged = self._judged()
            new = [k for k in new if not judged_cover(k[2], judged.get(k[0], []))]
        enforce = self.cfg.sandbox.mode == "enforce"
        for key in new:
            pid, starttime, m = key
            cgroup, rule = candidates[key]
            action = events.Action.kill if enforce and self._kill(pid, starttime) else events.Action.audit
            k = (cgroup, events.Rule(rule).name, action.name)
            self._swept[k] = self._swept.get(k, 0) + 1
            log.warning("mmap_sandbox: sweep: pid %d maps pool %s (%s) at %#x, judged nowhere "
                        "else: %s", pid, self.pool_path(self.index.by_inode[m.inode][0]),
                        events.Rule(rule).name, m.start, action.name)
        self._reported = set(candidates)

    def _kill(self, pid: int, starttime: bytes) -> bool:
        """SIGKILL through a pidfd, after checking that the pid still names
        the process whose maps were read (not a newer one)."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return False
        try:
            fields = _stat_fields(self.proc, pid)
            if not fields or fields[19] != starttime:
                return False
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def stop(self) -> None:
        with self._policy_lock:
            super().stop()
            self._maps = {}

    # -- readers ---------------------------------------------------------------------
    def violations(self) -> dict[tuple[int, str, str], int]:
        """{(cgroup id, rule, action): count} since the probe started."""
        if self.bpf is None:
            return {}
        return sum_violations(self.bpf["spanlet_sandbox_violations_total"].items())

    def sweep_violations(self) -> dict[tuple[int, str, str], int]:
        """{(cgroup id, rule, action): count} of the mappings only the sweep
        judged (made through an fd the call did not know, or given more
        permissions since), each counted once while it stays mapped."""
        with self._policy_lock:
            return dict(self._swept)

    def unresolved_opens(self) -> int:
        """Opens of a path under a prefix with a '..' component, which the
        kernel left to the sweep."""
        if self.bpf is None:
            return 0
        return percpu_sum(self.bpf["spanlet_sandbox_unresolved_opens_total"], 0)

    def untracked_fds(self) -> int:
        """Pool fds the kernel could not remember (its fd table was full)."""
        if self.bpf is None:
            return 0
        return percpu_sum(self.bpf["spanlet_sandbox_untracked_fds_total"], 0)

    @property
    def pool_paths(self) -> dict[int, str]:
        return dict(self.policy.pool_paths)

    def pool_path(self, pool_id: int) -> str | None:
        """The pool an event's pool_id names ('<prefix>*' for a file under a
        prefix that is no configured pool)."""
        return self.policy.pool_paths.get(pool_id)
