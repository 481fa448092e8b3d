"""Library discovery from the kernel's changes (bpf/span_ctx.bpf.c
maps_changed_pids): an exec, a library loaded with dlopen and an exit
name their process; between full scans a refresh reads only those, so
processes that change nothing cost nothing however many there are."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import cuda_standin
from spanlet.discovery import LibraryFinder
from spanlet.probes.span_ctx import MAPS_SETTLE_NS


def settle() -> None:
    """Past the age a mark must have to be read (the daemon refreshes every second)."""
    time.sleep(MAPS_SETTLE_NS / 1e9 + 0.02)

pytestmark = pytest.mark.kernel


def finder(span) -> LibraryFinder:
    # full scans far apart: whatever is found after the first came from the watch
    return LibraryFinder([cuda_standin.DRIVER.partition(".so")[0] + ".so"], full_rescan_s=3600,
                         watch=span.maps_watch.subscribe())


@pytest.mark.parametrize("run", range(5))
def test_exec_dlopen_and_exit_are_seen_without_a_full_scan(standin, spawn, probes, tmp_path, run):
    span = probes.span_ctx()
    f = finder(span)
    f.refresh()
    assert f.stats.full
    copy = standin.copy_libs(tmp_path / f"copy{run}")
    w = spawn(standin.workload)          # an exec
    settle()
    f.refresh()
    assert not f.stats.full and w.pid in f._seen
    assert not any(str(copy) in lib.path for lib in f.libraries)
    w.load(copy)                         # dlopen: the loader maps the library executable
    settle()
    new = f.refresh()
    assert not f.stats.full
    assert [(lib.pid, lib.path) for lib in new] == [(w.pid, str(copy / cuda_standin.DRIVER))]
    w.close()                            # the exit names it too: its libraries are unmapped
    settle()
    f.refresh()
    assert w.pid not in f._seen or not f._seen[w.pid].keys
    assert any(lib.path == str(copy / cuda_standin.DRIVER) for lib in f.unmapped(0))


def test_processes_that_change_nothing_are_never_read_again(standin, spawn, probes):
    """50 idle processes, each holding many mappings: after the refresh that
    sees them start, none of them is read again, whatever else runs."""
    span = probes.span_ctx()
    f = finder(span)
    f.refresh()
    idle = [subprocess.Popen([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(50)]
    try:
        for p in idle:   # each has started (and mapped its libraries) once it answers
            assert p.stdout.readline() == "ready\n"
        settle()
        f.refresh()
        f.refresh()
        read_at = {p.pid: f._seen[p.pid].read_at for p in idle if p.pid in f._seen}
        assert len(read_at) == 50
        for _ in range(5):
            f.refresh()
            assert not f.stats.full
        assert {pid: f._seen[pid].read_at for pid in read_at} == read_at
    finally:
        for p in idle:
            p.kill()
            p.wait()
