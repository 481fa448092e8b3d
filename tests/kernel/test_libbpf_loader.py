"""The CO-RE loader (spanlet.probes.libbpf) against the real kernel and
Debian's libbpf, with an object built here by clang-16 (tests/support/core):
its settings reach the programs, a program turned off is not loaded, a
tp_btf program reads task_struct through CO-RE (a sleeping child's
sum_exec_runtime exactly as its schedstat says), a uprobe counts a child's
calls exactly, its ring buffer carries each call's record, and a map pinned
by name is shared by a second object opened with the same pin folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import core_fixture
from otlp_upstream import wait_for
from spanlet.probes.libbpf import LibbpfError, Object, kernel_btf, lib
from spanlet.probes.ringbuf import RingBufferReader

pytestmark = pytest.mark.kernel
CALLS = 1000
RUNS = 10          # exact counts: each case 10 times
LIB_C = r"""
#include <stdint.h>
__attribute__((noinline)) uint64_t probe_me(uint64_t a, uint64_t b) { __asm__ volatile(""); return a + b; }
"""
CHILD = r"""
import ctypes, sys, time
lib = ctypes.CDLL(sys.argv[1])
lib.probe_me.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
print("ready", flush=True)
sys.stdin.readline()
for i in range(int(sys.argv[2])):
    lib.probe_me(i, 2 * i)
t = time.thread_time()
while time.thread_time() - t < 0.05:
    pass
print("sleeping", flush=True)
sys.stdin.readline()
"""


@pytest.fixture(scope="module")
def obj_path(tmp_path_factory) -> Path:
    return core_fixture.build(tmp_path_factory.mktemp("core"))


@pytest.fixture(scope="module")
def probed_lib(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("lib")
    (d / "probed.c").write_text(LIB_C)
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(d / "libprobed.so"), str(d / "probed.c")], check=True)
    return d / "libprobed.so"


@pytest.fixture
def pin_root():
    path = Path("/sys/fs/bpf") / f"spanlet-test-core-{os.getpid()}-{os.urandom(3).hex()}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.fixture
def child(probed_lib):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(probed_lib), str(CALLS)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def go(proc, expect: str) -> None:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == expect + "\n"


def schedstat_run_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0])


@pytest.mark.parametrize("run", range(RUNS))
def test_settings_autoload_and_a_core_read_of_task_struct(obj_path, child, pin_root, run):
    with Object.open_file(obj_path, pin_root=pin_root) as obj:
        obj.set(target_tgid=child.pid).autoload("left_out", False).load()
        assert obj.program_fd("left_out") < 0 and obj.program_fd("on_switch") >= 0
        obj.attach("on_switch")
        go(child, "sleeping")
        seen = obj["seen"]
        key = seen.Key(child.pid)
        # asleep on stdin: switched out, and its runtime no longer moves
        wait_for(lambda: (v := seen.lookup(key)) is not None and v.sum_exec_runtime == schedstat_run_ns(child.pid),
                 10, "the child's runtime read at its switch out")
        v = seen.lookup(key)
        assert v.tgid == child.pid and v.kind == 7 and v.switches_out >= 1
        assert v.sum_exec_runtime >= 50_000_000          # it spun 50 ms of its own CPU at least
        assert all(s.tgid == child.pid for _, s in seen.items())


@pytest.mark.parametrize("run", range(RUNS))
def test_a_uprobe_its_ring_and_a_map_shared_by_pin(obj_path, child, probed_lib, pin_root, run):
    with Object.open_file(obj_path, pin_root=pin_root) as obj, Object.open_file(obj_path, pin_root=pin_root) as other:
        obj.set(call_weight=3).autoload("left_out", False).load()
        other.autoload("left_out", False).load()
        assert (pin_root / "fixture_shared").exists()
        obj.attach_uprobe("on_call", probed_lib, symbol="probe_me")
        ring_fd = obj["events"].fd
        reader = RingBufferReader(ring_fd, 64 * 4096)
        Event = obj.btf.ctype(obj.btf.find("fixture_event").id)
        records = []
        try:
            go(child, "sleeping")
            reader.consume(lambda buf, off, size: records.append(Event.from_buffer_copy(buf, off)))
        finally:
            reader.close()
        calls = obj["calls"].lookup(obj["calls"].Key(0))
        assert (calls.n, calls.args_sum) == (3 * CALLS, sum(3 * i for i in range(CALLS)))
        assert sorted(r.a for r in records) == list(range(CALLS))
        assert {(r.tgid, r.tid, r.small, bytes(r.bytes)) for r in records} == {(child.pid, child.pid, 1, b"\xab" * 5)}
        # the other object's map is the one pinned by the first: it holds the count
        shared = other["fixture_shared"]
        assert shared.lookup(shared.Key(0)).value == 3 * CALLS
        assert other["calls"].lookup(other["calls"].Key(0)).n == 0      # not pinned: its own
        # a per-CPU map reads as one value a possible CPU; a mapping's KeyError, set and delete
        per_cpu = obj["per_cpu_calls"][obj["per_cpu_calls"].Key(0)]
        assert len(per_cpu) == lib().libbpf_num_possible_cpus() and sum(v.value for v in per_cpu) == CALLS
        with pytest.raises(KeyError):
            shared[shared.Key(7)]
        shared[shared.Key(7)] = shared.Leaf(-9)
        assert obj["fixture_shared"][shared.Key(7)].value == -9
        del shared[shared.Key(7)]
        with pytest.raises(KeyError):
            del shared[shared.Key(7)]


def test_a_setting_or_program_that_is_not_there_is_named(obj_path):
    with Object.open_file(obj_path) as obj:
        with pytest.raises(KeyError, match="no setting nowhere"):
            obj.set(nowhere=1)
        with pytest.raises(KeyError, match="no program nowhere"):
            obj.autoload("nowhere", False)
        with pytest.raises(KeyError, match="no map nowhere"):
            obj["nowhere"]


def test_a_kernel_without_btf_gets_one_clear_message(obj_path, tmp_path):
    assert kernel_btf() == Path("/sys/kernel/btf/vmlinux")
    with pytest.raises(LibbpfError, match="bpf.btf_path .* is not a file"):
        kernel_btf(tmp_path / "missing")
    # the BTF given is the one CO-RE relocates against: bytes that are not BTF fail the load
    bad = tmp_path / "not_btf"
    bad.write_bytes(b"\0" * 64)
    with Object.open_file(obj_path, btf_path=bad) as obj:
        with pytest.raises(LibbpfError, match="loading the BPF object fixture"):
            obj.autoload("left_out", False).load()
