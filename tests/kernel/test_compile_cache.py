"""The compile cache against the real kernel: a start from the cache loads the
same instructions into maps of the same kinds as the compile it was kept
from, its pins made in the new agent's folder, and counts exactly; a file
that cannot be used is compiled past."""

from __future__ import annotations

import contextlib
import ctypes
import json
import secrets

import pytest

from spanlet import config
from spanlet.events import Api, Modality
from spanlet.probes import compile_cache
from spanlet.probes.gpu import GpuProbe
from spanlet.probes.sandbox.probe import SandboxProbe
from spanlet.probes.span_ctx import SpanCtxProbe
from spanlet.probes.tc.probe import TcProbe

from gpu_harness import cgroup_id, counts

pytestmark = pytest.mark.kernel


def masked(bpf, name: bytes) -> bytes:
    """A function's instructions with the map fds in them zeroed."""
    insns = bytearray(bpf.dump_func(name))
    for at in range(0, len(insns), 8):
        if insns[at] == 0x18 and insns[at + 1] >> 4 == 1:
            insns[at + 4:at + 8] = b"\0\0\0\0"
    return bytes(insns)


def ctype(t):
    """A ctypes type as data: its name, size and fields, nested."""
    if t is None:
        return None
    fields = [(f[0], ctype(f[1]), *f[2:]) for f in getattr(t, "_fields_", [])]
    elem = getattr(t, "_type_", None)
    return (t.__name__, ctypes.sizeof(t), fields,
            (ctype(elem), t._length_) if hasattr(t, "_length_") else None)


def shape(bpf) -> dict:
    """What bcc's Python sees of a module: each function's instructions (fds
    masked), each table's class, kind, flags, bound and key and value types."""
    proxy = compile_cache._install()
    m = bpf.module
    funcs = [proxy.bpf_function_name(m, i) for i in range(proxy.bpf_num_functions(m))]
    tables = {}
    for i in range(proxy.bpf_num_tables(m)):
        name = proxy.bpf_table_name(m, i)
        try:
            t = bpf[name]
        except IndexError as e:    # bcc's Python has no class for it (an unaligned per-CPU leaf)
            tables[name] = repr(e)
            continue
        tables[name] = (type(t).__name__, t.ttype, t.flags, t.max_entries, ctype(t.Key), ctype(t.Leaf))
    assert funcs and tables
    return {"funcs": {f: masked(bpf, f) for f in funcs}, "tables": tables}


@contextlib.contextmanager
def started(cfg, aside: bool = False):
    """Every probe compiled (the others with the span context owner's pins),
    stopped at the end; with `aside`, the others' compiles begun in processes
    of their own (compile_cache.compile_aside) once the owner is attached."""
    span = SpanCtxProbe(cfg)
    assert span.start().attached, span.status.reason
    probes = [span]
    try:
        others = [GpuProbe(cfg), SandboxProbe(cfg), TcProbe(cfg)]
        if aside:
            jobs = []
            for p in others:
                flags = p.compile_flags(str(span.pin_dir))
                jobs.append((p.source_text(), flags, compile_cache.pin_templates(flags)))
            cache = compile_cache.cache_of(cfg)
            assert cache.compile_aside(jobs, span.pin_dir.parent) == len(others)
            assert cache.compile_aside(jobs, span.pin_dir.parent) == 0      # begun already
        for p in others:
            p.compile(pin_dir=str(span.pin_dir))
            probes.append(p)
        yield probes
    finally:
        for p in reversed(probes):
            p.stop()


def test_a_cached_module_is_the_compiled_one(tmp_path):
    """The three programs BCC still compiles (span_ctx is a CO-RE object: nothing to cache)."""
    cfg = config.load(env={}, overrides=[f"data_dir={tmp_path}"])
    with started(cfg) as cold, started(cfg) as warm:
        assert [p.status.cached for p in cold] == [False] * 4
        assert [p.status.cached for p in warm] == [False, True, True, True]
        assert len(list((tmp_path / "bpf-cache").glob("*.json"))) == 3
        for c, w in zip(cold[1:], warm[1:]):
            assert shape(w.bpf) == shape(c.bpf), c.name
        assert warm[0].pin_dir != cold[0].pin_dir


def launches(api: str, n: int) -> str:
    return f"{api} {n} 1 1 1 1 1 1 0 0"


