"""Every way a CUDA stack launches, against the real kernel: the stand-in
libcuda exports each driver entry point under its real name and signature, the
stand-in cudart reaches it through dlsym'd pointers as real cudart does. Exact
counts per entry point, per span (the span facts row) and in metric #1;
arguments of each; stream capture, graphs and their replays; the sync calls."""

from __future__ import annotations

import secrets

import pytest

from spanlet import events
from spanlet.events import Api, Entry, Modality
from spanlet.metrics import kernel as kernel_metrics

from gpu_harness import cgroup_id, counts, launch_line, launches, read_events

pytestmark = pytest.mark.kernel

FUNC = 0xF00D
BAD_FUNC = 0xBAD           # the stand-in driver refuses a launch of it (CUDA_ERROR_INVALID_HANDLE)
REPEATS = range(3)
DRIVER, RUNTIME, GRAPH = Api.driver, Api.runtime, Api.graph

# (entry point called, count, grid, block, shared mem, stream, the driver
# entry point it reaches): distinct figures per entry so that no record can be
# mistaken for another's.
CALLS = [
    ("cuLaunchKernel", 2, (1, 2, 3), (32, 4, 2), 700, 0x11, Entry.cuLaunchKernel),
    ("cuLaunchKernel_ptsz", 3, (7, 1, 1), (64, 1, 1), 0, 0x12, Entry.cuLaunchKernel_ptsz),
    ("cuLaunchKernelEx", 4, (65535, 7, 1), (1024, 1, 1), 49152, 0x7F0012345678,
     Entry.cuLaunchKernelEx),
    ("cuLaunchKernelEx_ptsz", 5, (9, 9, 9), (8, 8, 8), 16, 0x14, Entry.cuLaunchKernelEx_ptsz),
    ("cuLaunchCooperativeKernel", 6, (80, 1, 1), (256, 1, 1), 1024, 0x15,
     Entry.cuLaunchCooperativeKernel),
    ("cuLaunchCooperativeKernel_ptsz", 7, (81, 2, 1), (128, 2, 1), 2048, 0x16,
     Entry.cuLaunchCooperativeKernel_ptsz),
    ("cudaLaunchKernel", 8, (4096, 2, 9), (128, 2, 3), 1 << 16, 0x33, Entry.cuLaunchKernel),
    ("cudaLaunchKernel_ptsz", 9, (5, 6, 7), (2, 3, 4), 96, 0x34, Entry.cuLaunchKernel_ptsz),
    ("cudaLaunchKernelExC", 10, (11, 12, 13), (14, 15, 1), 4096, 0x35, Entry.cuLaunchKernelEx),
    ("cudaLaunchKernelExC_ptsz", 11, (21, 1, 1), (32, 1, 1), 8, 0x36, Entry.cuLaunchKernelEx_ptsz),
    ("cudaLaunchCooperativeKernel", 12, (3, 3, 1), (512, 1, 1), 0, 0x37,
     Entry.cuLaunchCooperativeKernel),
    ("cudaLaunchCooperativeKernel_ptsz", 13, (4, 4, 1), (16, 16, 1), 32, 0x38,
     Entry.cuLaunchCooperativeKernel_ptsz),
]
# The legacy launches: grid as their arguments say, block not known (0).
LEGACY = [
    ("cuLaunch", 2, (1, 1, 1), 0, Entry.cuLaunch),
    ("cuLaunchGrid", 3, (40, 30, 1), 0, Entry.cuLaunchGrid),
    ("cuLaunchGridAsync", 4, (50, 60, 1), 0x44, Entry.cuLaunchGridAsync),
]


def ids() -> tuple[bytes, int]:
    return secrets.token_bytes(16), int.from_bytes(secrets.token_bytes(8), "big") | 1


@pytest.fixture
def traced(standin, spawn, probes):
    """start(**gpu) → (workload, span probe, GPU probe): a workload with the
    stand-ins loaded, the span context and GPU probes sharing the span facts."""
    def start(**gpu):
        span = probes.span_ctx()
        w = spawn(standin.workload)
        w.load(standin.lib_dir)
        gpu = probes(pin_dir=span.shared_pin_dir(), **gpu)
        return w, span, gpu
    return start


