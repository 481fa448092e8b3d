"""The agent caps glibc's malloc arenas (memory.cap_malloc_arenas) before its
threads start, unless the user chose a limit. Shown in child processes that
start threads which all allocate while the others are alive (each such
thread gets an arena of its own, up to the limit), then count the arenas
with malloc_info. And it fixes glibc's mmap threshold (memory.fix_mmap_threshold),
so that a large block freed does not send the next ones to the arenas: shown
in child processes by where a second block of the same size lands."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import ctypes, os, sys, tempfile, threading
    from spanlet.memory import cap_malloc_arenas

    capped = cap_malloc_arenas(int(sys.argv[1])) if sys.argv[1] != "none" else False
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.fopen.restype = ctypes.c_void_p
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    threads = 6
    allocated, done = threading.Barrier(threads + 1), threading.Event()

    def allocate():
        libc.malloc(1 << 16)          # past pymalloc: glibc's malloc, in this thread's arena
        allocated.wait()
        done.wait()

    workers = [threading.Thread(target=allocate) for _ in range(threads)]
    for t in workers:
        t.start()
    allocated.wait()                  # all alive, each has allocated
    with tempfile.NamedTemporaryFile(suffix=".xml") as f:
        fp = libc.fopen(f.name.encode(), b"w")
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        heaps = open(f.name).read().count("<heap nr=")
    done.set()
    for t in workers:
        t.join()
    print(int(capped), heaps)
""")


def arenas(arg: str, **env: str) -> tuple[bool, int]:
    environ = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", CHILD, arg], capture_output=True, text=True, check=True,
                         env={**environ, **env}).stdout.split()
    return bool(int(out[0])), int(out[1])


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_the_cap_bounds_the_arenas_of_threads_that_allocate_together(limit):
    assert arenas(str(limit)) == (True, limit)


def test_without_the_cap_each_thread_gets_an_arena():
    assert arenas("none") == (False, 7)        # the main arena and one per thread


@pytest.mark.parametrize("env", [{"MALLOC_ARENA_MAX": "3"}, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=3"}])
def test_a_limit_the_user_set_is_kept(env):
    assert arenas("2", **env) == (False, 3)


THRESHOLD_CHILD = textwrap.dedent("""
    import ctypes, sys
    from spanlet.memory import fix_mmap_threshold, malloc_totals

    fixed = fix_mmap_threshold() if sys.argv[1] == "fix" else False
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block = 4 << 20
    mapped = []
    for _ in range(2):
        before = malloc_totals()["mmapped"]
        p = libc.malloc(block)
        mapped.append(malloc_totals()["mmapped"] - before >= block)
        libc.free(p)
    print(int(fixed), *(int(m) for m in mapped))
""")


def second_block(arg: str, **env: str) -> tuple[bool, bool, bool]:
    environ = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", THRESHOLD_CHILD, arg], capture_output=True, text=True,
                         check=True, env={**environ, **env}).stdout.split()
    return tuple(bool(int(x)) for x in out)


def test_a_fixed_threshold_maps_every_large_block():
    assert second_block("fix") == (True, True, True)


def test_without_it_a_freed_block_sends_the_next_to_the_arenas():
    assert second_block("none") == (False, True, False)     # glibc raised its threshold to 4 MiB


@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": str(8 << 20)},
                                 {"GLIBC_TUNABLES": f"glibc.malloc.mmap_threshold={8 << 20}"}])
def test_a_threshold_the_user_set_is_kept(env):
    assert second_block("fix", **env) == (False, False, False)   # 4 MiB under the user's 8 MiB
