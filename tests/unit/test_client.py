"""SpanletSpanProcessor (agent/client.py) against the real OpenTelemetry SDK and
the marker extension (native/spanlet_marker.c) built here, no root: the record
build logs every spanlet_mark call with its arguments and calling thread."""

from __future__ import annotations

import ast
import asyncio
import ctypes as C
import importlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
import pytest
from opentelemetry import context, trace
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import marker_build
from marker_build import CLEAR, Recorder, forget_client_state
from spanlet import client
from spanlet.discovery import library_pattern
from spanlet.probes.span_ctx import MARKER_LIBRARY, MARKER_SYMBOL

ROOT = Path(__file__).resolve().parents[2]
RECORD_ONLY = ("record_count", "record_get", "record_reset")
NO_MARK_SOURCE = """\
#include <Python.h>
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "spanlet.libspanlet_marker", NULL, 0, NULL};
PyMODINIT_FUNC PyInit_libspanlet_marker(void)
{
	PyObject *m = PyModule_Create(&def);
	if (m && PyModule_AddIntConstant(m, "ABI_VERSION", %d) < 0)
		Py_CLEAR(m);
	return m;
}
""" % client.ABI_VERSION
# What the old ctypes marker was: a plain shared object with the probed symbol, no module.
NO_INIT_SOURCE = "void spanlet_mark(unsigned long a, unsigned long b, unsigned long c, unsigned d) {}\n"


def build(out: Path, name: str, *defines: str, source: Path | None = None) -> str:
    """With the package build's flags (pyproject.toml ext-modules), plus any -D."""
    return marker_build.build(out, name, *defines, source=source)


@pytest.fixture(scope="module")
def libs():
    out = Path(tempfile.mkdtemp(prefix="spanlet-client-test-"))
    try:
        (out / "no_mark.c").write_text(NO_MARK_SOURCE)
        (out / "no_init.c").write_text(NO_INIT_SOURCE)
        (out / "not_elf.so").write_text("not a shared object\n")
        yield {
            "prod": build(out, "libspanlet_marker" + marker_build.EXT_SUFFIX),
            "record": build(out, "librecord.so", "-DSPANLET_MARKER_RECORD"),
            "abi_other": build(out, "libabi_other.so", f"-DSPANLET_MARKER_ABI_VERSION={client.ABI_VERSION + 1}"),
            "no_mark": build(out, "libno_mark.so", source=out / "no_mark.c"),
            "no_init": build(out, "libno_init.so", source=out / "no_init.c"),
            "not_elf": str(out / "not_elf.so"),
            "missing": str(out / "does_not_exist.so"),
        }
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture
def fresh_client(monkeypatch):
    """Forget loaded markers, the once-per-process warning and the context hooks, as a new process would."""
    forget_client_state(monkeypatch)
    yield
    client._remove_hooks()


@pytest.fixture
def recorder(libs, fresh_client):
    rec = Recorder(libs["record"])
    rec.reset()
    yield rec
    rec.reset()


def traced(processor):
    provider = TracerProvider()
    provider.add_span_processor(processor)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, provider.get_tracer("spanlet.test"), exporter


ids = marker_build.span_mark


def current(span):
    """Makes `span` current in this thread's OTel context (a context manager)."""
    return trace.use_span(span, end_on_exit=False)


def installed_marker() -> str:
    """The file of the marker extension that the package build made."""
    return importlib.import_module(client.MARKER_MODULE).__file__


# The extension itself.

def test_production_build_exports_the_abi_and_no_record_code(libs):
    module = client.load_extension(libs["prod"])
    assert module.ABI_VERSION == client.ABI_VERSION == 5
    assert all(callable(getattr(module, f)) for f in ("mark", "follow", "unmark", "forget", "Follower"))
    assert C.CDLL(libs["prod"])[MARKER_SYMBOL]  # the probed symbol, exported
    for test_only in RECORD_ONLY:
        assert not hasattr(module, test_only)
    assert all(hasattr(client.load_extension(libs["record"]), f) for f in RECORD_ONLY)


