"""The agent on NVIDIA's real libcuda.so.1 (Debian's libcuda1, fetched into a
cache folder by the test's setup, never installed), without a GPU: every call
returns an error at once (CUDA_ERROR_NOT_INITIALIZED: no cuInit) after the
exported function's entry ran, so its uprobe fires. What is shown: the agent
finds and attaches to the real symbols, and counts what reaches them. A
launch the driver refuses launched nothing and is counted as the launch
attempt it was (metric #1's help says so); a capture the driver refuses is no
capture. Real CUDA C++ programs built here with nvcc (shared and static
runtime) show what the runtime does before the driver."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from spanlet import events
from spanlet.events import Api, Entry, Modality
from spanlet.probes import uprobe_multi
from spanlet.probes.gpu import DRIVER_HOOKS, probe_sites

import real_cuda
from require import cannot_run
from gpu_harness import cgroup_id, counts, launch_line, launches, mine, read_events

pytestmark = pytest.mark.kernel

NOT_INITIALIZED = 3   # CUDA_ERROR_NOT_INITIALIZED
FUNC = 0xF00D


@pytest.fixture(scope="module")
def libcuda():
    """The real driver's folder. Debian's mirror is normally reachable from
    where these tests run: under SPANLET_REQUIRE_KERNEL=1 a fetch that fails
    fails the test, elsewhere it skips it (saying why)."""
    try:
        return real_cuda.libcuda_dir()
    except real_cuda.FetchError as e:
        cannot_run(f"the real libcuda could not be fetched: {e}")


LAUNCHES = [  # (entry point, count, grid, block, shared mem, stream)
    ("cuLaunchKernel", 2, (1, 2, 3), (32, 4, 2), 700, 0x11),
    ("cuLaunchKernel_ptsz", 3, (7, 1, 1), (64, 1, 1), 0, 0x12),
    ("cuLaunchKernelEx", 4, (65535, 7, 1), (1024, 1, 1), 49152, 0x13),
    ("cuLaunchKernelEx_ptsz", 1, (9, 9, 9), (8, 8, 8), 16, 0x14),
    ("cuLaunchCooperativeKernel", 2, (80, 1, 1), (256, 1, 1), 1024, 0x15),
    ("cuLaunchCooperativeKernel_ptsz", 1, (81, 2, 1), (128, 2, 1), 2048, 0x16),
    ("cuLaunchGrid", 1, (40, 30, 1), (0, 0, 0), 0, 0),
    ("cuLaunchGridAsync", 2, (50, 60, 1), (0, 0, 0), 0, 0x44),
    ("cuLaunch", 1, (1, 1, 1), (0, 0, 0), 0, 0),
]
SYNCS = ["cuStreamSynchronize", "cuStreamSynchronize_ptsz", "cuCtxSynchronize", "cuEventSynchronize"]
# (copy or allocation line, calls, bytes copied h2d, d2h, d2d, other, bytes allocated)
COPIES = [
    ("cuMemcpyHtoD_v2 2 1000", 2, (2000, 0, 0, 0), 0),
    ("cuMemcpyDtoHAsync_v2_ptsz 1 3000", 1, (0, 3000, 0, 0), 0),
    ("cuMemcpyDtoD_v2_ptds 1 5000", 1, (0, 0, 5000, 0), 0),
    ("cuMemcpyAsync 3 7", 3, (0, 0, 0, 21), 0),
    ("cuMemcpy2D_v2 1 1 2 64 3", 1, (192, 0, 0, 0), 0),    # host to device, 64 x 3
    ("cuMemcpy3DAsync_v2 1 2 1 4 5 6", 1, (0, 120, 0, 0), 0),
    ("cuMemAlloc_v2 2 4096", 0, (0, 0, 0, 0), 8192),
    ("cuMemAllocPitch_v2 1 100 3", 0, (0, 0, 0, 0), 300),
]


def test_the_real_driver_is_probed_on_the_jump_after_each_trampolines_compare(libcuda):
    # Each export is `cmpl $imm32, disp32(%rip); je; jmp *disp32(%rip)`: a
    # uprobe on the compare (RIP-relative) is single-stepped, a second trap;
    # the kernel emulates the je. Every hooked function's probe site is 10
    # bytes in, where the arguments, stack and return address are the entry's.
    from bcc import BPF

    path = str(libcuda / "libcuda.so.1")
    pattern = "^(" + "|".join(h.symbol for h in DRIVER_HOOKS) + ")$"
    funcs = {a for _, a in BPF.get_user_functions_and_addresses(path.encode(), pattern.encode())}
    assert len(funcs) == len(DRIVER_HOOKS) - 2       # 535: no ...CaptureToGraph, no cuCtxSynchronize_v2
    sites = probe_sites(path, [(None, a) for a in sorted(funcs)])
    assert [site - a for a, (_, site) in zip(sorted(funcs), sites)] == [10] * len(funcs)
    with open(path, "rb") as f:                      # a je (0x74) at each
        for off in uprobe_multi.file_offsets(path, [site for _, site in sites]):
            f.seek(off)
            assert f.read(1) == b"\x74"


@pytest.mark.parametrize("rep", range(3))
def test_the_real_driver_symbols_are_hooked_and_what_reaches_them_counted(libcuda, standin, spawn,
                                                                          probes, rep):
    w = spawn(standin.workload)
    w.send(f"load-driver {libcuda / 'libcuda.so.1'}")
    w.expect("loaded")
    span = probes.span_ctx()
    gpu = probes(launch_events="all", pin_dir=span.shared_pin_dir(), timing=False,
                 runtime_hooks=False)
    (lib,) = mine(gpu.libraries(), libcuda)
    # every hook the driver of this release exports (535 has no
    # cuStreamBeginCaptureToGraph, no cuCtxSynchronize_v2), each its own
    # function: nothing required missing
    assert lib.missing == []
    assert set(lib.symbols) == {h.symbol for h in DRIVER_HOOKS} - {"cuStreamBeginCaptureToGraph",
                                                                   "cuCtxSynchronize_v2"}

    trace_id, span_id = real = (bytes(range(1, 17)), 0x5EED + rep)
    span.set(w.tid, trace_id, span_id, Modality.audio)
    out = w.run(*(launch_line(*c) for c in LAUNCHES),
                # the driver refuses the capture: the launches on that stream are launches
                "begin cuStreamBeginCapture_v2 0x51 0", launches("cuLaunchKernel", 3, 0x51),
                "end cuStreamEndCapture 0x51",
                "replay cuGraphLaunch 0x1234 3", "replay cuGraphLaunch_ptsz 0x1234 2",
                *(f"{name} 0" for name in SYNCS),
                *(f"copy {line}" for line, *_ in COPIES))
    n = sum(c[1] for c in LAUNCHES) + 3
    assert out[:len(LAUNCHES)] == [f"failed {c[1]} {NOT_INITIALIZED}" for c in LAUNCHES]
    assert out[len(LAUNCHES):len(LAUNCHES) + 4] == [
        f"begin {NOT_INITIALIZED}", f"failed 3 {NOT_INITIALIZED}", f"end {NOT_INITIALIZED} 0",
        "replay 3"]
    cg = cgroup_id(w.pid)
    assert counts(gpu.launches(), cg) == {(cg, Modality.audio, Api.driver): n}
    assert counts(gpu.graph_launches(), cg) == {(cg, Modality.audio, Api.graph): 5}
    assert counts(gpu.unknown_graph_launches(), cg) == {(cg, Modality.audio, Api.graph): 5}
    assert {k[2]: c for k, (c, _) in counts(gpu.sync_wait(), cg).items()} == {Api.driver: len(SYNCS)}
    row = span.facts.take(*real)
    assert (row.launches, row.graph_launches, row.graph_kernels, row.syncs) == (n, 5, 0, len(SYNCS))
    # every copy and allocation refused (no cuInit) after its entry: counted as asked
    assert [line.split()[:3] for line in out[-len(COPIES):]] == [
        ["copy", line.split()[0], line.split()[1]] for line, *_ in COPIES]
    assert (row.memcpy_h2d_bytes, row.memcpy_d2h_bytes, row.memcpy_d2d_bytes, row.memcpy_other_bytes) == \
        tuple(map(sum, zip(*(b for _, _, b, _ in COPIES))))
    assert row.memcpy_calls == sum(c for _, c, _, _ in COPIES)
    assert row.alloc_bytes == sum(a for *_, a in COPIES)

    got = sorted(read_events(gpu, w.pid, n + len(SYNCS)), key=lambda e: e.hdr.ts_ns)
    launched = [e for e in got if e.kind == events.Kind.GPU_LAUNCH]
    expected = [(Entry[name], grid, block, sm, st) for name, k, grid, block, sm, st in LAUNCHES
                for _ in range(k)] + [(Entry.cuLaunchKernel, (1, 1, 1), (1, 1, 1), 0, 0x51)] * 3
    assert [(Entry(e.entry), tuple(e.grid), tuple(e.block), e.shared_mem, e.stream)
            for e in launched] == expected
    assert all(e.func == FUNC for e in launched)
    assert [Entry(e.entry).name for e in got if e.kind == events.Kind.GPU_SYNC] == SYNCS


# -- real CUDA C++ programs (nvcc, <<<>>>) ----------------------------------------
PROGRAMS = Path(__file__).resolve().parent.parent / "support" / "cuda_programs"


@pytest.fixture(scope="module")
def nvcc_programs(tmp_path_factory):
    """launch.cu built against the shared and the static runtime."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        cannot_run("nvcc is not on the PATH (these machines carry the CUDA toolkit)")
    out = tmp_path_factory.mktemp("cuda_programs")
    built = {}
    for cudart in ("shared", "static"):
        exe = out / f"launch_{cudart}"
        subprocess.run([nvcc, "-cudart", cudart, "-o", str(exe), str(PROGRAMS / "launch.cu")],
                       check=True, capture_output=True, timeout=300)
        built[cudart] = exe
    return built