def in_span(span, w, modality=Modality.text) -> tuple[bytes, int]:
    trace_id, span_id = ids()
    span.set(w.tid, trace_id, span_id, modality)
    return trace_id, span_id


MODES = {  # label → GPU probe settings
    "default": dict(timing=False, runtime_hooks=False),       # one entry-only driver probe
    "timed+runtime": dict(timing=True, runtime_hooks=True),   # both layers, return probes
}


# -- launches --------------------------------------------------------------------
@pytest.mark.parametrize("rep", REPEATS)
@pytest.mark.parametrize("mode", MODES)
def test_every_launch_entry_point_counts_once_with_its_arguments(traced, mode, rep):
    w, span, gpu = traced(launch_events="all", **MODES[mode])
    trace_id, span_id = in_span(span, w)
    script = [launch_line(name, n, g, b, sm, st) for name, n, g, b, sm, st, _ in CALLS]
    script += [launch_line(name, n, g, (1, 1, 1), 0, st) for name, n, g, st, _ in LEGACY]
    out = w.run(*script)
    assert out == []                               # every call succeeded
    cg = cgroup_id(w.pid)
    runtime = mode != "default"
    n_rt = sum(n for name, n, *_ in CALLS if name.startswith("cuda"))
    n_all = sum(c[1] for c in CALLS) + sum(c[1] for c in LEGACY)
    by_api = {DRIVER: n_all - n_rt, RUNTIME: n_rt} if runtime else {DRIVER: n_all}
    assert counts(gpu.launches(), cg) == {(cg, Modality.text, api): n for api, n in by_api.items()}
    row = span.facts.take(trace_id, span_id)
    assert row.launches == n_all
    assert row.launches_by_api == {"driver": by_api[DRIVER], "runtime": by_api.get(RUNTIME, 0)}
    assert (row.graph_launches, row.graph_kernels) == (0, 0)

    # One record per launch, with the entry point that counted it and its arguments.
    got = sorted((e for e in read_events(gpu, w.pid, n_all) if e.kind == events.Kind.GPU_LAUNCH),
                 key=lambda e: e.hdr.ts_ns)
    assert len(got) == n_all
    expected = []
    for name, n, grid, block, shmem, stream, driver_entry in CALLS:
        entry = Entry[name] if runtime and name.startswith("cuda") else driver_entry
        expected += [(entry, grid, block, shmem, stream)] * n
    for name, n, grid, stream, entry in LEGACY:
        expected += [(entry, grid, (0, 0, 0), 0, stream)] * n
    seen = [(Entry(e.entry), tuple(e.grid), tuple(e.block), e.shared_mem, e.stream) for e in got]
    assert seen == expected
    assert all(e.func == FUNC and e.hdr.span_id == span_id for e in got)
    assert all(Api(e.api) == (RUNTIME if Entry(e.entry).name.startswith("cuda") else DRIVER)
               for e in got)

    # Metric #1 as the collector renders it.
    workload = lambda c: {"namespace": "ns", "pod": f"pod-{c}", "container": "c"}  # noqa: E731
    fam = kernel_metrics.spanlet_gpu_kernel_launches_total(gpu, workload)
    mine = {dict(s.labels)["api"]: s.value for s in fam.samples if dict(s.labels)["pod"] == f"pod-{cg}"}
    assert mine == {api.name: n for api, n in by_api.items()}


@pytest.mark.parametrize("rep", REPEATS)
def test_a_failed_launch_is_counted_as_the_attempt_it_was(traced, rep):
    # The probe is at the entry of the driver's function: it counts calls,
    # not their outcome. A launch the driver refuses ran nothing, and is
    # still one launch attempt (metric #1's help says so).
    w, span, gpu = traced(launch_events="off", **MODES["default"])
    trace_id, span_id = in_span(span, w)
    out = w.run(launch_line("cuLaunchKernel", 3, (1, 1, 1), (1, 1, 1), 0, 0, BAD_FUNC),
                launch_line("cudaLaunchKernelExC", 2, (1, 1, 1), (1, 1, 1), 0, 0, BAD_FUNC),
                launches("cuLaunchKernel", 4))
    assert out == ["failed 3 400", "failed 2 400"]
    cg = cgroup_id(w.pid)
    assert counts(gpu.launches(), cg) == {(cg, Modality.text, DRIVER): 9}
    assert span.facts.take(trace_id, span_id).launches == 9