def test_the_package_build_made_the_marker_the_agent_looks_for(fresh_client):
    """The editable/wheel build's extension is what the processor loads by
    default, its file is found by the agent's discovery, and it exports the
    probed symbol."""
    path = installed_marker()
    assert Path(path).name.startswith("libspanlet_marker.cpython-")
    assert client.SpanletSpanProcessor().active
    assert C.CDLL(path)[MARKER_SYMBOL]
    pattern = library_pattern([MARKER_LIBRARY])
    for name in (path, "/opt/x/libspanlet_marker.so"):
        line = f"7f0000000000-7f0000001000 r-xp 00001000 fd:01 123 {name}\n"
        assert pattern.search(line).group(6) == name
    for other in ("/opt/x/libspanlet_marker_extra.so", "/opt/x/libspanlet.so"):
        assert not pattern.search(f"7f0000000000-7f0000001000 r-xp 00001000 fd:01 123 {other}\n")


def _file_code(path: str, addr: int, n: int) -> bytes:
    """The `n` bytes at `addr` as the library FILE holds them: in memory a
    uprobe that any agent on the machine set would show as its own bytes."""
    real = os.path.realpath(path)
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if len(fields) >= 6 and os.path.realpath(fields[5]) == real and lo <= addr < hi:
            with open(real, "rb") as f:
                f.seek(addr - lo + int(fields[2], 16))
                return f.read(n)
    raise AssertionError(f"{path} is not mapped at {addr:#x}")


# Skipped off x86-64 by design: the 5-byte NOP is an x86-64 instruction (CI runs x86-64).
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the probe-site NOP is x86-64 only")
@pytest.mark.parametrize("which", ["prod", "installed"])
def test_spanlet_mark_starts_with_the_nop5_that_optimized_uprobes_need(libs, which):
    """Linux 6.18+ turns a uprobe on a 5-byte NOP into a trampoline call (about
    7x cheaper than the int3 trap); the production build must keep it first,
    here and in the extension the package build made."""
    path = libs["prod"] if which == "prod" else installed_marker()
    code = _file_code(path, C.cast(C.CDLL(path).spanlet_mark, C.c_void_p).value, 10)
    endbr64, nop5, ret = b"\xf3\x0f\x1e\xfa", b"\x0f\x1f\x44\x00\x00", b"\xc3"
    assert code.removeprefix(endbr64).startswith(nop5 + ret)


def test_spanlet_mark_receives_full_64_bit_arguments(recorder):
    """The fixed ABI, called directly with every high bit set; then mark(), the
    entry point the client uses, must arrive at spanlet_mark with the same values."""
    mark = C.CDLL(recorder.path).spanlet_mark
    mark.argtypes = [C.c_uint64, C.c_uint64, C.c_uint64, C.c_uint32]
    mark(0xF1E2D3C4B5A69788, 0x8877665544332211, 0xFEDCBA9876543210, 4)
    recorder.module.mark(0xF1E2D3C4B5A697888877665544332211, 0xFEDCBA9876543210, 4)
    (direct, via_mark) = recorder.records()
    for r in (direct, via_mark):
        assert r == (0xF1E2D3C4B5A69788, 0x8877665544332211, 0xFEDCBA9876543210, 4,
                     threading.get_native_id())


def test_mark_takes_the_full_range_and_refuses_what_does_not_fit(recorder):
    mark = recorder.module.mark
    mark(2**128 - 1, 2**64 - 1, 2**16 - 1)
    mark(2**64, 1, 0)  # the lowest trace id with a high half
    mark(0, 0, 0)
    bad = [((-1, 1, 0), OverflowError), ((2**128, 1, 0), OverflowError), ((1.0, 1, 0), TypeError),
           ((1, -1, 0), OverflowError), ((1, 2**64, 0), OverflowError), ((1, "1", 0), TypeError),
           ((1, 1, -1), OverflowError), ((1, 1, 2**16), OverflowError), ((1, 1), TypeError),
           ((1, 1, 0, 0), TypeError)]
    for args, error in bad:
        with pytest.raises(error):
            mark(*args)
    assert [r[:4] for r in recorder.records()] == [
        (2**64 - 1, 2**64 - 1, 2**64 - 1, 2**16 - 1), (1, 0, 1, 0), (0, 0, 0, 0)]


