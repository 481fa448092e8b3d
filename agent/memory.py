"""What the start leaves resident, given back: the heap the compiles (or the
engine's start) freed, and the file pages of the libraries used only then.
The agent calls it after its start, the store's engine process after its own
(exporters/clickhouse/engine_process.py); a module of its own so that the
engine process need not import the probes."""

from __future__ import annotations

import ctypes
import os
import re

# One handle on the C library for the whole process: each ctypes.CDLL makes
# classes of its own for its functions, in reference cycles that only the
# collector's full passes free (a heap trim a minute, a memory report an ask).
LIBC = ctypes.CDLL(None, use_errno=True)

# BCC compiles with the LLVM and clang libraries it links: ~80 MB of their code
# is paged in by the compiles at start and stays counted in the agent's RSS,
# as does the heap the compiles freed; the embedded store's engine library
# (chdb, ~170 MB of pages touched by its start and schema checks) likewise.
# The compilers are not needed again unless a probe is compiled again, and of
# the engine only the code its inserts and queries run: what is paged out is
# read back from disk if used.
STARTUP_LIBRARIES = re.compile(r"/(?:lib(?:LLVM|clang-cpp|clang)[^/]*\.so[^/]*|_chdb[^/]*\.so)$")
MADV_PAGEOUT = 21          # uapi/asm-generic/mman-common.h, Linux 5.4
M_MMAP_THRESHOLD = -3      # malloc.h
M_ARENA_MAX = -8
# glibc gives each thread that allocates while the others hold theirs an arena
# of its own, up to 8 per CPU. The agent's threads (gRPC's, the receivers', the
# store's, the export's) each kept one: 30 MB after the start grew to ~68 MB in
# its first 15 minutes under the soak's load, and on a node of 192 CPUs nothing
# but the thread count bounds it. Two arenas hold ~7 MB under the same load.
AGENT_MALLOC_ARENAS = 2
# glibc serves a request of 128 KiB or more with an mmap of its own, given back
# when freed, but raises that threshold to the size of each such block freed
# (up to 32 MiB), so that the large blocks that follow (the store's batches,
# the lists of their rows, gRPC's messages) come from the arenas, and what they
# leave free there between chunks still in use stays resident until reused or
# trimmed. Under the soak's load the arenas held 45 MB free against 15 MB in
# use (~24 MB of the free resident), nothing mapped on its own. Set, the
# threshold stays at glibc's first value, and so does the trim threshold.
AGENT_MMAP_THRESHOLD = 128 * 1024


def _mallopt(param: int, value: int, env_name: str, tunable: str, environ) -> bool:
    """mallopt(param, value) unless the user set it (env_name, or the tunable in
    GLIBC_TUNABLES), which glibc then keeps. False where nothing was set, or libc
    is not glibc."""
    if env_name in environ or tunable in environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        return bool(LIBC.mallopt(param, value))
    except AttributeError:      # not glibc
        return False


def cap_malloc_arenas(arenas: int = AGENT_MALLOC_ARENAS, environ=os.environ) -> bool:
    """mallopt(M_ARENA_MAX, arenas), called before the process starts threads,
    unless the user chose a limit (MALLOC_ARENA_MAX, or glibc.malloc.arena_max in
    GLIBC_TUNABLES)."""
    return _mallopt(M_ARENA_MAX, arenas, "MALLOC_ARENA_MAX", "glibc.malloc.arena_max", environ)


def fix_mmap_threshold(threshold: int = AGENT_MMAP_THRESHOLD, environ=os.environ) -> bool:
    """mallopt(M_MMAP_THRESHOLD, threshold): blocks of that size or more are
    mapped on their own and unmapped when freed, for the whole run (glibc
    otherwise raises the threshold as they are freed), unless the user chose one
    (MALLOC_MMAP_THRESHOLD_, or glibc.malloc.mmap_threshold in GLIBC_TUNABLES)."""
    return _mallopt(M_MMAP_THRESHOLD, threshold, "MALLOC_MMAP_THRESHOLD_",
                    "glibc.malloc.mmap_threshold", environ)


def trim_heap() -> bool:
    """malloc_trim(0): give the pages that are free in every malloc arena back to
    the kernel. The embedded store's engine allocates through glibc's malloc from
    many threads (inserts, merges); the pages they free stay counted in the RSS
    until trimmed. False where nothing was given back, or libc is not glibc."""
    try:
        return bool(LIBC.malloc_trim(0))
    except AttributeError:      # not glibc
        return False


