"""GPU memory traffic per span, against the real kernel: every copy and
allocation entry point of the stand-in libcuda (exported under its real name
and signature), and the stand-in cudart's cudaMemcpy/cudaMemcpyAsync/
cudaMalloc reaching it as real cudart does. Exact bytes per direction on the
span's facts row and in spanlet_gpu_memcpy_bytes_total, exact calls, the
bytes allocated, and time only in synchronous copies."""

from __future__ import annotations

import pytest

from spanlet.metrics import kernel as kernel_metrics

from gpu_harness import MODES, cgroup_id, in_span

pytestmark = pytest.mark.kernel

REPEATS = range(20)
HOST, DEVICE, ARRAY, UNIFIED = 1, 2, 3, 4    # CUmemorytype
H2D, D2H, D2D, OTHER = "h2d", "d2h", "d2d", "other"
# cudaMemcpyKind
RT_H2H, RT_H2D, RT_D2H, RT_D2D, RT_DEFAULT = range(5)

# (workload line, direction, bytes it copies): distinct figures per line.
SYNC = [
    ("cuMemcpyHtoD_v2 3 1000", H2D, 3000),
    ("cuMemcpyHtoD_v2_ptds 2 1001", H2D, 2002),
    ("cuMemcpyDtoH_v2 2 2000", D2H, 4000),
    ("cuMemcpyDtoH_v2_ptds 1 2001", D2H, 2001),
    ("cuMemcpyDtoD_v2 1 3000", D2D, 3000),
    ("cuMemcpyDtoD_v2_ptds 2 3001", D2D, 6002),
    ("cuMemcpy 1 4000", OTHER, 4000),
    ("cuMemcpy_ptds 1 4001", OTHER, 4001),
    ("cuMemcpyPeer 1 5000", D2D, 5000),
    ("cuMemcpyPeer_ptds 1 5001", D2D, 5001),
    (f"cuMemcpy2D_v2 1 {HOST} {DEVICE} 100 7", H2D, 700),
    (f"cuMemcpy2D_v2_ptds 2 {DEVICE} {HOST} 101 7", D2H, 1414),
    (f"cuMemcpy2DUnaligned_v2 1 {ARRAY} {DEVICE} 102 7", D2D, 714),
    (f"cuMemcpy2DUnaligned_v2_ptds 1 {UNIFIED} {DEVICE} 103 7", OTHER, 721),
    (f"cuMemcpy3D_v2 1 {HOST} {ARRAY} 10 11 12", H2D, 1320),
    (f"cuMemcpy3D_v2_ptds 1 {ARRAY} {HOST} 13 11 12", D2H, 1716),
    # the runtime: each call reaches one driver copy, counted once
    (f"cudaMemcpy 1 6000 {RT_H2D}", H2D, 6000),
    (f"cudaMemcpy 2 6001 {RT_D2H}", D2H, 12002),
    (f"cudaMemcpy 1 6002 {RT_D2D}", D2D, 6002),
    (f"cudaMemcpy 1 6003 {RT_DEFAULT}", OTHER, 6003),
    (f"cudaMemcpy 1 6004 {RT_H2H}", OTHER, 6004),
]
ASYNC = [
    ("cuMemcpyHtoDAsync_v2 2 7000", H2D, 14000),
    ("cuMemcpyHtoDAsync_v2_ptsz 1 7001", H2D, 7001),
    ("cuMemcpyDtoHAsync_v2 1 7002", D2H, 7002),
    ("cuMemcpyDtoHAsync_v2_ptsz 3 7003", D2H, 21009),
    ("cuMemcpyDtoDAsync_v2 1 7004", D2D, 7004),
    ("cuMemcpyDtoDAsync_v2_ptsz 1 7005", D2D, 7005),
    ("cuMemcpyAsync 1 7006", OTHER, 7006),
    ("cuMemcpyAsync_ptsz 1 7007", OTHER, 7007),
    ("cuMemcpyPeerAsync 1 7008", D2D, 7008),
    ("cuMemcpyPeerAsync_ptsz 1 7009", D2D, 7009),
    (f"cuMemcpy2DAsync_v2 1 {DEVICE} {DEVICE} 30 3", D2D, 90),
    (f"cuMemcpy2DAsync_v2_ptsz 1 {HOST} {HOST} 31 3", OTHER, 93),
    (f"cuMemcpy3DAsync_v2 1 {DEVICE} {ARRAY} 4 5 6", D2D, 120),
    (f"cuMemcpy3DAsync_v2_ptsz 1 {UNIFIED} {UNIFIED} 4 5 7", OTHER, 140),
    (f"cudaMemcpyAsync 1 8000 {RT_H2D}", H2D, 8000),
    (f"cudaMemcpyAsync 1 8001 {RT_D2H}", D2H, 8001),
    (f"cudaMemcpyAsync 1 8002 {RT_DEFAULT}", OTHER, 8002),
]
# (workload line, bytes asked for); no copy calls
ALLOCS = [
    ("cuMemAlloc_v2 2 4096", 8192),
    ("cuMemAllocAsync 1 100", 100),
    ("cuMemAllocAsync_ptsz 1 200", 200),
    ("cuMemAllocPitch_v2 1 1000 3", 3000),    # width x height (the pitch is the driver's)
    ("cudaMalloc 1 5000", 5000),
]