def test_record_get_refuses_calls_it_did_not_keep(recorder):
    recorder.module.mark(1, 2, 3)
    assert recorder.module.record_count() == 1
    with pytest.raises(IndexError):
        recorder.module.record_get(1)


def test_follow_marks_only_what_changed_per_thread_and_unmark_only_its_own_span(recorder):
    """The extension's per-thread last mark: follow() calls spanlet_mark only
    on a change, per thread; unmark() only for the thread's own last span;
    forget() makes the next follow() mark; record_reset() is back to none."""
    m = recorder.module
    a, b = (7 << 64 | 1, 11, 2), (7 << 64 | 1, 12, 0)
    assert [m.follow(*a), m.follow(*a), m.follow(*b), m.follow(*b)] == [True, False, True, False]
    other_thread = []
    t = threading.Thread(target=lambda: other_thread.append((m.follow(*b), m.follow(*b))))
    t.start()
    t.join(30)
    assert other_thread == [(True, False)]  # its own last mark, not the main thread's
    assert [m.unmark(8 << 64 | 1, 12), m.unmark(7 << 64 | 1, 11), m.unmark(7 << 64 | 1, 12)] == [
        False, False, True]  # another trace, an earlier span, then the thread's own
    assert [m.unmark(7 << 64 | 1, 12), m.follow(0, 0, 0)] == [False, False]  # already in none
    m.follow(*a)
    m.forget()
    assert [m.follow(*a), m.follow(*a)] == [True, False]
    main, tid = threading.get_native_id(), t.native_id
    assert [(r.tid, r[:4]) for r in recorder.records()] == [
        (main, (7, 1, 11, 2)), (main, (7, 1, 12, 0)), (tid, (7, 1, 12, 0)), (main, (0, 0, 0, 0)),
        (main, (7, 1, 11, 2)), (main, (7, 1, 11, 2))]
    for call, args, error in [(m.follow, (1, 2), TypeError), (m.follow, (1, -1, 0), OverflowError),
                              (m.unmark, (1,), TypeError), (m.unmark, (-1, 0), OverflowError)]:
        with pytest.raises(error):
            call(*args)
    recorder.reset()
    assert m.follow(0, 0, 0) is False  # the thread is back in no span


# Marks for spans.

def test_nested_spans_mark_start_child_parent_again_then_clear(recorder):
    provider, tracer, exporter = traced(client.SpanletSpanProcessor(recorder.path))
    with tracer.start_as_current_span("request", attributes={"mm.modality": "image"}) as root:
        with tracer.start_as_current_span("decode", attributes={"mm.modality": "text"}) as child:
            pass
    assert recorder.marks() == [ids(root, 2), ids(child, 1), ids(root, 2), CLEAR]
    assert root.get_span_context().trace_id == child.get_span_context().trace_id
    assert len(exporter.get_finished_spans()) == 2


@pytest.mark.parametrize("attributes, modality", [
    ({"mm.modality": "other"}, 0),
    ({"mm.modality": "text"}, 1),
    ({"mm.modality": "image"}, 2),
    ({"mm.modality": "audio"}, 3),
    ({"mm.modality": "video"}, 4),
    ({"mm.modality": "IMAGE"}, 0),
    ({"mm.modality": "hologram"}, 0),
    ({"mm.modality": 2}, 0),
    ({"mm.modality": ["image", "text"]}, 0),
    ({}, 0),
    (None, 0),
])
def test_modality_from_start_attributes(recorder, attributes, modality):
    _, tracer, _ = traced(client.SpanletSpanProcessor(recorder.path))
    with tracer.start_as_current_span("s", attributes=attributes) as span:
        pass
    assert recorder.marks() == [ids(span, modality), CLEAR]


def test_modality_numbers_match_the_agents_decoder():
    """client.py takes its numbers from spanlet.modality, as the decoder does."""
    from spanlet.events import Modality
    assert client.MODALITIES == {m.name: m.value for m in Modality}


def test_modality_set_after_start_is_not_seen(recorder):
    """Documented limit: the mark is made at start, from the attributes then."""
    _, tracer, _ = traced(client.SpanletSpanProcessor(recorder.path))
    with tracer.start_as_current_span("s") as span:
        span.set_attribute("mm.modality", "audio")
    assert recorder.marks() == [ids(span, 0), CLEAR]


