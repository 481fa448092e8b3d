"""What the start leaves resident, given back: the heap the compiles (or the
engine's start) freed, and the file pages of the libraries used only then.
The agent calls it after its start, the store's engine process after its own
(exporters/clickhouse/engine_process.py); a module of its own so that the
engine process need not import the probes."""

from __future__ import annotations

import os
import re

# BCC compiles with the LLVM and clang libraries it links: ~80 MB of their code
# is paged in by the compiles at start and stays counted in the agent's RSS,
# as does the heap the compiles freed; the embedded store's engine library
# (chdb, ~170 MB of pages touched by its start and schema checks) likewise.
# The compilers are not needed again unless a probe is compiled again, and of
# the engine only the code its inserts and queries run: what is paged out is
# read back from disk if used.
STARTUP_LIBRARIES = re.compile(r"/(?:lib(?:LLVM|clang-cpp|clang)[^/]*\.so[^/]*|_chdb[^/]*\.so)$")
MADV_PAGEOUT = 21          # uapi/asm-generic/mman-common.h, Linux 5.4
M_ARENA_MAX = -8           # malloc.h
# glibc gives each thread that allocates while the others hold theirs an arena
# of its own, up to 8 per CPU. The agent's threads (gRPC's, the receivers', the
# store's, the export's) each kept one: 30 MB after the start grew to ~68 MB in
# its first 15 minutes under the soak's load, and on a node of 192 CPUs nothing
# but the thread count bounds it. Two arenas hold ~7 MB under the same load.
AGENT_MALLOC_ARENAS = 2


def cap_malloc_arenas(arenas: int = AGENT_MALLOC_ARENAS, environ=os.environ) -> bool:
    """mallopt(M_ARENA_MAX, arenas), called before the process starts threads,
    unless the user chose a limit (MALLOC_ARENA_MAX, or glibc.malloc.arena_max in
    GLIBC_TUNABLES), which glibc then keeps. False where nothing was set, or libc
    is not glibc."""
    import ctypes

    if "MALLOC_ARENA_MAX" in environ or "glibc.malloc.arena_max" in environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(M_ARENA_MAX, arenas))
    except AttributeError:      # not glibc
        return False


def trim_heap() -> bool:
    """malloc_trim(0): give the pages that are free in every malloc arena back to
    the kernel. The embedded store's engine allocates through glibc's malloc from
    many threads (inserts, merges); the pages they free stay counted in the RSS
    until trimmed. False where nothing was given back, or libc is not glibc."""
    import ctypes

    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except AttributeError:      # not glibc
        return False


def release_startup_memory(maps_path: str = "/proc/self/maps") -> int:
    """Return the freed heap to the kernel (malloc_trim) and page out the
    STARTUP_LIBRARIES' file pages (MADV_PAGEOUT: clean pages are dropped,
    read back if used; the kernel leaves those another process maps too).
    Returns the bytes of mappings advised; 0 where the kernel or libc cannot
    (nothing else changes)."""
    import ctypes

    trim_heap()
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
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