def test_a_cached_start_counts_exactly_and_pins_in_its_own_folder(standin, spawn, kernel, tmp_path):
    w = spawn(standin.workload)
    w.load(standin.lib_dir)
    cg = cgroup_id(w.pid)
    folders = []
    for round_ in ("compiled", "cached"):
        span, gpu = kernel(f"data_dir={tmp_path}")
        assert (span.status.cached, gpu.status.cached) == (False, round_ == "cached")
        assert sorted(p.name for p in span.pin_dir.iterdir()) >= ["span_ctx", "span_facts"]
        folders.append(span.pin_dir)
        for rep in range(20):
            trace_id = secrets.token_bytes(16)
            span_id = int.from_bytes(secrets.token_bytes(8), "big") | 1
            span.set(w.tid, trace_id, span_id, Modality.text)
            w.run(launches("cu", rep + 1), launches("cuda", 2), "cusync 50")
            span.clear(w.tid)
            w.run(launches("cu", 3))                  # outside the span
            row = span.facts.take(trace_id, span_id)
            assert row is not None, (round_, rep)
            assert (row.launches, row.syncs, row.pid) == (rep + 3, 1, w.pid), (round_, rep)
        # metric #1's counts too: in the spans by their modality, after them as "other"
        assert counts(gpu.launches(), cg) == {(cg, Modality.text, Api.driver): 210 + 2 * 20,
                                              (cg, Modality.other, Api.driver): 3 * 20}
        gpu.stop()
        span.stop()
        assert not span.pin_dir.exists()           # the pins go with the agent, cached or not
    assert folders[0] != folders[1]


def _no_map_type(image):
    image["tables"][0]["type"] = 9999                     # no map can be made


# (A program the verifier refuses once was the other case: BCC loaded the
# span context program's tracepoint programs at compile. Those are CO-RE now;
# the programs BCC still compiles are loaded when they are attached.)
@pytest.mark.parametrize("spoil", [_no_map_type])
def test_a_file_that_cannot_be_used_is_compiled_past_and_written_again(tmp_path, caplog, spoil):
    cfg = config.load(env={}, overrides=[f"data_dir={tmp_path}"])
    span = SpanCtxProbe(cfg)            # the span context maps' owner, a CO-RE object (not cached)
    assert span.start().attached
    probe = SandboxProbe(cfg)
    assert probe.start(span.shared_pin_dir()).attached
    probe.stop()
    (path,) = (tmp_path / "bpf-cache").glob("*.json")
    good = path.read_text()
    image = json.loads(good)
    spoil(image)                 # a map refused
    path.write_text(json.dumps(image))
    try:
        probe = SandboxProbe(cfg)
        try:
            assert probe.start(span.shared_pin_dir()).attached and not probe.status.cached
        finally:
            probe.stop()
        assert "compiling" in caplog.text
        assert json.loads(path.read_text()) == json.loads(good)     # the compile's, written again
        probe = SandboxProbe(cfg)
        try:
            assert probe.start(span.shared_pin_dir()).attached and probe.status.cached
        finally:
            probe.stop()
    finally:
        span.stop()


def _images(folder) -> dict:
    return {p.name: json.loads(p.read_text()) for p in folder.glob("*.json")}


def test_compiles_in_processes_of_their_own_write_the_compiled_images(tmp_path):
    """compile_aside: each probe compiled in a process of its own writes the
    image an in-process compile writes, under the same key; the probe's
    compile then loads it (cached) and its module is the compiled one's;
    the processes end, their pins with them."""
    here = config.load(env={}, overrides=[f"data_dir={tmp_path / 'here'}"])
    aside = config.load(env={}, overrides=[f"data_dir={tmp_path / 'aside'}"])
    with started(here) as compiled, started(aside, aside=True) as probes:
        assert [p.status.cached for p in probes] == [False, True, True, True]
        assert _images(tmp_path / "aside" / "bpf-cache") == _images(tmp_path / "here" / "bpf-cache")
        for c, a in zip(compiled[1:], probes[1:]):
            assert shape(a.bpf) == shape(c.bpf), c.name
        assert not list(probes[0].pin_dir.parent.glob("*-compile"))


def test_a_compile_that_fails_in_its_own_process_fails_here_with_its_reason(tmp_path, caplog):
    caplog.set_level("INFO", logger=compile_cache.log.name)
    cache = compile_cache.CompileCache(tmp_path / "bpf-cache")
    text = "int broken(void *ctx) { return undeclared; }"
    assert cache.compile_aside([(text, [], {})], tmp_path) == 1
    with pytest.raises(Exception, match="Failed to compile"):
        cache.compile(text, [])
    assert "ended with 1" in caplog.text
    assert not list((tmp_path / "bpf-cache").glob("*.json")) and not list(tmp_path.glob("*-compile"))


