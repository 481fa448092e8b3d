"""Process and library discovery: finds shared libraries with configured names
in every process's /proc/<pid>/maps, containers included, and reports each
library file (inode) once, with a path the agent can open to attach to it.

With the kernel's watch of changed processes (MapsWatch: execs, files mapped
executable, exits, from bpf/span_ctx.bpf.c) a refresh reads only the
processes that changed, and /proc is scanned in full only every
discovery.full_rescan_s: the cost follows the rate of execs and library
loads, not the number of processes on the node."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

log = logging.getLogger(__name__)

PF_KTHREAD = 0x00200000  # task flags bit of kernel threads (include/linux/sched.h)
_DELETED = " (deleted)"


@dataclass(frozen=True)
class MappedLibrary:
    """One library file as the kernel knows it, wherever it was first seen."""

    key: tuple[int, int]   # (st_dev, st_ino) of the mapped file: what a uprobe attaches to
    name: str              # the configured name that matched ("libcuda.so")
    path: str              # path inside the process's mount namespace, as in its maps
    open_path: str         # how the agent opens it: /proc/<pid>/root<path> or map_files
    pid: int               # the process it was first seen in

    @property
    def inode(self) -> str:
        dev, ino = self.key
        return f"{os.major(dev)}:{os.minor(dev)}:{ino}"


@dataclass
class ScanStats:
    """Cost of the last scan."""

    full: bool = True       # a scan of every pid (else only those the watch named)
    processes: int = 0      # pids listed (full) or named by the watch
    stats_read: int = 0     # /proc/<pid>/stat reads
    maps_read: int = 0      # /proc/<pid>/maps reads (the expensive part)
    kernel_threads: int = 0
    exited: int = 0         # known processes found gone
    seconds: float = 0.0


@dataclass
class _Seen:
    starttime: str          # field 22 of /proc/<pid>/stat: tells a reused pid apart
    vsize: str              # field 23: changes when the process maps or unmaps
    read_at: float          # when its maps were last read
    kernel_thread: bool = False
    keys: set = field(default_factory=set)


# auditwheel's copies of a library bundled into a wheel: libcudart-<8 hex>.so.12
_HASHED = re.compile(r"-[0-9a-f]{8}(?=\.so)")


def _name_alt(name: str) -> str:
    stem, dot, rest = name.partition(".so")
    if not dot:
        return re.escape(name)
    return re.escape(stem) + r"(?:-[0-9a-f]{8})?" + re.escape(dot + rest)


def library_pattern(names: Iterable[str]) -> re.Pattern:
    """A /proc/<pid>/maps line whose file's base name is one of `names` or
    starts with one of them followed by a dot (libcuda.so matches libcuda.so,
    libcuda.so.1 and libcuda.so.535.104, not libcudart.so), also under the
    hash-renamed name auditwheel gives a copy bundled into a wheel
    (libcudart-1a2b3c4d.so.12 for libcudart.so)."""
    alts = "|".join(_name_alt(n) for n in sorted(set(names), key=len, reverse=True))
    return re.compile(
        r"^([0-9a-f]+)-([0-9a-f]+) \S+ [0-9a-f]+ ([0-9a-f]+):([0-9a-f]+) (\d+) +"
        r"(/(?:[^\n]*/)?(" + alts + r")(?:\.[^/\n]*?)?)(" + re.escape(_DELETED) + r")?$",
        re.M)


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "surrogateescape")
    except OSError:  # the process exited, or the file is not ours to read
        return None


class MapsWatch:
    """The kernel's list of processes whose mappings may have changed, taken
    by `drain` (the span_ctx probe's: its `maps_changed_pids` map, emptied)
    on whichever finder's refresh comes first and handed to every finder
    subscribed."""

    def __init__(self, drain: Callable[[], Iterable[int]]):
        self.drain = drain
        self._queues: list[set[int]] = []
        self._lock = threading.Lock()
        self.drained = 0            # pids taken from the kernel, in all

    def subscribe(self) -> "WatchQueue":
        q = WatchQueue(self)
        with self._lock:
            self._queues.append(q.pids)
        return q

    def _drain_locked(self) -> None:
        pids = list(self.drain())
        self.drained += len(pids)
        for q in self._queues:
            q.update(pids)

    def take(self, q: "WatchQueue") -> set[int]:
        with self._lock:
            self._drain_locked()
            pids = set(q.pids)
            q.pids.clear()
            return pids


class WatchQueue:
    """One finder's share of a MapsWatch: the pids changed since it last took them."""

    def __init__(self, watch: MapsWatch):
        self.watch = watch
        self.pids: set[int] = set()

    def take(self) -> set[int]:
        return self.watch.take(self)


class LibraryFinder:
    """Scans /proc for processes that map libraries named `names`.

    `refresh()` returns the libraries (inodes) not seen before. A process is
    read in full the first time it is seen. Without a watch, after that only
    its stat line is, and its maps again when its mapped size changed
    (dlopen) or every `full_rescan_s`. With a watch (a WatchQueue), a refresh
    reads only the processes the kernel saw change, and every
    `full_rescan_s` the stat line of every process, whose maps are read only
    if it is new. Kernel threads are never read. Processes that exit and
    files that vanish mid-scan are skipped without error. `unmapped()` tells
    which libraries no process maps any more."""

    def __init__(self, names: Iterable[str], proc: str | os.PathLike = "/proc",
                 full_rescan_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 watch: WatchQueue | None = None):
        self.names = list(dict.fromkeys(names))
        self.proc = str(proc)
        self.full_rescan_s = full_rescan_s
        self.clock = clock
        self._pattern = library_pattern(self.names) if self.names else None
        self._stems = [n.partition(".so")[0] for n in self.names]   # a cheap first filter
        self._seen: dict[int, _Seen] = {}
        self._found: dict[tuple[int, int], MappedLibrary] = {}
        self._unmapped_since: dict[tuple[int, int], float] = {}
        self.stats = ScanStats()
        self.watch = watch
        self._full_at = float("-inf")

    @property
    def libraries(self) -> list[MappedLibrary]:
        return list(self._found.values())

    def forget(self, key: tuple[int, int]) -> None:
        """Let a library be found again (its file vanished before it could be
        used); the process it was seen in is read again at the next scan."""
        lib = self._found.pop(key, None)
        self._unmapped_since.pop(key, None)
        if lib is not None:
            self._seen.pop(lib.pid, None)

    def unmapped(self, grace_s: float) -> list[MappedLibrary]:
        """Libraries that no live process has mapped for `grace_s` or more,
        as of the last scan."""
        now = self.clock()
        return [self._found[k] for k, since in self._unmapped_since.items()
                if now - since >= grace_s and k in self._found]

    def refresh(self) -> list[MappedLibrary]:
        t0 = time.perf_counter()
        stats = ScanStats()
        new: list[MappedLibrary] = []
        now = self.clock()
        watched = self.watch is not None
        if watched and now - self._full_at < self.full_rescan_s:
            stats.full = False
            changed = self.watch.take()
            if self._pattern is not None:
                for pid in changed:
                    stats.processes += 1
                    new.extend(self._scan_pid(pid, now, stats, changed=True))
            if changed:
                self._track_unmapped(now)
        else:
            self._full_at = now
            if watched:
                self.watch.take()      # what changed until now, this scan reads
            alive = set()
            if self._pattern is not None:
                for pid in self._pids():
                    alive.add(pid)
                    stats.processes += 1
                    new.extend(self._scan_pid(pid, now, stats, trust_watch=watched))
            for pid in list(self._seen):
                if pid not in alive:
                    del self._seen[pid]
            self._track_unmapped(now)
        stats.seconds = time.perf_counter() - t0
        self.stats = stats
        return new

    def _track_unmapped(self, now: float) -> None:
        mapped = set().union(*(seen.keys for seen in self._seen.values()))
        for key in self._found:
            if key in mapped:
                self._unmapped_since.pop(key, None)
            else:
                self._unmapped_since.setdefault(key, now)

    def _pids(self) -> list[int]:
        try:
            with os.scandir(self.proc) as it:
                return [int(e.name) for e in it if e.name.isdigit()]
        except OSError as e:
            log.warning("discovery: cannot list %s: %s", self.proc, e)
            return []

    def _scan_pid(self, pid: int, now: float, stats: ScanStats, changed: bool = False,
                  trust_watch: bool = False) -> list[MappedLibrary]:
        """`changed`: the watch says its maps changed (read them); `trust_watch`:
        a known process's maps are read again only when the watch says so."""
        base = f"{self.proc}/{pid}"
        stat = _read(base + "/stat")
        stats.stats_read += 1
        if stat is None:
            if self._seen.pop(pid, None) is not None:
                stats.exited += 1
            return []
        fields = stat.rpartition(")")[2].split()
        if len(fields) < 21:
            return []
        starttime, vsize = fields[19], fields[20]
        seen = self._seen.get(pid)
        if seen is not None and seen.starttime == starttime:
            if seen.kernel_thread:
                stats.kernel_threads += 1
                return []
            if not changed and (trust_watch or (seen.vsize == vsize and
                                                now - seen.read_at < self.full_rescan_s)):
                return []
        kernel_thread = bool(int(fields[6]) & PF_KTHREAD)
        seen = self._seen[pid] = _Seen(starttime, vsize, now, kernel_thread)
        if kernel_thread:
            stats.kernel_threads += 1
            return []
        maps = _read(base + "/maps")
        stats.maps_read += 1
        if not maps:
            return []
        return self._libraries_in(pid, maps, seen)

    def _libraries_in(self, pid: int, maps: str, seen: _Seen) -> list[MappedLibrary]:
        if not any(n in maps for n in self._stems):
            return []
        new = []
        for m in self._pattern.finditer(maps):
            start, end, major, minor, ino, path, name, deleted = m.groups()
            key = (os.makedev(int(major, 16), int(minor, 16)), int(ino))
            seen.keys.add(key)
            if key in self._found:
                continue
            open_path = self._open_path(pid, path, bool(deleted), start, end, key[1])
            if open_path is None:
                continue  # gone between the read of maps and now
            lib = MappedLibrary(key, _HASHED.sub("", name, count=1), path, open_path, pid)
            self._found[key] = lib
            new.append(lib)
        return new

    def _open_path(self, pid: int, path: str, deleted: bool, start: str, end: str,
                   ino: int) -> str | None:
        """A path to the mapped file that this (the agent's) mount namespace
        can open: through the process's own root, so that a file inside a
        container resolves in the container's mounts; or, when the name no
        longer leads to the mapped inode (deleted, replaced), the kernel's
        map_files link to the mapping itself. The inode number is compared,
        not the device: overlayfs may report its own st_dev."""
        candidates = [] if deleted else [f"{self.proc}/{pid}/root{path}"]
        candidates.append(f"{self.proc}/{pid}/map_files/{int(start, 16):x}-{int(end, 16):x}")
        for c in candidates:
            try:
                if os.stat(c).st_ino == ino:
                    return c
            except OSError:
                continue
        return None


def main(argv: list[str] | None = None) -> int:
    """`python -m spanlet.discovery [NAME...]`: list what a scan finds and its cost."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("names", nargs="*", default=["libcuda.so", "libcudart.so"])
    ap.add_argument("--proc", default="/proc")
    ap.add_argument("--repeat", type=int, default=3, help="scans to time (first is cold)")
    args = ap.parse_args(argv)
    finder = LibraryFinder(args.names, proc=Path(args.proc))
    for i in range(max(1, args.repeat)):
        if i == 1:
            finder.full_rescan_s = 0.0  # time a full re-read too
        for lib in finder.refresh():
            print(f"{lib.name}\t{lib.inode}\tpid {lib.pid}\t{lib.path}\t({lib.open_path})")
        s = finder.stats
        label = "first scan" if i == 0 else ("full re-read" if i == 1 else "incremental")
        print(f"# {label}: {s.processes} processes, {s.stats_read} stat reads, {s.maps_read} maps "
              f"reads, {s.kernel_threads} kernel threads, {s.seconds * 1e3:.2f} ms")
        if i == 1:
            finder.full_rescan_s = 30.0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