@pytest.mark.parametrize("attributes, modality", [({"mm.modality": "video"}, 4), ({"k": "v"}, 0), (None, 0)])
def test_modality_through_the_public_api_for_other_span_classes(recorder, attributes, modality):
    """on_start reads the SDK span's attribute dict directly for speed; a span
    without it (another SDK version or span class) goes through span.attributes."""

    class OtherSpan:
        def __init__(self, inner):
            self._inner = inner

        def get_span_context(self):
            return self._inner.get_span_context()

        @property
        def attributes(self):
            return self._inner.attributes

        def is_recording(self):
            return self._inner.is_recording()

    proc = client.SpanletSpanProcessor(recorder.path)
    span = TracerProvider().get_tracer("plain").start_span("s", attributes=attributes)
    other = OtherSpan(span)
    proc.on_start(other)
    with current(other):
        pass
    span.end()
    proc.on_end(span)
    assert recorder.marks() == [ids(span, modality), CLEAR]


def test_a_span_of_another_provider_is_marked_when_current(recorder):
    """The kernel follows the thread's current span, whoever started it; its
    modality then comes from the attributes it has when it first becomes current."""
    client.SpanletSpanProcessor(recorder.path)
    span = TracerProvider().get_tracer("plain").start_span("s")
    span.set_attribute("mm.modality", "text")
    with current(span):
        pass
    assert recorder.marks() == [ids(span, 1), CLEAR]


def test_a_span_not_made_current_is_not_marked(recorder):
    """start_span alone does not change the thread's current span (nor the
    parent of the spans started next), so the kernel is not told about it."""
    _, tracer, _ = traced(client.SpanletSpanProcessor(recorder.path))
    with tracer.start_as_current_span("request", attributes={"mm.modality": "image"}) as request:
        side = tracer.start_span("side", attributes={"mm.modality": "audio"})
        side.end()
    assert recorder.marks() == [ids(request, 2), CLEAR]
    assert side.parent.span_id == request.get_span_context().span_id


def test_ended_and_non_recording_spans_are_never_marked(recorder):
    """A remote parent (extracted from headers) or a span that already ended is
    current in no kernel sense: its thread is marked as in no span."""
    _, tracer, _ = traced(client.SpanletSpanProcessor(recorder.path))
    remote = trace.NonRecordingSpan(trace.SpanContext(0xABC, 0xDEF, is_remote=True,
                                                      trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED)))
    ended = tracer.start_span("ended")
    ended.end()
    with current(remote):
        with tracer.start_as_current_span("server") as server:
            pass
        with current(ended):
            pass
    assert recorder.marks() == [ids(server, 0), CLEAR]


def test_a_span_ending_while_current_is_unmarked_at_its_end(recorder):
    """The parent ends first (not current: nothing to tell); the child ends
    while current: the thread is in no span from then on, and leaving the
    ended spans' contexts marks nothing more."""
    _, tracer, _ = traced(client.SpanletSpanProcessor(recorder.path))
    parent = tracer.start_span("parent", attributes={"mm.modality": "video"})
    with current(parent):
        child = tracer.start_span("child", attributes={"mm.modality": "audio"})
        with current(child):
            parent.end()
            assert recorder.marks() == [ids(parent, 4), ids(child, 3)]
            child.end()
            assert recorder.current() == CLEAR
    assert recorder.marks() == [ids(parent, 4), ids(child, 3), CLEAR]


def test_span_ended_on_another_thread_is_gone_from_its_starting_thread(recorder):
    _, tracer, _ = traced(client.SpanletSpanProcessor(recorder.path))
    started, ended = threading.Event(), threading.Event()
    box = {}

    def worker():
        box["span"] = tracer.start_span("handed-off", attributes={"mm.modality": "text"})
        with current(box["span"]):
            started.set()
            assert ended.wait(30)
            with tracer.start_as_current_span("later") as later:
                pass
        box["later"], box["tid"] = later, threading.get_native_id()

    t = threading.Thread(target=worker)
    t.start()
    try:
        assert started.wait(30)
        box["span"].end()  # on the main thread, whose stack is empty
    finally:
        ended.set()
        t.join(30)
    assert [(r.tid, m) for r, m in zip(recorder.records(), recorder.marks())] == [
        (box["tid"], ids(box["span"], 1)),
        # nothing from the main thread, which was and is in no span
        (box["tid"], ids(box["later"], 0)),
        (box["tid"], CLEAR),  # not the handed-off span back: it ended
    ]