def test_a_first_start_compiles_the_probes_after_the_owner_in_processes_of_their_own(tmp_path, caplog):
    from spanlet.probes.starter import ProbeStarter

    caplog.set_level("DEBUG", logger="spanlet")
    cfg = config.load(env={}, overrides=[f"data_dir={tmp_path}", "tc.enabled=false"])
    starter = ProbeStarter(cfg)
    try:
        probes = starter.finish()       # the owner, then in the order their processes ended
        assert probes[0].name == "span_ctx" and sorted(
            (p.name, p.status.attached, p.status.cached) for p in probes) == [
            ("gpu_launch", True, True), ("mmap_sandbox", True, True), ("span_ctx", True, False)]
        assert "2 probe compile(s) begun in processes of their own" in caplog.text
        # each read the two kallsyms lines, under those the compile thread that began it reads
        assert "of its own not made" not in caplog.text
        assert len(list((tmp_path / "bpf-cache").glob("*.json"))) == 2       # span_ctx: a CO-RE object
    finally:
        for p in reversed(starter.probes):
            p.stop()
    assert not list(probes[0].pin_dir.parent.glob("*-compile"))


OWN_KALLSYMS = """
import sys
from spanlet.probes import compile_cache
made = compile_cache._own_kallsyms(sys.argv[1])
print(made)
print(open("/proc/kallsyms").read(), end="")
"""


def test_a_compile_in_its_own_process_reads_only_the_kallsyms_lines_it_needs():
    """The symbols a compile asks for are read from the kernel's BTF, and the
    process compiling aside sees them alone as /proc/kallsyms (a mount
    namespace of its own): not the node's whole table, which stays as it is."""
    import subprocess
    import sys

    lines = compile_cache.compile_ksyms()
    real = {line.split()[2] for line in open("/proc/kallsyms") if line.split()[2] in compile_cache.COMPILE_KSYMS}
    assert lines is not None and {line.split()[2] for line in lines.splitlines()} == real
    assert real == set(compile_cache.COMPILE_KSYMS)    # this kernel has both
    out = subprocess.run([sys.executable, "-c", OWN_KALLSYMS, lines], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    assert out == f"True\n{lines}"
    with open("/proc/kallsyms") as f:
        assert len(f.readlines()) > 10_000             # the node's own, untouched
    assert compile_cache.compile_ksyms("/nonexistent") is None


def test_the_compiles_in_the_agents_process_read_only_the_kallsyms_lines_they_need(tmp_path, monkeypatch):
    """The starter's compile thread (the owner's compile at a node's first
    start) sees compile_ksyms()' lines as /proc/kallsyms, in a mount
    namespace of the thread's own: the process's other threads, and the
    node, keep the whole table."""
    from spanlet.probes.starter import ProbeStarter

    seen = []
    real_compile = SpanCtxProbe.compile

    def compile_and_look(self, *args, **kwargs):
        with open("/proc/kallsyms") as f:
            seen.append(f.read())
        return real_compile(self, *args, **kwargs)
    monkeypatch.setattr(SpanCtxProbe, "compile", compile_and_look)
    cfg = config.load(env={}, overrides=[f"data_dir={tmp_path}", "tc.enabled=false",
                                         "sandbox.enabled=false", "gpu.enabled=false"])
    starter = ProbeStarter(cfg)
    try:
        probes = starter.finish()
        assert [(p.name, p.status.attached, p.status.cached) for p in probes] == [("span_ctx", True, False)]
    finally:
        for p in reversed(starter.probes):
            p.stop()
    assert seen == [compile_cache.compile_ksyms()]
    with open("/proc/kallsyms") as f:
        assert len(f.readlines()) > 10_000             # this thread's: the node's own


def test_an_empty_cache_begins_its_compiles_before_any_key_and_a_filled_one_skips_what_it_holds(
        tmp_path, monkeypatch):
    """A node's first start (an empty cache) begins the compiling processes
    without computing the cache keys (they load libbcc, 0.1 s); the probe's
    compile then waits for its process and loads the image it wrote."""
    cache = compile_cache.CompileCache(tmp_path / "bpf-cache")
    text = "int one(void *ctx) { return 0; }"

    def no_key(*args):
        raise AssertionError("a cache key computed before the processes began")
    monkeypatch.setattr(compile_cache, "cache_key", no_key)
    assert cache.compile_aside([(text, [], {})], tmp_path) == 1
    monkeypatch.undo()
    bpf, hit = cache.compile(text, [])
    try:
        assert hit                               # the image the process wrote
    finally:
        bpf.cleanup()
    again = compile_cache.CompileCache(tmp_path / "bpf-cache")
    assert again.compile_aside([(text, [], {})], tmp_path) == 0    # held: no process for it
