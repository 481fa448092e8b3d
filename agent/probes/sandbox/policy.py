"""The sandbox policy compiler: the sandbox section of the config → the
contents of bpf/mmap_sandbox.bpf.c's maps (prefixes, pools, grants), and the
writer that keeps a map at a wanted content."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Callable

from spanlet.cgroups import CgroupError
from spanlet.config import SandboxConfig, SandboxGrant
from spanlet.probes.base import ProbeError

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
# Slots of the kernel's per-thread and per-process arrays (SANDBOX_SLOTS).
SLOTS = 65536
# The open's early return: the first HEAD_LEN bytes of a path against the
# first bytes of each prefix, at most MAX_HEADS of them (SANDBOX_HEAD_LEN,
# SANDBOX_MAX_HEADS).
HEAD_LEN = 16
MAX_HEADS = 8
# Pool id of an alias that leads to no pool (a symlink under a prefix that
# points elsewhere): the kernel does not track what is opened through it.
NOT_A_POOL = 0


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


def prefix_heads(prefixes: dict[str, tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
    """(value word 0, value word 1, mask word 0, mask word 1) of the first
    HEAD_LEN bytes of each real prefix, once each: a path whose first bytes
    match none (and hold no '//' or '/.') is under no prefix."""
    out: list[tuple[int, int, int, int]] = []
    for prefix, (kind, _, _) in prefixes.items():
        if kind != PREFIX_FULL:
            continue
        head = prefix.encode()[:HEAD_LEN].ljust(HEAD_LEN, b"\0")
        n = min(len(prefix.encode()), HEAD_LEN)
        mask = (b"\xff" * n).ljust(HEAD_LEN, b"\0")
        words = (int.from_bytes(head[:8], "little"), int.from_bytes(head[8:], "little"),
                 int.from_bytes(mask[:8], "little"), int.from_bytes(mask[8:], "little"))
        if words not in out:
            out.append(words)
    if len(out) > MAX_HEADS:
        raise ProbeError(f"sandbox.prefixes: {len(out)} different first {HEAD_LEN} bytes; "
                         f"at most {MAX_HEADS}")
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
    _compile_prefixes(pol, sb, ids)
    _compile_pools(pol, sb, ids, cgroup_id, strict)
    return pol


def _compile_prefixes(pol: Policy, sb: SandboxConfig, ids: PoolIds) -> None:
    """The prefixes, and the directories above them, into pol.prefixes."""
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


def _compile_pools(pol: Policy, sb: SandboxConfig, ids: PoolIds,
                   cgroup_id: Callable[[str], int], strict: bool) -> None:
    """The pools into pol.pools, and their grants into pol.grants."""
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
            _compile_grant(pol, f"{key}.grants[{j}]", pool_id, grant, cgroup_id, strict)
    if len(pol.pools) > MAX_POOLS:
        raise ProbeError(f"sandbox.pools: {len(pol.pools)} pools; at most {MAX_POOLS}")
    if len(pol.grants) > MAX_GRANTS:
        raise ProbeError(f"sandbox.pools[*].grants: {len(pol.grants)} (pool, pid or cgroup) "
                         f"pairs; at most {MAX_GRANTS}")


def _compile_grant(pol: Policy, key: str, pool_id: int, grant: SandboxGrant,
                   cgroup_id: Callable[[str], int], strict: bool) -> None:
    """One grant of a pool into pol.grants (the wider access where two meet)."""
    access = ACCESS[grant.access]
    targets = [(GRANT_PID, tgid) for tgid in grant.pids]
    for k, cg in enumerate(grant.cgroups):
        gkey = f"{key}.cgroups[{k}]"
        try:
            targets.append((GRANT_CGROUP, cgroup_id(cg)))
        except (ProbeError, CgroupError) as e:
            if strict:
                raise ProbeError(f"{gkey}: {e}") from None
            pol.problems.append(f"{gkey}: {e}")
    for kind, ident in targets:
        gk = (pool_id, kind, ident)
        pol.grants[gk] = max(access, pol.grants.get(gk, 0))


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


def _struct(kind: str, *fields: str) -> Callable:
    """A maker of a map's Key or Leaf (`kind`) whose `fields` are set, in order,
    from a tuple of as many values."""
    def make(table, values: tuple):
        struct = getattr(table, kind)()
        for name, value in zip(fields, values, strict=True):
            setattr(struct, name, value)
        return struct
    return make


def _pool_key(table, path: str):
    k = table.Key()
    _set_path(k, path)
    return k


def _u8(table, v: int):
    return table.Leaf(v)


_prefix_leaf = _struct("Leaf", "kind", "unlisted_pool_id", "len")
_pool_ref = _struct("Leaf", "pool_id", "max_bytes")
_grant_key = _struct("Key", "pool_id", "kind", "id")
_fd_key = _struct("Key", "tgid", "fd")


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

