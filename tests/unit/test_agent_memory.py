"""`spanlet inspect memory`'s answer, in this process: the RSS and malloc's
totals read from the kernel and glibc, the Python objects counted by type, the
change since a mark exact for objects the test makes, tracemalloc's lines where
it runs; and the agent's threads named in the kernel as in Python."""

from __future__ import annotations

import sys
import threading
import tracemalloc
from pathlib import Path

import pytest

from spanlet import osthreads
from spanlet.memory import MemoryReport, malloc_totals, process_rss


class Held:
    """Instances of a type of this test's own, so their count is exactly the test's."""

    def __init__(self, i: int):
        self.i = i


def test_rss_parts_add_up():
    r = process_rss()
    assert r["rss"] > 0 and r["anon"] > 0
    assert r["anon"] + r["file"] + r["shmem"] == r["rss"]


def test_malloc_totals_follow_an_allocation():
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    before = malloc_totals()
    block = libc.malloc(64 << 20)           # over the mmap threshold: a mapping of its own
    try:
        after = malloc_totals()
        assert after["mmapped"] - before["mmapped"] >= 64 << 20
        assert after["in_use"] - before["in_use"] >= 64 << 20
    finally:
        libc.free(ctypes.c_void_p(block))
    assert malloc_totals()["in_use"] < after["in_use"]


def test_the_change_since_the_mark_counts_the_objects_made():
    report = MemoryReport()
    first = report.answer(mark=True)
    assert first["since_mark"] is None and all(t["change"] is None for t in first["python"]["types"])
    held = [Held(i) for i in range(5000)]
    later = report.answer()
    rows = {t["type"]: t for t in later["python"]["types"]}
    name = f"{__name__}.Held"
    assert rows[name]["count"] == 5000 and rows[name]["change"] == 5000
    assert later["python"]["types"][0]["type"] == name        # the largest change leads
    assert later["python"]["gc_objects"] > later["since_mark"]["python"]["gc_objects"]
    assert later["since_mark"]["seconds"] >= 0
    del held
    # the mark stays where it was: the objects gone, their change is 0 again
    gone = {t["type"]: t for t in report.answer()["python"]["types"]}
    assert gone.get(name, {"change": 0})["change"] == 0


class Cyclic:
    """Instances of this test's own, each in a reference cycle with itself."""

    def __init__(self):
        self.me = self


def test_the_counts_are_of_live_objects_not_garbage_awaiting_collection():
    import gc

    report = MemoryReport()
    gc.disable()            # as between two of the collector's passes
    try:
        report.answer(mark=True)
        for _ in range(3000):
            Cyclic()        # unreachable at once, freed only by a collection
        rows = {t["type"]: t for t in report.answer()["python"]["types"]}
    finally:
        gc.enable()
    assert rows.get(f"{__name__}.Cyclic", {"count": 0})["count"] == 0


def test_tracemalloc_lines_where_it_traces():
    report = MemoryReport()
    assert report.answer()["tracemalloc"] is None
    tracemalloc.start()
    try:
        report.answer(mark=True)
        blob = [bytes(1000) for _ in range(2000)]                     # the line below's
        here = f"{Path(__file__).name}:{sys._getframe().f_lineno - 1}"
        tm = report.answer()["tracemalloc"]
        [row] = [r for r in tm["top"] if r["where"].endswith(here)]
        assert row["size_change"] >= 2000 * 1000 and row["count"] >= 2000
        assert tm["traced"] >= 2000 * 1000
        assert not any("tracemalloc.py" in r["where"] for r in tm["top"])
        del blob
    finally:
        tracemalloc.stop()


@pytest.fixture
def named_threads():
    assert osthreads.name_os_threads() is (sys.version_info < (3, 14))
    yield
    threading.setprofile(None)


def test_threads_take_their_python_name_in_the_kernel(named_threads):
    seen = {}

    def look():
        seen["comm"] = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
        seen["profile"] = sys.getprofile()

    for name, comm in (("store-flush", "store-flush"), ("a-thread-name-longer-than-15", "a-thread-name-l")):
        t = threading.Thread(target=look, name=name)
        t.start()
        t.join()
        assert seen == {"comm": comm, "profile": None}      # named, and the hook gone



def test_what_the_agent_calls_again_and_again_makes_no_cyclic_garbage():
    """The heap trim (every minute), malloc's totals (every memory report) and a
    thread's naming (every thread started) make no objects that only the
    collector's full passes free: each once made a ctypes.CDLL (or a Structure
    class), whose classes sit in reference cycles, and `inspect memory` saw them
    pile up. (The report itself is left out: it runs a full collection.)"""
    import gc

    from spanlet.memory import python_types, trim_heap

    def calls():
        trim_heap()
        malloc_totals()
        osthreads.set_os_name(threading.current_thread().name)

    calls()                                  # what the first calls make once (caches)
    gc.collect()
    gc.disable()                             # what the calls leave for the collector stays counted
    try:
        before = python_types()
        for _ in range(20):
            calls()
        after = python_types()
    finally:
        gc.enable()
    grown = {t: after[t] - before.get(t, 0) for t in after if after[t] > before.get(t, 0)}
    assert not {t: n for t, n in grown.items() if n >= 20}, grown
