"""Loader of bpf/mmap_sandbox.bpf.c: compiles the sandbox policy of the config
into the program's maps, keeps it current (cgroup ids, stale fds), and reads
the violation counters (metric 5) back. Its programs show as sbx_* in
`bpftool prog show`.

Known limits (the kernel side's header comment has the full list): pools are
recognised by the path string given to the open call, normalised for repeated
'/' and '.' components only; '..', symlinks and paths relative to a dirfd or
the working directory are not resolved; fds that arrive by fork, dup* or
SCM_RIGHTS are not tracked; mprotect/mremap after the mmap and 32-bit compat
syscalls are not checked. Fds opened before the probe started are found once,
at start, from /proc; fds dropped without close(2) are swept by refresh()."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from agent import events
from agent.config import Config, SandboxConfig
from agent.kernel import TRACEFS
from agent.cgroups import CgroupError, CgroupResolver, cgroup2_mount  # noqa: F401
from agent.probes.base import Probe, ProbeError, percpu_sum

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

# (tracepoint, program) pairs. Without any required one the sandbox has a
# hole (an untracked fd, a stale one, an unchecked mmap), so it runs complete
# or not at all; the optional ones close side doors (a direct open(2) or
# openat2(2) call) where the kernel has them, each behind its -D flag.
REQUIRED_TRACEPOINTS = (
    ("syscalls:sys_enter_openat", "sbx_openat_in"),
    ("syscalls:sys_exit_openat", "sbx_openat_out"),
    ("syscalls:sys_enter_mmap", "sbx_mmap"),
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


def scan_pool_fds(policy: Policy, proc: str = "/proc") -> Iterator[tuple[tuple[int, int], tuple[int, int]]]:
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
            target = _fd_target(f"{fd_dir}/{fd}")
            ref = policy.lookup(target) if target and target.startswith("/") else None
            if ref is not None:
                yield (int(pid), int(fd)), ref


def stale_pool_fds(entries: Iterable[tuple[tuple[int, int], tuple[int, int]]], policy: Policy,
                   proc: str = "/proc") -> Iterator[tuple[tuple[int, int], tuple[int, int] | None]]:
    """Remembered pool fds whose /proc entry no longer names that pool: with
    None when the fd is gone or is no pool, else with the pool it names now."""
    for (tgid, fd), ref in entries:
        target = _fd_target(f"{proc}/{tgid}/fd/{fd}")
        now = policy.lookup(target) if target and target.startswith("/") else None
        if now != ref:
            yield (tgid, fd), now


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

    def cflags(self) -> list[str]:
        flags = super().cflags() + [f"-DSANDBOX_MAX_PREFIX_ENTRIES={MAX_PREFIX_ENTRIES}",
                                    f"-DSANDBOX_MAX_POOLS={MAX_POOLS}",
                                    f"-DSANDBOX_MAX_GRANTS={MAX_GRANTS}",
                                    f"-DSANDBOX_MAX_POOL_FDS={MAX_POOL_FDS}"]
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
        m["grants"].sync(policy.grants, remove=False)
        m["pools"].sync(policy.pools, remove=False)
        m["prefixes"].sync(policy.prefixes)
        m["pools"].sync(policy.pools)
        m["grants"].sync(policy.grants)
        self.policy = policy

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
                self._sweep_fds()  # open fds follow a changed max_bytes or pool list
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
        self._seed_fds()

    def _fds_table(self):
        return self.bpf["sandbox_pool_fds"]

    def _seed_fds(self) -> None:
        """Pool fds opened before the probe was attached (an agent restart
        must not leave running processes outside the sandbox)."""
        table = self._fds_table()
        n = 0
        try:
            for k, ref in scan_pool_fds(self.policy, self.proc):
                table[_fd_key(table, k)] = _pool_ref(table, ref)
                n += 1
        except Exception as e:  # a full table: the kernel side counts its own misses
            log.warning("mmap_sandbox: %d pool fds open before start remembered, then: %s", n, e)
            return
        if n:
            log.info("mmap_sandbox: %d pool fds were open before start", n)

    def _sweep_fds(self) -> None:
        table = self._fds_table()
        entries = [((k.tgid, k.fd), (v.pool_id, v.max_bytes)) for k, v in table.items()]
        for k, now in stale_pool_fds(entries, self.policy, self.proc):
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
            except Exception as e:
                log.warning("mmap_sandbox: refresh failed: %s", e)

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