def test_four_threads_interleaved_each_see_only_their_own_spans(recorder):
    """Each step runs on all four threads between two barrier waits, so the
    threads' spans are open at the same time and their marks interleave."""
    _, tracer, _ = traced(client.SpanletSpanProcessor(recorder.path))
    rounds, threads = 25, 4
    barrier = threading.Barrier(threads, timeout=30)
    expected: dict[int, list] = {}
    errors = []

    def worker(n: int) -> None:
        try:
            mine = expected.setdefault(threading.get_native_id(), [])
            modality = ("text", "image", "audio", "video")[n]
            for _ in range(rounds):
                with tracer.start_as_current_span("outer", attributes={"mm.modality": modality}) as outer:
                    barrier.wait()
                    with tracer.start_as_current_span("inner") as inner:
                        barrier.wait()
                    barrier.wait()
                barrier.wait()
                mine += [ids(outer, n + 1), ids(inner, 0), ids(outer, n + 1), CLEAR]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(60)
    assert not errors, errors
    seen: dict[int, list] = {}
    for r, m in zip(recorder.records(), recorder.marks()):
        seen.setdefault(r.tid, []).append(m)
    assert seen == expected
    assert len(seen) == threads and all(len(v) == 4 * rounds for v in seen.values())
    first_marks = [r.tid for r in recorder.records()[:threads]]
    assert len(set(first_marks)) == threads, "every thread's first span starts before any second"


def test_the_newest_active_processor_marks_and_the_one_before_takes_over_at_its_shutdown(recorder, tmp_path):
    """Two processors with two builds of the marker: every mark goes through
    the newest one's; when it shuts down, through the one before (which marks
    what is current then)."""
    second = Recorder(build(tmp_path, "libsecond.so", "-DSPANLET_MARKER_RECORD"))
    second.reset()
    first_proc = client.SpanletSpanProcessor(recorder.path)
    second_proc = client.SpanletSpanProcessor(second.path)
    provider, tracer, _ = traced(first_proc)
    provider.add_span_processor(second_proc)
    with tracer.start_as_current_span("both", attributes={"mm.modality": "text"}) as both:
        pass
    with tracer.start_as_current_span("across") as across:
        second_proc.shutdown()  # marks this thread as in none through its own marker
        with tracer.start_as_current_span("first only") as first_only:
            pass
    assert second.marks() == [ids(both, 1), CLEAR, ids(across, 0), CLEAR]
    assert recorder.marks() == [ids(first_only, 0), ids(across, 0), CLEAR]
    second.reset()


def test_while_active_the_hot_paths_are_the_extensions_and_go_at_shutdown(recorder):
    """What the span edge's cost rests on: on_start, on_end and the runtime
    context's attach and detach are the Follower's C methods while the
    processor is active; after its shutdown the class's (which do nothing)."""
    proc = client.SpanletSpanProcessor(recorder.path)
    follower, runtime = client._follower, context._RUNTIME_CONTEXT
    assert type(follower) is proc._marker.Follower
    assert (proc.on_start, proc.on_end) == (follower.on_start, follower.on_end)
    assert (runtime.attach, runtime.detach) == (follower.attach, follower.detach)
    proc.shutdown()
    assert client._follower is None and "on_start" not in vars(proc) and "attach" not in vars(runtime)
    _, tracer, _ = traced(proc)
    with tracer.start_as_current_span("after") as span:
        assert not hasattr(span, "_spanlet_mark")
    assert recorder.marks() == []


