"""Every way a CUDA stack launches, against the real kernel: the stand-in
libcuda exports each driver entry point under its real name and signature, the
stand-in cudart reaches it through dlsym'd pointers as real cudart does. Exact
counts per entry point, per span (the span facts row) and in metric #1;
arguments of each; stream capture, graphs and their replays; the sync calls."""

from __future__ import annotations

import shutil

import pytest

from spanlet import events
from spanlet.events import Api, Entry, Modality
from spanlet.metrics import kernel as kernel_metrics

from gpu_harness import MODES, cgroup_id, counts, in_span, launch_line, launches, read_events

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


# -- graphs and stream capture ------------------------------------------------------
def handle(line: str) -> int:
    """The handle an "end"/"create"/"inst" line printed (its call succeeded)."""
    word, rc, h = line.split()
    assert rc == "0", line
    return int(h, 16)


def graph_counts(gpu, cg: int) -> tuple[dict, dict, dict]:
    """(metric #1, graph launches, unknown graph launches) of one cgroup."""
    return (counts(gpu.launches(), cg), counts(gpu.graph_launches(), cg),
            counts(gpu.unknown_graph_launches(), cg))


# (begin, end, instantiate, replay, capturing stream, a launch entry that lands
# on that stream with stream argument 0 or None)
CAPTURES = {
    "driver": ("cuStreamBeginCapture", "cuStreamEndCapture", "cuGraphInstantiate", "cuGraphLaunch",
               0x51),
    "v2": ("cuStreamBeginCapture_v2", "cuStreamEndCapture", "cuGraphInstantiateWithFlags",
           "cuGraphLaunch_ptsz", 0x52),
    # the per-thread default stream: NULL in _ptsz calls, CU_STREAM_PER_THREAD (0x2) in others
    "ptsz": ("cuStreamBeginCapture_ptsz", "cuStreamEndCapture_ptsz", "cuGraphInstantiate_v2",
             "cuGraphLaunch_ptsz", 0),
    "v2_ptsz": ("cuStreamBeginCapture_v2_ptsz", "cuStreamEndCapture_ptsz",
                "cuGraphInstantiateWithParams", "cuGraphLaunch", 0x2),
    "runtime": ("cudaStreamBeginCapture", "cudaStreamEndCapture", "cudaGraphInstantiate",
                "cudaGraphLaunch", 0x55),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("calls", CAPTURES)
def test_capture_instantiate_replays_count_graph_kernels_not_launches(traced, calls, mode):
    begin, end, inst, replay, s = CAPTURES[calls]
    w, span, gpu = traced(launch_events="off", **MODES[mode])
    cg = cgroup_id(w.pid)
    per_thread = calls.endswith("ptsz")
    # In span A: 7 launches recorded on the capturing stream (through four entry
    # points, one of them the runtime), 4 run on another stream meanwhile.
    a = in_span(span, w)
    out = w.run(f"begin {begin} {s:#x} 0",
                launches("cuLaunchKernel_ptsz" if per_thread else "cuLaunchKernel", 2, s),
                launches("cuLaunchKernelEx_ptsz" if s == 0 else "cuLaunchKernelEx", 3, s or 0x2),
                launches("cudaLaunchKernel", 1, s or 0x2),
                launches("cuLaunchCooperativeKernel", 1, s or 0x2),
                launches("cuLaunchKernel", 4, 0x99),
                f"end {end} {s:#x}")
    assert out[0] == "begin 0"
    graph = handle(out[1])
    assert graph_counts(gpu, cg) == ({(cg, Modality.text, DRIVER): 4}, {}, {})
    row = span.facts.take(*a)
    assert (row.launches, row.graph_launches, row.graph_kernels) == (4, 0, 0)

    (line,) = w.run(f"inst {inst} {graph:#x}")
    exec_ = handle(line)
    # In span B: 5 replays of the 7 kernels.
    b = in_span(span, w, Modality.image)
    assert w.run(f"replay {replay} {exec_:#x} 5 0x77") == ["replay 0"]
    launched, graph_launches, unknown = graph_counts(gpu, cg)
    assert launched == {(cg, Modality.text, DRIVER): 4, (cg, Modality.image, GRAPH): 35}
    assert graph_launches == {(cg, Modality.image, GRAPH): 5} and unknown == {}
    row = span.facts.take(*b)
    assert (row.launches, row.graph_launches, row.graph_kernels) == (0, 5, 35)

    # Destroyed: forgotten. The same handle replayed again (a stale one the
    # stand-in still runs) is a graph launch whose kernels are unknown.
    w.run(f"destroy cuGraphExecDestroy {exec_:#x}", f"destroy cuGraphDestroy {graph:#x}")
    c = in_span(span, w, Modality.image)
    assert w.run(f"replay {replay} {exec_:#x} 2 0x77") == ["replay 0"]
    launched, graph_launches, unknown = graph_counts(gpu, cg)
    assert launched[(cg, Modality.image, GRAPH)] == 35
    assert graph_launches == {(cg, Modality.image, GRAPH): 7}
    assert unknown == {(cg, Modality.image, GRAPH): 2}
    row = span.facts.take(*c)
    assert (row.launches, row.graph_launches, row.graph_kernels) == (0, 2, 0)
    # every capture ended: none left behind for the launches to look at
    assert not [k for k in gpu.bpf[b"gpu_captures"].keys() if k.tgid == w.pid]


@pytest.mark.parametrize("rep", REPEATS)
def test_several_streams_capture_at_once_and_graphs_built_node_by_node(traced, rep):
    w, span, gpu = traced(launch_events="off", **MODES["default"])
    cg = cgroup_id(w.pid)
    s1, s2, s3, s4, other = 0x61, 0x62, 0x63, 0x64, 0x99
    # Two captures interleaved on one thread, launches on a third stream run.
    out = w.run(f"begin cuStreamBeginCapture_v2 {s1:#x} 0", f"begin cuStreamBeginCapture_v2 {s2:#x} 0",
                launches("cuLaunchKernel", 3, s1), launches("cuLaunchKernel", 2, s2),
                launches("cuLaunchKernel", 4, other), launches("cuLaunchKernelEx", 1, s1),
                launches("cuLaunchKernelEx_ptsz", 3, s2),
                f"end cuStreamEndCapture {s2:#x}", f"end cuStreamEndCapture {s1:#x}",
                # built node by node: 3 kernel nodes
                "create cuGraphCreate", )
    assert out[:2] == ["begin 0", "begin 0"]
    g2, g1, g3 = handle(out[2]), handle(out[3]), handle(out[4])
    out = w.run(f"addnode cuGraphAddKernelNode {g3:#x} 2", f"addnode cuGraphAddKernelNode_v2 {g3:#x} 1",
                f"inst cuGraphInstantiateWithFlags {g1:#x}", f"inst cuGraphInstantiateWithFlags {g2:#x}",
                f"inst cuGraphInstantiateWithParams_ptsz {g3:#x}")
    e1, e2, e3 = (handle(line) for line in out[2:])
    # Captured into an existing graph (3 nodes + 2 launches), and a capture
    # that records a replay of e1 (4 kernels, a child graph) and 1 launch.
    out = w.run(f"begin cuStreamBeginCaptureToGraph {s3:#x} {g3:#x}", launches("cuLaunchKernel", 2, s3),
                f"end cuStreamEndCapture {s3:#x}",
                f"begin cuStreamBeginCapture {s4:#x}", f"replay cuGraphLaunch {e1:#x} 1 {s4:#x}",
                launches("cuLaunchKernel", 1, s4), f"end cuStreamEndCapture {s4:#x}")
    assert handle(out[1]) == g3
    g4 = handle(out[4])
    out = w.run(f"inst cuGraphInstantiateWithFlags {g3:#x}", f"inst cuGraphInstantiateWithFlags {g4:#x}")
    e3b, e4 = (handle(line) for line in out)
    assert graph_counts(gpu, cg) == ({(cg, Modality.other, DRIVER): 4}, {}, {})

    sp = in_span(span, w)
    assert w.run(f"replay cuGraphLaunch {e1:#x} 2", f"replay cuGraphLaunch {e2:#x} 3",
                 f"replay cuGraphLaunch_ptsz {e3:#x} 1", f"replay cuGraphLaunch {e3b:#x} 1",
                 f"replay cuGraphLaunch {e4:#x} 2") == ["replay 0"] * 5
    kernels = 2 * 4 + 3 * 5 + 1 * 3 + 1 * 5 + 2 * 5
    launched, graph_launches, unknown = graph_counts(gpu, cg)
    assert launched == {(cg, Modality.other, DRIVER): 4, (cg, Modality.text, GRAPH): kernels}
    assert graph_launches == {(cg, Modality.text, GRAPH): 9} and unknown == {}
    row = span.facts.take(*sp)
    assert (row.launches, row.graph_launches, row.graph_kernels) == (0, 9, kernels)
    w.run(*(f"destroy cuGraphExecDestroy {e:#x}" for e in (e1, e2, e3, e3b, e4)),
          *(f"destroy cuGraphDestroy {g:#x}" for g in (g1, g2, g3, g4)))
    assert not [k for k in gpu.bpf[b"gpu_graphs"].keys() if k.tgid == w.pid]
    assert not [k for k in gpu.bpf[b"gpu_execs"].keys() if k.tgid == w.pid]


@pytest.mark.parametrize("rep", REPEATS)
def test_a_graph_made_before_the_agent_and_failed_capture_calls(standin, spawn, probes, rep):
    w = spawn(standin.workload)
    w.load(standin.lib_dir)
    out = w.run("begin cuStreamBeginCapture 0x71", launches("cuLaunchKernel", 6, 0x71),
                "end cuStreamEndCapture 0x71")
    (line,) = w.run(f"inst cuGraphInstantiateWithFlags {handle(out[1]):#x}")
    early = handle(line)

    span = probes.span_ctx()
    gpu = probes(launch_events="off", pin_dir=span.shared_pin_dir(), timing=False,
                 runtime_hooks=False)
    cg = cgroup_id(w.pid)
    sp = in_span(span, w)
    # A capture the driver refuses (the legacy stream cannot capture) and an
    # end on a stream that is not capturing change nothing: the launches on
    # that stream run, and count.
    out = w.run(f"replay cuGraphLaunch {early:#x} 6", "begin cuStreamBeginCapture 0x0",
                launches("cuLaunchKernel", 3, 0), "end cuStreamEndCapture 0x0",
                "end cuStreamEndCapture 0x72")
    assert out[0] == "replay 0" and out[1] != "begin 0"
    assert [line.split()[1] for line in out[2:]] == ["401", "401"]   # CUDA_ERROR_ILLEGAL_STATE
    assert graph_counts(gpu, cg) == ({(cg, Modality.text, DRIVER): 3},
                                     {(cg, Modality.text, GRAPH): 6}, {(cg, Modality.text, GRAPH): 6})
    row = span.facts.take(*sp)
    assert (row.launches, row.graph_launches, row.graph_kernels) == (3, 6, 0)
    workload = lambda c: {"namespace": "ns", "pod": f"pod-{c}", "container": "c"}  # noqa: E731
    fams = {f.name: f for f in kernel_metrics.spanlet_gpu_graph_launches_total(gpu, workload)}
    for name in ("spanlet_gpu_graph_launches_total", "spanlet_gpu_unknown_graph_launches_total"):
        (sample,) = [s for s in fams[name].samples if dict(s.labels)["pod"] == f"pod-{cg}"]
        assert dict(sample.labels)["modality"] == "text" and sample.value == 6


# -- synchronisation ----------------------------------------------------------------
# (call, µs "waited", the driver entry it reaches, stream or event recorded)
SYNCS = [
    ("cuStreamSynchronize", 20_000, Entry.cuStreamSynchronize, 20_000),
    ("cuStreamSynchronize_ptsz", 21_000, Entry.cuStreamSynchronize_ptsz, 21_000),
    ("cuCtxSynchronize", 22_000, Entry.cuCtxSynchronize, 0),
    ("cuCtxSynchronize_v2", 22_500, Entry.cuCtxSynchronize_v2, 0),
    ("cuEventSynchronize", 23_000, Entry.cuEventSynchronize, 23_000),
    ("cudaStreamSynchronize", 24_000, Entry.cuStreamSynchronize, 24_000),
    ("cudaStreamSynchronize_ptsz", 25_000, Entry.cuStreamSynchronize_ptsz, 25_000),
    ("cudaDeviceSynchronize", 26_000, Entry.cuCtxSynchronize, 0),
    ("cudaEventSynchronize", 27_000, Entry.cuEventSynchronize, 27_000),
]


@pytest.mark.parametrize("rep", range(2))
@pytest.mark.parametrize("mode", MODES)
def test_every_sync_entry_point_is_one_wait_on_the_span(traced, mode, rep):
    w, span, gpu = traced(launch_events="all", **MODES[mode])
    sp = in_span(span, w)
    out = w.run(*(f"{name} {us}" for name, us, *_ in SYNCS))
    took = {line.split()[1]: int(line.split()[2]) for line in out}
    runtime = mode != "default"
    got = sorted((e for e in read_events(gpu, w.pid, len(SYNCS)) if e.kind == events.Kind.GPU_SYNC),
                 key=lambda e: e.hdr.ts_ns)
    # one record per call (a runtime call and the driver call it makes: once)
    assert len(got) == len(SYNCS)
    for e, (name, us, driver_entry, stream) in zip(got, SYNCS):
        on_runtime = runtime and name.startswith("cuda")
        assert (Entry(e.entry), Api(e.api)) == ((Entry[name], RUNTIME) if on_runtime
                                                 else (driver_entry, DRIVER)), name
        assert e.stream == stream and e.hdr.span_id == sp[1]
        assert us * 1000 <= e.duration_ns <= took[name], name
    cg = cgroup_id(w.pid)
    n_rt = sum(name.startswith("cuda") for name, *_ in SYNCS) if runtime else 0
    waits = {k[2]: n for k, (n, _) in counts(gpu.sync_wait(), cg).items()}
    assert waits == ({DRIVER: len(SYNCS) - n_rt, RUNTIME: n_rt} if runtime else {DRIVER: len(SYNCS)})
    row = span.facts.take(*sp)
    assert row.syncs == len(SYNCS) and row.sync_wait_ns == sum(e.duration_ns for e in got)


# -- where the libraries are -------------------------------------------------------
RUNTIME_LAYOUTS = {
    # pip's nvidia-cuda-runtime-cu12 wheel, and a wheel whose copy auditwheel renamed
    "wheel": "site-packages/nvidia/cuda_runtime/lib/libcudart.so.12",
    "cu13-wheel": "site-packages/nvidia/cu13/lib/libcudart.so.13",
    "hash-renamed": "site-packages/somepkg.libs/libcudart-1a2b3c4d.so.12",
}


@pytest.mark.parametrize("layout", RUNTIME_LAYOUTS)
def test_runtime_hooks_find_the_runtime_where_wheels_put_it(standin, spawn, probes, tmp_path, layout):
    rt = tmp_path / RUNTIME_LAYOUTS[layout]
    rt.parent.mkdir(parents=True)
    shutil.copy2(standin.lib_dir / "libcudart.so.12", rt)
    drv = tmp_path / "driver" / "libcuda.so.1"          # the host's driver, mounted elsewhere
    drv.parent.mkdir()
    shutil.copy2(standin.lib_dir / "libcuda.so.1", drv)
    w = spawn(standin.workload)
    for what, path in (("driver", drv), ("runtime", rt)):
        w.send(f"load-{what} {path}")
        w.expect("loaded")
    gpu = probes(launch_events="off", timing=False, runtime_hooks=True)
    found = {lib.path: lib for lib in gpu.libraries() if lib.pid == w.pid}
    assert set(found) == {str(drv), str(rt)}
    assert found[str(rt)].library.name == "libcudart.so" and not found[str(rt)].missing
    w.run(launches("cudaLaunchKernel", 5), launches("cudaLaunchKernelExC_ptsz", 2),
          launches("cuLaunchKernel", 3))
    cg = cgroup_id(w.pid)
    assert counts(gpu.launches(), cg) == {(cg, Modality.other, RUNTIME): 7,
                                          (cg, Modality.other, DRIVER): 3}


def test_a_process_that_dies_capturing_leaves_no_capture_behind(standin, spawn, probes):
    gpu = probes(launch_events="off", timing=False, runtime_hooks=False)
    dying, other = spawn(standin.workload), spawn(standin.workload)
    for w in (dying, other):
        w.load(standin.lib_dir)
    gpu.refresh()
    active, reaped = gpu.bpf[b"gpu_captures_active"], gpu.bpf[b"gpu_captures_reaped"]
    open_captures = lambda: active[0].value - reaped[0].value  # noqa: E731
    assert dying.run("begin cuStreamBeginCapture 0x81", "begin cuStreamBeginCapture 0x82",
                     launches("cuLaunchKernel", 2, 0x81)) == ["begin 0", "begin 0"]
    assert other.run("begin cuStreamBeginCapture 0x81") == ["begin 0"]
    assert open_captures() == 3
    dying.proc.kill()
    dying.proc.wait(5)
    gpu.refresh()
    assert [k.tgid for k in gpu.bpf[b"gpu_captures"].keys()] == [other.pid]
    assert open_captures() == 1 and reaped[0].value == 2
    # the other process's capture still records its launches; once it ends,
    # no capture is open and launches take the fast path again
    out = other.run(launches("cuLaunchKernel", 3, 0x81), launches("cuLaunchKernel", 1, 0x82),
                    "end cuStreamEndCapture 0x81")
    assert out[0].startswith("end 0 ")
    cg = cgroup_id(other.pid)
    assert counts(gpu.launches(), cg) == {(cg, Modality.other, DRIVER): 1}
    assert open_captures() == 0