def release_startup_memory(maps_path: str = "/proc/self/maps") -> int:
    """Return the freed heap to the kernel (malloc_trim) and page out the
    STARTUP_LIBRARIES' file pages (MADV_PAGEOUT: clean pages are dropped,
    read back if used; the kernel leaves those another process maps too).
    Returns the bytes of mappings advised; 0 where the kernel or libc cannot
    (nothing else changes)."""
    trim_heap()
    madvise = LIBC.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released = 0
    try:
        with open(maps_path) as f:
            lines = f.readlines()
    except OSError:
        return 0
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not STARTUP_LIBRARIES.search(fields[5].strip()):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if madvise(start, end - start, MADV_PAGEOUT) == 0:
            released += end - start
    return released


# -- where the agent's memory is, for `spanlet inspect memory` -------------------

def process_rss(status_path: str = "/proc/self/status") -> dict[str, int]:
    """Bytes resident: rss, and its anon, file and shmem parts (proc(5))."""
    keys = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    out: dict[str, int] = {}
    try:
        with open(status_path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    out[keys[key]] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


MALLINFO2_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                    "uordblks", "fordblks", "keepcost")     # malloc.h, glibc 2.33


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2_FIELDS]


_mallinfo2 = getattr(LIBC, "mallinfo2", None)
if _mallinfo2 is not None:
    _mallinfo2.restype = _Mallinfo2


def malloc_totals() -> dict[str, int] | None:
    """glibc's malloc over all its arenas (mallinfo2): in_use (the bytes handed out
    and not freed, mmapped blocks included), free (held in the arenas, not given
    back to the kernel), mmapped (blocks of their own mapping), arenas (what the
    arenas took from the kernel). None where libc is not glibc 2.33 or later."""
    if _mallinfo2 is None:
        return None
    m = _mallinfo2()
    return {"in_use": m.uordblks + m.hblkhd, "free": m.fordblks, "mmapped": m.hblkhd,
            "arenas": m.arena}


def python_types() -> dict[str, int]:
    """The objects the cyclic collector tracks (instances, dicts, lists, tuples of
    them; not str, bytes or int), counted by type."""
    import gc
    from collections import Counter

    return dict(Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects()))


def _module_path(filename: str) -> str:
    """A source file as its module's path: the file less the longest sys.path entry it is under."""
    import sys

    roots = [p.rstrip("/") + "/" for p in sys.path if p and filename.startswith(p.rstrip("/") + "/")]
    return filename[len(max(roots, key=len)):] if roots else filename


class MemoryReport:
    """The answer to `spanlet inspect memory`: the process's RSS, malloc's totals,
    Python's allocated blocks and most numerous object types, and, where the agent
    runs with PYTHONTRACEMALLOC set, the source lines holding the most memory. A
    request with mark keeps its figures, and every later answer shows what changed
    since: the way to tell whether a drift of the RSS is Python objects (and which)
    or the allocator's. Each answer first runs a full collection (tens of ms in
    the agent), so that the counts and their changes are of live objects, not
    of cyclic garbage the collector had not yet reached."""

    TOP = 20

    def __init__(self):
        self._mark: dict | None = None

    def answer(self, mark: bool = False) -> dict:
        import gc
        import sys
        import time
        import tracemalloc

        gc.collect()
        types = python_types()
        now = {"rss": process_rss(), "malloc": malloc_totals(),
               "python": {"allocated_blocks": sys.getallocatedblocks(), "gc_objects": sum(types.values())}}
        snapshot = None
        if tracemalloc.is_tracing():
            snapshot = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__)])
        then = self._mark
        out = {**now, "python": dict(now["python"]), "since_mark": None, "tracemalloc": None}
        if then is None:
            rows = [{"type": t, "count": n, "change": None} for t, n in types.items()]
            rows.sort(key=lambda r: -r["count"])
        else:
            out["since_mark"] = {"seconds": time.monotonic() - then["at"], "rss": then["rss"],
                                 "malloc": then["malloc"], "python": then["python"]}
            rows = [{"type": t, "count": types.get(t, 0), "change": types.get(t, 0) - then["types"].get(t, 0)}
                    for t in types.keys() | then["types"].keys()]
            rows.sort(key=lambda r: (-abs(r["change"]), -r["count"]))
        out["python"]["types"] = rows[:self.TOP]
        if snapshot is not None:
            traced, peak = tracemalloc.get_traced_memory()
            if then is not None and then["snapshot"] is not None:
                stats = [(s.traceback[0], s.size, s.count, s.size_diff)
                         for s in snapshot.compare_to(then["snapshot"], "lineno")]
            else:
                stats = [(s.traceback[0], s.size, s.count, None) for s in snapshot.statistics("lineno")]
            out["tracemalloc"] = {"traced": traced, "peak": peak, "top": [
                {"where": f"{_module_path(frame.filename)}:{frame.lineno}", "size": size, "count": count,
                 "size_change": change} for frame, size, count, change in stats[:self.TOP]]}
        if mark:
            self._mark = {**now, "at": time.monotonic(), "snapshot": snapshot, "types": types}
        return out