def test_a_subclass_that_overrides_the_processors_methods_keeps_its_overrides(recorder):
    calls = []

    class Mine(client.SpanletSpanProcessor):
        def on_start(self, span, parent_context=None):
            calls.append("start")
            super().on_start(span, parent_context)

        def on_end(self, span):
            calls.append("end")
            super().on_end(span)

    _, tracer, _ = traced(Mine(recorder.path))
    parent = tracer.start_span("parent")
    with current(parent):
        with tracer.start_as_current_span("s", attributes={"mm.modality": "audio"}) as span:
            with current(span):
                span.end()  # ends while current: unmarked by on_end
    parent.end()
    assert calls == ["start", "start", "end", "end"]
    assert recorder.marks() == [ids(parent), ids(span, 3), CLEAR, ids(parent), CLEAR]


def test_library_from_environment(recorder, monkeypatch):
    monkeypatch.setenv(client.LIB_ENV, recorder.path)
    _, tracer, _ = traced(client.SpanletSpanProcessor())
    with tracer.start_as_current_span("s", attributes={"mm.modality": "audio"}) as span:
        pass
    assert recorder.marks() == [ids(span, 3), CLEAR]


# The app must never break because of spanlet.

@pytest.mark.parametrize("which", ["missing", "not_elf", "no_mark", "no_init", "abi_other"])
def test_unusable_library_warns_once_and_spans_still_work(libs, fresh_client, caplog, which):
    caplog.set_level(logging.WARNING, logger="spanlet.client")
    other = "not_elf" if which == "missing" else "missing"  # a second, different failure
    procs = [client.SpanletSpanProcessor(libs[which]), client.SpanletSpanProcessor(libs[other])]
    provider, tracer, exporter = traced(procs[0])
    provider.add_span_processor(procs[1])
    for _ in range(3):
        with tracer.start_as_current_span("a", attributes={"mm.modality": "text"}):
            with tracer.start_as_current_span("b"):
                pass
    provider.shutdown()
    assert [p.active for p in procs] == [False, False]
    assert len(exporter.get_finished_spans()) == 6
    warnings = [r for r in caplog.records if r.name == "spanlet.client"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert libs[which] in warnings[0].getMessage()


def test_unusable_library_in_a_fresh_process_logs_exactly_one_warning(libs, tmp_path):
    """Once per process, for real: a child with the library missing from the environment."""
    script = (
        "import logging\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from spanlet import SpanletSpanProcessor\n"
        "logging.basicConfig(format='%(name)s %(levelname)s %(message)s')\n"
        "p = TracerProvider()\n"
        "for _ in range(3): p.add_span_processor(SpanletSpanProcessor())\n"
        "t = p.get_tracer('x')\n"
        "for _ in range(5):\n"
        "    with t.start_as_current_span('a'):\n"
        "        pass\n"
        "print('spans ok')\n"
    )
    env = dict(os.environ, **{client.LIB_ENV: libs["missing"]}, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "spans ok\n"
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("spanlet.client WARNING ") and libs["missing"] in lines[0]


def test_package_without_its_marker_warns_once_and_spans_still_work(fresh_client, monkeypatch, caplog):
    """An install whose extension is gone (or never built): the default load fails softly."""
    caplog.set_level(logging.WARNING, logger="spanlet.client")
    monkeypatch.setattr(client, "MARKER_MODULE", "spanlet.no_such_marker")
    proc = client.SpanletSpanProcessor()
    _, tracer, exporter = traced(proc)
    with tracer.start_as_current_span("a"):
        pass
    assert proc.active is False and len(exporter.get_finished_spans()) == 1
    warnings = [r for r in caplog.records if r.name == "spanlet.client"]
    assert len(warnings) == 1 and "spanlet.no_such_marker" in warnings[0].getMessage()


class _Exploding:
    """A span of another class whose every part raises."""

    def __getattr__(self, name):
        raise RuntimeError("marker exploded")

    def is_recording(self):
        raise RuntimeError("marker exploded")


class _SpoilsTheMark(SpanProcessor):
    """Added after spanlet's: leaves on the span a mark that is no mark."""

    def on_start(self, span, parent_context=None):
        span._spanlet_mark = ("not a trace id", 1, 0)


@pytest.mark.parametrize("where", ["a span of another class", "an SDK span with a broken mark"])
def test_exceptions_in_the_processor_never_reach_the_app(recorder, caplog, where):
    """The hot paths fail on the span (another class: on_start, attach, the
    asyncio hook, detach and on_end; an SDK span: every follow of its mark);
    the app goes on, and one warning is logged for all of them."""
    caplog.set_level(logging.WARNING, logger="spanlet.client")
    proc = client.SpanletSpanProcessor(recorder.path)
    provider, tracer, exporter = traced(proc)

    async def step():
        await asyncio.sleep(0)
        return "stepped"

    if where == "a span of another class":
        span = _Exploding()
        proc.on_start(span)
        with current(span):
            assert asyncio.run(step()) == "stepped"
        proc.on_end(span)
        message = "marker exploded"
    else:
        provider.add_span_processor(_SpoilsTheMark())
        with tracer.start_as_current_span("a"):
            with tracer.start_as_current_span("b"):
                assert asyncio.run(step()) == "stepped"
        assert len(exporter.get_finished_spans()) == 2
        message = "trace_id must be an int"
    warnings = [r for r in caplog.records if r.name == "spanlet.client"]
    assert len(warnings) == 1 and message in caplog.text
    assert recorder.marks() == []  # nothing was marked from what failed


def test_shutdown_clears_the_thread_and_stops_marking(recorder):
    proc = client.SpanletSpanProcessor(recorder.path)
    provider, tracer, _ = traced(proc)
    span = tracer.start_span("open-at-shutdown")
    with current(span):
        assert proc.force_flush() is True
        provider.shutdown()
        proc.shutdown()  # safe twice
        span.end()
        with tracer.start_as_current_span("after"):
            pass
    assert recorder.marks() == [ids(span, 0), CLEAR]
    assert proc.active is False


# The package: `from spanlet import SpanletSpanProcessor`, and nothing of the daemon.

def _fresh_python(code: str, tmp_path) -> str:
    env = {k: v for k, v in os.environ.items() if k != client.LIB_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_import_spanlet_loads_neither_the_client_nor_opentelemetry(tmp_path):
    out = _fresh_python("import sys, spanlet\n"
                        "print(sorted(m for m in sys.modules if m.startswith(('spanlet', 'opentelemetry'))))",
                        tmp_path)
    assert out.strip() == "['spanlet']"


def test_the_client_api_imports_and_marks_with_nothing_of_the_daemon(tmp_path):
    """The public import, a span with the processor active, and the modules that
    pulled in: the client and its marker only, no daemon dependency."""
    code = (
        "import sys\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from spanlet import SpanletSpanProcessor\n"
        "import spanlet.client\n"
        "assert SpanletSpanProcessor is spanlet.client.SpanletSpanProcessor\n"
        "p = TracerProvider(); proc = SpanletSpanProcessor(); p.add_span_processor(proc)\n"
        "with p.get_tracer('x').start_as_current_span('a', attributes={'mm.modality': 'text'}):\n"
        "    pass\n"
        "print(proc.active)\n"
        "print(sorted(m for m in sys.modules if m.startswith('spanlet')))\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'yaml', 'pydantic', 'pyroute2', 'bcc',\n"
        "      'prometheus_client', 'chdb', 'clickhouse_connect', 'kubernetes', 'rich', 'pynvml', 'grpc'}))\n"
    )
    active, spanlet_modules, daemon_deps = _fresh_python(code, tmp_path).splitlines()
    assert active == "True"
    # spanlet.modality and spanlet.runtimes: the stdlib-only modality names and
    # follow flags that the client shares with the agent.
    loaded = set(ast.literal_eval(spanlet_modules))
    assert {"spanlet", "spanlet.client", "spanlet.libspanlet_marker"} <= loaded
    assert loaded - {"spanlet", "spanlet.client", "spanlet.libspanlet_marker", "spanlet.modality",
                     "spanlet.runtimes"} == set()
    assert daemon_deps == "[]"


def test_an_unknown_name_is_still_an_attribute_error():
    import spanlet
    with pytest.raises(AttributeError):
        spanlet.NoSuchThing  # noqa: B018
    assert spanlet.SpanletSpanProcessor is client.SpanletSpanProcessor