def calls(line: str) -> int:
    return int(line.split()[1])


def by_direction(copies) -> dict[str, int]:
    out = {d: 0 for d in (H2D, D2H, D2D, OTHER)}
    for _, d, n in copies:
        out[d] += n
    return out


def run(w, lines) -> int:
    """The lines' calls, each succeeded; the time they took (ns)."""
    out = w.run(*(f"copy {line}" for line in lines))
    assert [o.split()[2] for o in out] == ["0"] * len(lines), out
    return sum(int(o.split()[3]) for o in out)


@pytest.mark.parametrize("rep", REPEATS)
@pytest.mark.parametrize("mode", MODES)
def test_every_copy_and_allocation_counts_its_bytes_once_by_direction(traced, mode, rep):
    w, span, gpu = traced(launch_events="off", **MODES[mode])
    sync_span = in_span(span, w)
    sync_took = run(w, [line for line, *_ in SYNC])
    async_span = in_span(span, w)
    run(w, [line for line, *_ in ASYNC] + [line for line, _ in ALLOCS])
    span.clear(w.tid)
    # outside any span: counted per cgroup, on no row
    run(w, ["cuMemcpyHtoD_v2 1 999", "cuMemAlloc_v2 1 999"])

    for sp, copies, allocs in ((sync_span, SYNC, []), (async_span, ASYNC, ALLOCS)):
        row = span.facts.take(*sp)
        want = by_direction(copies)
        assert (row.memcpy_h2d_bytes, row.memcpy_d2h_bytes, row.memcpy_d2d_bytes,
                row.memcpy_other_bytes) == (want[H2D], want[D2H], want[D2D], want[OTHER])
        assert row.memcpy_calls == sum(calls(line) for line, *_ in copies)
        assert row.alloc_bytes == sum(n for _, n in allocs)
        assert row.launches == 0 and row.syncs == 0

    cg = cgroup_id(w.pid)
    total = by_direction(SYNC + ASYNC)
    total[H2D] += 999
    assert {d: n for (c, d), n in gpu.memcpy_bytes().items() if c == cg} == total
    workload = lambda c: {"namespace": "ns", "pod": f"pod-{c}", "container": "c"}  # noqa: E731
    fam = kernel_metrics.spanlet_gpu_memcpy_bytes_total(gpu, workload)
    assert {dict(s.labels)["direction"]: s.value for s in fam.samples
            if dict(s.labels)["pod"] == f"pod-{cg}"} == total
    assert sync_took > 0


@pytest.mark.parametrize("rep", range(3))
def test_only_synchronous_copies_add_copy_time(traced, rep):
    w, span, gpu = traced(launch_events="off", **MODES["default"])
    sync_span = in_span(span, w)
    took = run(w, [line for line, *_ in SYNC] * 10)
    async_span = in_span(span, w)
    run(w, [line for line, *_ in ASYNC] * 10)
    span.clear(w.tid)
    sync_row, async_row = span.facts.take(*sync_span), span.facts.take(*async_span)
    # each call's time from its entry to its return, inside the workload's clock readings
    assert 0 < sync_row.memcpy_ns <= took
    assert async_row.memcpy_ns == 0
    assert async_row.memcpy_calls == 10 * sum(calls(line) for line, *_ in ASYNC)
