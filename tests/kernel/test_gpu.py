"""GPU launch probe against the real kernel: stand-in libcuda/libcudart built
here with gcc, workload processes started by the test, exact counts, argument
values, sync wait times, span stamping, discovery of later and containerised
processes, and a clean detach."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spanlet import events
from spanlet.events import Api, Entry, Modality
from spanlet.probes.gpu import DRIVER_HOOKS, ENTRY_FNS, probe_sites

import cuda_standin
from gpu_harness import cgroup_id, counts, launch_line, launches, mine, read_events

pytestmark = pytest.mark.kernel

DRIVER, RUNTIME = Api.driver, Api.runtime
OTHER = Modality.other
FUNC = 0xF00D  # the "kernel" the workload names in every launch


# -- counts, arguments and sync times --------------------------------------------
LAUNCHES = [  # (script api, count, grid, block, shared mem, stream, entry, api label)
    ("cu", 3, (1, 2, 3), (32, 4, 2), 700, 0x11, Entry.cuLaunchKernel, DRIVER),
    ("cuex", 5, (65535, 7, 1), (1024, 1, 1), 49152, 0x7F0012345678, Entry.cuLaunchKernelEx, DRIVER),
    ("cuda", 7, (4096, 2, 9), (128, 2, 3), 1 << 16, 0x33, Entry.cudaLaunchKernel, RUNTIME),
]
SYNCS = [  # (script api, microseconds slept, entry, api label, stream recorded)
    ("cusync", 60_000, Entry.cuStreamSynchronize, DRIVER, 60_000),
    ("cudasync", 80_000, Entry.cudaStreamSynchronize, RUNTIME, 80_000),
    ("devsync", 100_000, Entry.cudaDeviceSynchronize, RUNTIME, 0),
]


def test_exact_counts_arguments_and_sync_waits(standin, spawn, probes):
    w = spawn(standin.workload)
    w.load(standin.lib_dir)
    gpu = probes("all")
    libs = mine(gpu.libraries(), standin.lib_dir)
    assert sorted(lib.library.name for lib in libs) == ["libcuda.so", "libcudart.so"]
    assert all(lib.pid == w.pid and not lib.missing for lib in libs)

    script = [launch_line(a, n, g, b, sm, st) for a, n, g, b, sm, st, _, _ in LAUNCHES]
    out = w.run(*script, *(f"{a} {us}" for a, us, *_ in SYNCS))
    measured = {line.split()[1]: int(line.split()[2]) for line in out if line.startswith("sync ")}
    cg = cgroup_id(w.pid)
    assert cg != cgroup_id(os.getpid())  # the test's own cgroup, keyed apart

    # Nested runtime -> driver calls are counted once, under the runtime.
    assert counts(gpu.launches(), cg) == {(cg, OTHER, DRIVER): 3 + 5, (cg, OTHER, RUNTIME): 7}

    n_launch = sum(x[1] for x in LAUNCHES)
    got = read_events(gpu, w.pid, n_launch + len(SYNCS))
    launched = [e for e in got if e.kind == events.Kind.GPU_LAUNCH]
    syncs = [e for e in got if e.kind == events.Kind.GPU_SYNC]
    assert len(launched) == n_launch and len(syncs) == len(SYNCS)
    launched.sort(key=lambda e: e.hdr.ts_ns)
    expected = [x for x in LAUNCHES for _ in range(x[1])]
    for e, (_, _, grid, block, shmem, stream, entry, api) in zip(launched, expected):
        assert (e.entry, e.api) == (entry, api)
        assert (list(e.grid), list(e.block), e.shared_mem, e.stream) == (list(grid), list(block),
                                                                          shmem, stream)
        assert e.func == FUNC
        assert (e.hdr.pid, e.hdr.tid, e.hdr.cgroup_id) == (w.pid, w.tid, cg)
        assert e.hdr.span_id == 0 and e.hdr.modality == OTHER
        assert 0 < e.duration_ns < 1_000_000_000

    # One record per outermost sync (cudaStreamSynchronize's tail jump into
    # cuStreamSynchronize is not a second one), timed within 20 % of the
    # sleep and never longer than the workload's own clock around the call.
    syncs.sort(key=lambda e: e.hdr.ts_ns)
    for e, (name, us, entry, api, stream) in zip(syncs, SYNCS):
        assert (e.entry, e.api, e.stream) == (entry, api, stream)
        assert us * 1000 <= e.duration_ns <= us * 1200, name
        assert e.duration_ns <= measured[name]
    cu, cuda, dev = (e.duration_ns for e in syncs)
    assert counts(gpu.sync_wait(), cg) == {(cg, OTHER, DRIVER): (1, cu),
                                           (cg, OTHER, RUNTIME): (2, cuda + dev)}
    # log2 buckets of microseconds: a wait of d us is in bucket i when
    # 2^(i-1) <= d < 2^i (16 for 60 ms, 17 for 80 and 100 ms).
    def histogram(*ns):
        out = [0] * 32
        for d in ns:
            out[min((d // 1000).bit_length(), 31)] += 1
        return out
    assert counts(gpu.sync_waits(), cg) == {(cg, OTHER, DRIVER): (1, cu, histogram(cu)),
                                            (cg, OTHER, RUNTIME): (2, cuda + dev, histogram(cuda, dev))}
    assert gpu.events_dropped() == 0 and gpu.decode_errors == 0


# -- discovery: later processes, new copies, dlopen ---------------------------
def test_processes_and_libraries_that_appear_after_attach(standin, spawn, probes, tmp_path):
    before = spawn(standin.workload)
    before.load(standin.lib_dir)
    # Counts only, untimed: driver launches then have no return probe at all,
    # and the runtime's nested driver call must still count once.
    gpu = probes("off", timing=False)
    first = {lib.library.key for lib in mine(gpu.libraries(), standin.lib_dir)}
    assert len(first) == 2

    # Same inode, process started after attach: no refresh needed.
    later = spawn(standin.workload)
    later.load(standin.lib_dir)
    later.run(launches("cu", 4), launches("cuda", 3))

    # A second copy at a new path, dlopen'ed after the process was scanned.
    copy_dir = standin.copy_libs(tmp_path / "copy")
    late = spawn(standin.workload)
    gpu.refresh()
    late.load(copy_dir)
    t0 = time.monotonic()
    gpu.refresh()
    found = {lib.library.path: lib for lib in gpu.libraries()}
    assert time.monotonic() - t0 < 2.0
    for name in (cuda_standin.DRIVER, cuda_standin.RUNTIME):
        lib = found[str(copy_dir / name)]
        assert lib.pid == late.pid and lib.symbols and not lib.missing
    late.run(launches("cuex", 6), launches("cuda", 2))
    before.run(launches("cu", 1))

    cg = cgroup_id(late.pid)
    assert cg == cgroup_id(before.pid) == cgroup_id(later.pid)
    assert counts(gpu.launches(), cg) == {(cg, OTHER, DRIVER): 4 + 6 + 1, (cg, OTHER, RUNTIME): 3 + 2}
    assert {lib.library.key for lib in gpu.libraries() if lib.pid == before.pid} == first

    # A process that maps a third copy and exits before the scan: not an error.
    gone_dir = standin.copy_libs(tmp_path / "gone")
    gone = spawn(standin.workload)
    gone.load(gone_dir)
    gone.close()
    gpu.refresh()
    assert not any(str(gone_dir) in lib.path for lib in gpu.libraries())
    assert not any(str(tmp_path) in f for f in gpu.status.failed_attachments)
    assert gpu.status.attached
    assert gpu.events_read == 0  # launch_events=off: counts only


def test_library_only_in_another_mount_namespace(standin, spawn, probes, tmp_path):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    # A private mount namespace with a tmpfs over `hidden`, the libraries
    # copied into it: the agent's namespace sees an empty folder.
    shell = ('mount -t tmpfs spanlet-gpu-test "$1" && cp "$2/libcuda.so.1" "$2/libcudart.so.12" "$1"/ '
             '&& exec "$3"')
    w = spawn(None, ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell, "sh",
                   str(hidden), str(standin.lib_dir), str(standin.workload)])
    w.load(hidden)
    assert os.readlink(f"/proc/{w.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    assert list(hidden.iterdir()) == []

    gpu = probes("all")
    libs = mine(gpu.libraries(), hidden)
    assert sorted(lib.path for lib in libs) == [str(hidden / cuda_standin.DRIVER),
                                                 str(hidden / cuda_standin.RUNTIME)]
    assert all(lib.library.open_path.startswith(f"/proc/{w.pid}/root/") and lib.symbols for lib in libs)
    w.run(launches("cu", 2), launches("cuda", 5))
    cg = cgroup_id(w.pid)
    assert counts(gpu.launches(), cg) == {(cg, OTHER, DRIVER): 2, (cg, OTHER, RUNTIME): 5}
    assert len(read_events(gpu, w.pid, 7)) == 7


# -- span context ---------------------------------------------------------------
def test_span_context_stamps_and_filters_records(standin, spawn, probes):
    span = probes.span_ctx()
    gpu = probes("sampled", pin_dir=span.shared_pin_dir())
    inside, outside = spawn(standin.workload), spawn(standin.workload)
    for w in (inside, outside):
        w.load(standin.lib_dir)
    gpu.refresh()
    trace_id, span_id = bytes(range(1, 17)), 0x1122334455667788
    span.set(inside.tid, trace_id, span_id, Modality.audio)

    inside.run(launches("cu", 2), launches("cuda", 3), "cudasync 1000")
    outside.run(launches("cu", 4), launches("cuda", 1), "devsync 1000")
    cg = cgroup_id(inside.pid)
    assert counts(gpu.launches(), cg) == {(cg, Modality.audio, DRIVER): 2, (cg, Modality.audio, RUNTIME): 3,
                                          (cg, OTHER, DRIVER): 4, (cg, OTHER, RUNTIME): 1}
    assert {k: n for k, (n, _) in counts(gpu.sync_wait(), cg).items()} == {
        (cg, Modality.audio, RUNTIME): 1, (cg, OTHER, RUNTIME): 1}

    # Sampled: the span's first 4 calls (of 6) as records; the counts above
    # and the span's row below hold all of them.
    got = read_events(gpu, inside.pid, 4)
    got.sort(key=lambda e: e.hdr.ts_ns)
    assert [(e.kind, e.entry) for e in got] == (
        [(events.Kind.GPU_LAUNCH, Entry.cuLaunchKernel)] * 2
        + [(events.Kind.GPU_LAUNCH, Entry.cudaLaunchKernel)] * 2)
    for e in got:
        assert bytes(e.hdr.trace_id) == trace_id and e.hdr.span_id == span_id
        assert e.hdr.modality == Modality.audio and e.hdr.tid == inside.tid
        assert e.duration_ns > 0   # timed: a return probe per launch
    assert [e for e in gpu.seen if e.hdr.pid == outside.pid] == []
    row = span.facts.take(trace_id, span_id)
    assert row.launches_by_api == {"driver": 2, "runtime": 3} and row.launches == 5
    assert (row.syncs, row.sampled_events, row.pid, row.cgroup_id) == (1, 4, inside.pid, cg)
    assert row.sync_wait_ns >= 1_000_000 and row.launch_ns >= sum(e.duration_ns for e in got)
    assert span.facts.take(trace_id, span_id) is None   # taken: gone


# -- failures are reported, not fatal ---------------------------------------------
def test_library_without_cuda_symbols_is_reported(standin, spawn, probes):
    gpu = probes("all")
    w = spawn(standin.workload)
    w.dlopen(standin.nocuda)
    w.load(standin.lib_dir)
    gpu.refresh()
    assert gpu.status.attached
    failed = [f for f in gpu.status.failed_attachments if str(standin.nocuda.parent) in f]
    assert len(failed) == 1 and "cuLaunchKernel" in failed[0]
    assert not any(str(standin.nocuda) in a for a in gpu.status.attachments)
    bad = [lib for lib in gpu.libraries() if lib.path == str(standin.nocuda)]
    assert len(bad) == 1 and bad[0].symbols == []
    w.run(launches("cu", 2))
    cg = cgroup_id(w.pid)
    assert counts(gpu.launches(), cg) == {(cg, OTHER, DRIVER): 2}


def test_unmapped_libraries_are_detached_and_dead_calls_reaped(standin, spawn, probes, tmp_path):
    gpu = probes("all", unmapped_grace_s=0)
    copy_dir = standin.copy_libs(tmp_path / "short-lived")
    w = spawn(standin.workload)
    w.load(copy_dir)
    gpu.refresh()
    paths = {lib.path for lib in mine(gpu.libraries(), copy_dir)}
    assert len(paths) == 2
    assert {path for _, path, _ in _probes_on(paths)} == paths

    # Killed inside a 5 s sync: its return probe never runs.
    w.send("cudasync 5000000", "go")
    calls = gpu.bpf[b"gpu_sync_calls"]
    deadline = time.monotonic() + 10
    while not any(c.pid_tgid >> 32 == w.pid for c in calls.values()):
        assert time.monotonic() < deadline, "the sync call never showed up"
        time.sleep(0.01)
    w.proc.kill()
    w.proc.wait(5)

    gpu.refresh()
    assert not any(c.pid_tgid >> 32 == w.pid for c in calls.values())
    assert mine(gpu.libraries(), copy_dir) == []
    assert not any(str(copy_dir) in a for a in gpu.status.attachments)
    assert _probes_on(paths) == []
    assert counts(gpu.sync_wait(), cgroup_id(os.getpid())) == {}  # nothing was timed


# -- detach ---------------------------------------------------------------------
def _probes_on(paths: set[str]) -> list[tuple[str, str, int]]:
    """This process's uprobes on `paths` (as the libraries' processes see
    them): (kind, path, uprobes) per perf-event uprobe (bpftool perf, opened
    through /proc/PID/root) and per uprobe_multi link (its fdinfo, which
    shows the file's own path); kind is uprobe or uretprobe."""
    strip = lambda f: re.sub(r"^/proc/\d+/root", "", f)  # noqa: E731
    out = [(p["fd_type"], strip(p["filename"]), 1) for p in _bpftool("perf")
           if p.get("pid") == os.getpid() and strip(p.get("filename", "")) in paths]
    for fd in os.listdir("/proc/self/fdinfo"):
        try:
            info = dict(line.split(":\t", 1) for line in
                        Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if info.get("link_type", "").endswith("probe_multi") and info.get("path") in paths:
            out.append((info["link_type"].removesuffix("_multi"), info["path"], int(info["uprobe_cnt"])))
    return out


def _bpftool(*args: str):
    out = subprocess.run(["bpftool", "-j", *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out or "[]")


def _prog_ids(bpf) -> set[int]:
    ids = set()
    for fn in bpf.funcs.values():
        for line in Path(f"/proc/self/fdinfo/{fn.fd}").read_text().splitlines():
            if line.startswith("prog_id:"):
                ids.add(int(line.split()[1]))
    return ids


@pytest.mark.parametrize("multi", [True, False], ids=["uprobe_multi", "perf-events"])
@pytest.mark.parametrize("timed, programs, uprobes, uretprobes, links", [
    # default: on the driver only, 67 functions: an entry-only uprobe on each
    # of the 9 launch, 2 graph-launch, 2 graph-node and 2 destroy calls, the
    # 14 asynchronous copies and the 4 allocations; entry and return on the 5
    # syncs, on the 13 capture, create and instantiate calls and on the 16
    # synchronous copies. Perf-event uprobes: 42 entry programs (some shared
    # by a call's variants) and 3 return ones. uprobe_multi: 4 links
    # (gpu_entry, which tells the function by the attach cookie, and the 3
    # return programs).
    (False, 45, 67, 34, 4),
    # timing and runtime hooks: the 9 driver launches get their return probe,
    # and 10 runtime calls (6 launches, 4 syncs) are hooked on both ends;
    # links: 5 on the driver, 3 on the runtime, of 5 programs
    (True, 56, 77, 53, 5 + 3)], ids=["default", "timed-runtime"])
def test_stop_removes_programs_and_uprobes(standin, spawn, probes, timed, programs, uprobes,
                                           uretprobes, links, multi):
    w = spawn(standin.workload)
    w.load(standin.lib_dir)
    gpu = probes("all", timing=timed, runtime_hooks=timed, uprobe_multi=multi)
    ids = _prog_ids(gpu.bpf)
    assert len(ids) == ((5 if timed else 4) if multi else programs)
    libs = mine(gpu.libraries(), standin.lib_dir)
    paths = {lib.path for lib in libs}
    ours = _probes_on(paths)
    assert sum(n for kind, _, n in ours if kind == "uprobe") == uprobes
    assert sum(n for kind, _, n in ours if kind == "uretprobe") == uretprobes
    if multi:
        # (another tool's perf uprobe on one of these functions makes the
        # kernel refuse a link there: those become perf-event uprobes)
        assert len(ours) >= links and sum(lib.links != [] for lib in libs) == len(libs)
    else:
        assert len(ours) == uprobes + uretprobes and all(lib.links == [] for lib in libs)

    t0 = time.monotonic()
    gpu.stop()
    stop_s = time.monotonic() - t0
    gpu.stop()  # safe twice
    deadline = time.monotonic() + 5   # programs are freed from deferred work, late under load
    while ids & {p["id"] for p in _bpftool("prog", "show")} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ids & {p["id"] for p in _bpftool("prog", "show")}
    # (another agent on the machine may probe these libraries too: only ours count)
    assert not [p for p in _bpftool("perf") if p.get("prog_id") in ids
                or (p.get("pid") == os.getpid() and str(standin.lib_dir) in p.get("filename", ""))]
    assert _probes_on(paths) == []
    tracefs = Path("/sys/kernel/tracing/uprobe_events")
    if tracefs.exists():
        assert str(standin.lib_dir).replace("/", "_") not in tracefs.read_text()
        assert str(standin.lib_dir) not in tracefs.read_text()
    assert gpu.launches() == {}
    # The process runs on, unprobed.
    assert w.run(launches("cu", 3)) == []
    print(f"stop with {'links' if multi else 'perf-event uprobes'}: {stop_s:.2f} s")


@pytest.mark.parametrize("multi", [True, False], ids=["uprobe_multi", "perf-events"])
def test_with_uprobe_multi_each_functions_code_is_compiled_once(probes, multi):
    """With uprobe_multi links every hooked function's code is compiled once,
    inside gpu_entry; the program of its own each has (for a perf-event
    uprobe where the kernel refuses a link) is a small one that hands the
    call to gpu_entry. Without links each of those is the function's whole
    code (and gpu_entry is called by nothing)."""
    gpu = probes("all", timing=True, runtime_hooks=True, uprobe_multi=multi)
    size = lambda fn: len(gpu.bpf.dump_func(fn.encode())) // 8   # noqa: E731 (instructions)
    sizes = {fn: size(fn) for fn in ENTRY_FNS}
    assert gpu.uses_multi() == multi
    if multi:    # one small program, the function's cookie apart
        assert len(set(sizes.values())) == 1 and max(sizes.values()) < 40
        assert size("gpu_entry") > sum(sizes.values())
    else:        # each function's code twice: in its program, and in gpu_entry
        assert sum(sizes.values()) > size("gpu_entry") > 1000
        assert "gpu_perf_hooks" not in gpu.source_text()


FOREIGN_PROBE = """
import sys
from bcc import BPF
b = BPF(text="int other(struct pt_regs *ctx) { return 0; }")
b.attach_uprobe(name=sys.argv[1].encode(), addr=int(sys.argv[2]), fn_name=b"other")
print("attached", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("where", ["probe site", "entry"])
def test_a_function_another_tool_probes_gets_its_own_uprobe(standin, spawn, probes, tmp_path, where):
    # The kernel refuses a uprobe_multi link at an offset that already has
    # another tool's perf-event uprobe: that function is hooked on its own,
    # the others stay in links, and every launch still counts once. Another
    # tool's uprobe on the entry (ours is on the jump after the trampoline's
    # compare) is at another offset: no conflict.
    lib_dir = standin.copy_libs(tmp_path / "probed")
    lib_path = str(lib_dir / "libcuda.so.1")
    from bcc import BPF
    (addr,) = {a for _, a in BPF.get_user_functions_and_addresses(lib_path.encode(), b"^cuLaunchKernel$")}
    ((_, site),) = probe_sites(lib_path, [(None, addr)])
    assert site == addr + 10
    other = subprocess.Popen([sys.executable, "-c", FOREIGN_PROBE, lib_path,
                              str(site if where == "probe site" else addr)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "attached"
        w = spawn(standin.workload)
        w.load(lib_dir)
        gpu = probes("off", timing=False, runtime_hooks=False)
        (lib,) = mine(gpu.libraries(), lib_dir)
        assert lib.missing == [] and len(lib.symbols) == len(DRIVER_HOOKS)
        if where == "probe site":
            assert lib.links and lib.probe_events   # the rest in links, cuLaunchKernel on its own
        else:
            assert lib.links and not lib.probe_events
        cg = cgroup_id(w.pid)
        for n in range(1, 11):
            w.run(launches("cuLaunchKernel", 4), launches("cuLaunchKernelEx", 3),
                  launches("cuLaunchCooperativeKernel", 2))
            assert counts(gpu.launches(), cg) == {(cg, OTHER, DRIVER): 9 * n}
        # cuLaunchKernel's perf-event uprobe named it for gpu_entry, per call, and gpu_entry took each
        assert len(gpu.bpf[b"gpu_perf_hooks"]) == 0
    finally:
        other.stdin.close()
        other.wait(10)