def _start(exe: Path, n: int, libcuda_dir: Path, cgroup: Path) -> subprocess.Popen:
    env = {**os.environ, "LD_LIBRARY_PATH": str(libcuda_dir)}
    p = subprocess.Popen([str(exe), str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=env)
    (cgroup / "cgroup.procs").write_text(str(p.pid))
    return p


@pytest.mark.parametrize("cudart, runtime_hooks", [
    ("shared", True), ("shared", False), ("static", True), ("static", False)])
def test_nvcc_programs_count_what_reaches_the_hooked_entry_points(nvcc_programs, libcuda, cgroup,
                                                                   probes, cudart, runtime_hooks):
    # Without a GPU the runtime (CUDA 13) refuses the host's driver (535):
    # every launch returns cudaErrorInsufficientDriver (35) from the runtime's
    # entry point, before any driver call; the runtime has closed the driver.
    n = 6
    p = _start(nvcc_programs[cudart], n, libcuda, cgroup)
    try:
        assert p.stdout.readline().split() == ["ready", "35"]
        gpu = probes(launch_events="off", timing=False, runtime_hooks=runtime_hooks)
        libs = {lib.library.name: lib for lib in gpu.libraries() if lib.pid == p.pid}
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().split() == ["launched", str(n), "35", "35"]
        cg = cgroup_id(p.pid)
        if cudart == "shared" and runtime_hooks:
            # the real libcudart.so.13's entry points hooked: the <<<>>> stub
            # tail-jumps into cudaLaunchKernel, each attempt counted once
            rt = libs["libcudart.so"]
            assert rt.missing == [] and {"cudaLaunchKernel", "cudaLaunchKernelExC",
                                         "cudaStreamSynchronize"} <= set(rt.symbols)
            assert counts(gpu.launches(), cg) == {(cg, Modality.other, Api.runtime): n}
        else:
            # nothing reached a hooked function: the driver was never called,
            # and a runtime linked into the executable is not hooked
            assert "libcuda.so" not in libs
            assert counts(gpu.launches(), cg) == {}
    finally:
        p.stdin.close()
        p.wait(10)
