"""The sandbox's sweep of /proc and of the prefixes' folders: pool files by
inode, the open fds that name a pool, the pool mappings in /proc/<pid>/maps
and how the call's rules judge them, and the process facts the sweep needs."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import stat
import struct
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from spanlet import events
from spanlet.probes.sandbox.policy import (ACCESS, NOT_A_POOL, PATH_MAX, PREFIX_FULL, Policy,
                                           normalise_path)

# Entries of the prefixes' folders looked at per sweep, at most.
WALK_LIMIT = 10_000
PROT_READ, PROT_WRITE, PROT_EXEC = 1, 2, 4
MAP_SHARED, MAP_PRIVATE, MAP_SHARED_VALIDATE, MAP_TYPE = 1, 2, 3, 0x0F

# -- fds from /proc ---------------------------------------------------------------
_DELETED = " (deleted)"


def _fd_target(link: str) -> str | None:
    try:
        target = os.readlink(link)
    except OSError:
        return None
    return target[: -len(_DELETED)] if target.endswith(_DELETED) else target


Inodes = dict[tuple[int, int], tuple[int, int]]


def link_pool(link: str, policy: Policy, by_inode: Inodes | None = None
              ) -> tuple[bool, os.stat_result | None, tuple[int, int] | None]:
    """(whether the link is there, stat of its file or None, (pool id, max
    bytes) or None) of what a /proc link (/proc/<pid>/fd/<n>,
    /proc/<pid>/map_files/<range>) leads to: by its inode when `by_inode`
    knows it (a hard link or symlink reaches a pool under any name), else by
    the path the kernel shows for it."""
    target = _fd_target(link)
    if not target:
        return False, None, None
    try:
        st = os.stat(link)
    except OSError:
        st = None
    if not target.startswith("/"):
        return True, st, None                     # a socket, pipe, anon inode...
    if by_inode:
        if st is None:
            return False, None, None
        ref = by_inode.get((st.st_dev, st.st_ino))
        if ref is not None:
            return True, st, ref
    return True, st, policy.lookup(target)


def fd_pool(link: str, policy: Policy, by_inode: Inodes | None = None) -> tuple[int, int] | None:
    """(pool id, max bytes) of the file an fd link leads to (see link_pool)."""
    return link_pool(link, policy, by_inode)[2]


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
    folders: set[str] = field(default_factory=set)       # the folders walked ('/' at the end)
    # st_dev of every file system a pool can be on: its folder's, or the
    # nearest existing folder above a prefix not made yet
    devices: set[int] = field(default_factory=set)


def _under_prefix(prefix: str, limit: int, folders: set[str] | None = None
                  ) -> Iterator[tuple[str, os.DirEntry]]:
    """Files, symlinks and the like whose path starts with `prefix` (symlinked
    folders are not followed); the folders read are added to `folders`."""
    top = prefix[: prefix.rfind("/") + 1]
    stack, seen = [top], 0
    while stack:
        folder = stack.pop()
        try:
            it = os.scandir(folder)
        except OSError:
            continue
        if folders is not None:
            folders.add(folder)
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


def _device_of(folder: str) -> int:
    """st_dev of a folder, or of the nearest one above it that exists."""
    while True:
        try:
            return os.stat(folder).st_dev
        except OSError:
            if folder in ("/", ""):
                return -1
            folder = os.path.dirname(folder.rstrip("/")) or "/"


def index_pools(policy: Policy, limit: int = WALK_LIMIT) -> PoolIndex:
    """Stat the configured pools and walk the prefixes: every regular file
    under a prefix by inode (a configured pool's, else its prefix's unlisted
    id), and as aliases the names that reach a pool under another name (hard
    links, symlinks) or lead out of every pool (symlinks)."""
    idx = PoolIndex()
    for prefix, (kind, _, _) in policy.prefixes.items():
        if kind == PREFIX_FULL:
            idx.devices.add(_device_of(prefix[: prefix.rfind("/") + 1]))
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
            for path, entry in _under_prefix(prefix, limit, idx.folders):
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
    idx.devices |= {d for d, _ in idx.by_inode}
    return idx


# -- the prefixes' folders, watched ------------------------------------------------
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_ONLYDIR, IN_DONT_FOLLOW = 0x0100_0000, 0x0200_0000
_WATCH_MASK = IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_ONLYDIR | IN_DONT_FOLLOW
_EVENT = struct.Struct("iIII")


class FolderWatch:
    """inotify on the prefixes' folders: names created, removed or moved
    there (a symlink or hard link made under a prefix, a pool replaced), so
    that the agent walks the prefixes again at once, not at its next
    periodic walk. The watch follows the folders of the last walk."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._folders: dict[int, str] = {}            # watch descriptor → folder

    def follow(self, folders: Iterable[str]) -> None:
        """Watch these folders (those gone drop out by themselves)."""
        watched = set(self._folders.values())
        for folder in folders:
            if folder in watched:
                continue
            wd = self._libc.inotify_add_watch(self.fd, folder.encode(), _WATCH_MASK)
            if wd >= 0:
                self._folders[wd] = folder

    def changed(self, prefixes: Iterable[str]) -> bool:
        """Read the pending events: whether any names a path under one of the
        prefixes, or a folder on the way to one."""
        prefixes = list(prefixes)
        hit = False
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return hit
            off = 0
            while off + _EVENT.size <= len(buf):
                wd, _, _, n = _EVENT.unpack_from(buf, off)
                name = buf[off + _EVENT.size: off + _EVENT.size + n].split(b"\0", 1)[0]
                off += _EVENT.size + n
                folder = self._folders.get(wd)
                if folder is None:
                    continue
                path = folder + name.decode(errors="replace")
                if any(path.startswith(p) or p.startswith(path + "/") for p in prefixes):
                    hit = True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


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


def rule_of(access: int, prot: int, shared: bool, length: int, offset: int, max_bytes: int,
            as_called: bool = False) -> int:
    """sandbox_rule() of the kernel side, for a mapping as /proc shows it
    (its length rounded up to pages, so is the limit), or as_called: for
    the length and offset the mmap call asked for (exactly the kernel's)."""
    if access == 0:
        return events.Rule.unauthorized
    if access == ACCESS["ro"] and prot & PROT_WRITE and shared:
        return events.Rule.write_on_readonly
    if prot & PROT_EXEC:
        return events.Rule.exec
    if max_bytes:
        page = 1 if as_called else os.sysconf("SC_PAGE_SIZE")
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




def process_cgroups(proc: str, mount: str, pid: int) -> tuple[int, list[int]]:
    """(cgroup id, ids of it and every cgroup above it) of a process, its
    cgroup v2 path looked up under `mount`."""
    raw = _read_bytes(f"{proc}/{pid}/cgroup") or b""
    path = next((line[3:].decode(errors="replace") for line in raw.splitlines()
                 if line.startswith(b"0::")), None)
    if path is None:
        return 0, []
    mount = mount.rstrip("/")
    parts = [p for p in path.split("/") if p]
    ids = []
    for i in range(len(parts) + 1):
        try:
            ids.append(os.stat(mount + "/" + "/".join(parts[:i])).st_ino)
        except OSError:
            break
    return (ids[-1] if len(ids) == len(parts) + 1 else 0), ids


def kill_if_same(proc: str, pid: int, starttime: bytes) -> bool:
    """SIGKILL through a pidfd, after checking that the pid still names
    the process whose maps were read (not a newer one)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        fields = _stat_fields(proc, pid)
        if not fields or fields[19] != starttime:
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
