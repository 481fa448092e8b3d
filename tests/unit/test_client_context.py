"""The kernel follows each thread's real OTel context (agent/client.py): asyncio
task steps, work handed to other threads, fork, and bounded memory, against the
real SDK and the record build of the marker (every spanlet_mark call with its thread)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import tracemalloc
import weakref
from pathlib import Path

import pytest
import uvloop
import opentelemetry.context as otel_context
from opentelemetry import context, trace
from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

import marker_build
from marker_build import CLEAR, Recorder, forget_client_state, span_mark
from spanlet import client

ROOT = Path(__file__).resolve().parents[2]
MODALITIES = ("text", "image", "audio", "video")  # numbers 1..4


@pytest.fixture(scope="module")
def record_lib():
    out = Path(tempfile.mkdtemp(prefix="spanlet-client-context-"))
    try:
        yield marker_build.build(out, "librecord.so", "-DSPANLET_MARKER_RECORD")
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture
def recorder(record_lib, monkeypatch):
    forget_client_state(monkeypatch)
    rec = Recorder(record_lib)
    rec.reset()
    yield rec
    rec.reset()
    client._remove_hooks()


@pytest.fixture
def tracer(recorder):
    provider = TracerProvider()
    provider.add_span_processor(client.SpanletSpanProcessor(recorder.path))
    return provider.get_tracer("spanlet.test")


def current(span):
    return trace.use_span(span, end_on_exit=False)


# The loops production servers run: asyncio's own, and uvloop (uvicorn's
# default with uvicorn[standard], vLLM's and SGLang's API servers), whose
# loop is Cython and runs no asyncio.Handle: its tasks are followed through
# the task factory the client sets when asyncio.Runner makes the loop.
RUNS = {"asyncio": asyncio.run, "uvloop": uvloop.run}


@pytest.fixture(params=sorted(RUNS))
def run(request):
    return RUNS[request.param]


# asyncio: every step of every task runs with its own span marked.

def test_four_coroutines_interleaving_on_one_thread_each_step_with_its_own_span(recorder, tracer, run):
    steps = 5
    spans: dict[int, object] = {}
    seen: list[tuple[int, tuple]] = []  # (coroutine, what the kernel held) at every step

    async def request(i: int) -> None:
        with tracer.start_as_current_span(f"c{i}", attributes={"mm.modality": MODALITIES[i]}) as span:
            spans[i] = span
            for _ in range(steps):
                seen.append((i, recorder.current()))
                await asyncio.sleep(0)
            seen.append((i, recorder.current()))

    async def main() -> None:
        await asyncio.gather(*(request(i) for i in range(4)))

    run(main())
    mine = {i: span_mark(spans[i], i + 1) for i in range(4)}
    assert [i for i, _ in seen] == [0, 1, 2, 3] * (steps + 1)  # they did interleave
    assert [view for _, view in seen] == [mine[i] for i, _ in seen]
    # Each step marks its task's span as it begins (the first step as it
    # enters the span: its context was copied before it), and the loop's own
    # context (no span) again as it ends: between two steps the loop's own
    # callbacks run outside every task's span. Nothing else is marked.
    assert recorder.marks() == [m for i, _ in seen for m in (mine[i], CLEAR)]
    assert {r.tid for r in recorder.records()} == {threading.get_native_id()}


def test_every_kind_of_wake_up_runs_with_the_tasks_span(recorder, tracer, run):
    """Steps resumed by a timer, by a future another task sets, by a queue, and
    by a callback from another thread: each resumes with its own span marked."""
    views: list[tuple[str, tuple, tuple]] = []  # (where, expected, seen)

    async def waiter(name: str, wake) -> None:
        with tracer.start_as_current_span(name) as span:
            for _ in range(3):
                await wake()
                views.append((name, span_mark(span), recorder.current()))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        futures: list[asyncio.Future] = []

        def future_wake():
            futures.append(loop.create_future())
            return futures[-1]

        def thread_wake():
            fut = loop.create_future()
            threading.Thread(target=loop.call_soon_threadsafe, args=(fut.set_result, None)).start()
            return fut

        async def feeder() -> None:
            for _ in range(3):
                await asyncio.sleep(0.002)
                queue.put_nowait(1)
                while futures:
                    futures.pop().set_result(None)
            for _ in range(10):  # a straggling future_wake
                await asyncio.sleep(0.002)
                while futures:
                    futures.pop().set_result(None)

        await asyncio.gather(
            waiter("timer", lambda: asyncio.sleep(0.001)),
            waiter("queue", queue.get),
            waiter("future", future_wake),
            waiter("thread", thread_wake),
            feeder(),
        )

    run(main())
    assert sorted(name for name, _, _ in views) == sorted(["timer", "queue", "future", "thread"] * 3)
    assert [(n, seen) for n, _, seen in views] == [(n, expected) for n, expected, _ in views]


def test_a_task_created_before_its_creator_starts_a_span_runs_outside_it(recorder, tracer, run):
    """The task's context is copied when it is created: it is in no span, even
    right after its creator's span was marked on the same thread, until it
    starts its own."""
    log: list[tuple[str, tuple]] = []
    box = {}

    async def child() -> None:
        log.append(("child before its span", recorder.current()))
        with tracer.start_as_current_span("child", attributes={"mm.modality": "audio"}) as span:
            box["child"] = span
            log.append(("child in its span", recorder.current()))
            await asyncio.sleep(0)
            log.append(("child resumed", recorder.current()))
        log.append(("child after its span", recorder.current()))

    async def main() -> None:
        task = asyncio.create_task(child())
        with tracer.start_as_current_span("creator", attributes={"mm.modality": "text"}) as span:
            box["creator"] = span
            await asyncio.sleep(0)
            log.append(("creator resumed", recorder.current()))
            await task
            log.append(("creator after the child", recorder.current()))

    run(main())
    c, p = span_mark(box["child"], 3), span_mark(box["creator"], 1)
    assert log == [
        ("child before its span", CLEAR),
        ("child in its span", c),
        ("creator resumed", p),
        ("child resumed", c),
        ("child after its span", CLEAR),
        ("creator after the child", p),
    ]
    # each step marks its span as it begins and the loop's own context (none) as it ends
    assert recorder.marks() == [p, CLEAR, c, CLEAR, p, CLEAR, c, CLEAR, p, CLEAR]


@pytest.mark.parametrize("loop_made", ["before the processor", "after the processor"])
def test_a_step_that_ends_marks_the_threads_own_context_again(record_lib, monkeypatch, loop_made):
    """A task in an empty context runs on a thread that is in a span: its step
    runs in no span, and when it ends the thread is back in its own span,
    whenever the loop was made."""
    forget_client_state(monkeypatch)
    rec = Recorder(record_lib)
    try:
        loop = asyncio.new_event_loop() if loop_made == "before the processor" else None
        provider = TracerProvider()
        provider.add_span_processor(client.SpanletSpanProcessor(rec.path))
        rec.reset()
        loop = loop or asyncio.new_event_loop()
        views = []

        async def step() -> None:
            views.append(rec.current())

        with provider.get_tracer("t").start_as_current_span("outside the loop") as span:
            loop.run_until_complete(loop.create_task(step(), context=contextvars.Context()))
            views.append(rec.current())
        loop.close()
        assert views == [CLEAR, span_mark(span)]
        assert rec.marks() == [span_mark(span), CLEAR, span_mark(span), CLEAR]
    finally:
        rec.reset()
        client._remove_hooks()


# Work handed to another thread with the OTel context.

def _thread_marks(recorder: Recorder) -> dict[int, list]:
    out: dict[int, list] = {}
    for r in recorder.records():
        out.setdefault(r.tid, []).append(marker_build.as_mark(r))
    return out


def test_asyncio_to_thread_runs_on_the_span_then_the_worker_is_in_none_again(recorder, tracer, run):
    seen = {}

    def work() -> None:
        seen["tid"], seen["view"] = threading.get_native_id(), recorder.current()

    async def main() -> None:
        with tracer.start_as_current_span("request", attributes={"mm.modality": "image"}) as span:
            seen["span"] = span
            await asyncio.to_thread(work)
            seen["after, on the loop"] = recorder.current()

    run(main())
    mine = span_mark(seen["span"], 2)
    assert seen["view"] == mine and seen["after, on the loop"] == mine
    by_thread = _thread_marks(recorder)
    assert by_thread[seen["tid"]] == [mine, CLEAR]
    # On the loop's thread: the request, the executor's done callback (run in
    # the worker's empty context), the request again, then none.
    assert by_thread[threading.get_native_id()] == [mine, CLEAR, mine, CLEAR]


def test_run_in_executor_with_the_context_runs_on_the_span_on_either_loop(recorder, tracer, run):
    """What frameworks hand to a pool from a coroutine (Starlette's
    run_in_threadpool, FastAPI's sync endpoints): run_in_executor of the
    function in a copy of the context. Without the copy it runs in no span."""
    seen = {}

    def work(name: str) -> None:
        seen[name] = (threading.get_native_id(), recorder.current())

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with tracer.start_as_current_span("request", attributes={"mm.modality": "audio"}) as span:
            seen["span"] = span
            await loop.run_in_executor(None, functools.partial(contextvars.copy_context().run, work, "copied"))
            await loop.run_in_executor(None, work, "plain")
            seen["on the loop"] = recorder.current()

    run(main())
    mine = span_mark(seen["span"], 3)
    assert seen["copied"][1] == mine and seen["plain"][1] == CLEAR and seen["on the loop"] == mine
    assert _thread_marks(recorder)[seen["copied"][0]][:2] == [mine, CLEAR]


def test_uvloop_imported_after_the_processor_and_run_without_a_runner(record_lib, tmp_path):
    """A fresh process: the processor first, then uvloop imported (it binds
    asyncio._set_running_loop at its import) and a loop driven by hand
    (run_until_complete, no asyncio.Runner): its tasks are followed from the
    moment it runs."""
    code = f"""
import asyncio, json
from opentelemetry.sdk.trace import TracerProvider
from spanlet import client
from marker_build import Recorder, span_mark, CLEAR
rec = Recorder({record_lib!r})
provider = TracerProvider()
provider.add_span_processor(client.SpanletSpanProcessor(rec.path))
tracer = provider.get_tracer("t")
rec.reset()
import uvloop
seen, spans = [], {{}}

async def request(i):
    with tracer.start_as_current_span(f"c{{i}}") as span:
        spans[i] = span
        for _ in range(3):
            seen.append((i, rec.current()))
            await asyncio.sleep(0)

async def main():
    await asyncio.gather(*(request(i) for i in range(4)))

loop = uvloop.new_event_loop()
loop.run_until_complete(main())
mine = {{i: span_mark(s) for i, s in spans.items()}}
print(json.dumps([type(loop).__module__, [i for i, _ in seen], all(v == mine[i] for i, v in seen)]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "support"),
                                                                           os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr
    module, order, exact = __import__("json").loads(out.stdout)
    assert module.startswith("uvloop") and order == [0, 1, 2, 3] * 3 and exact is True


def test_pool_work_in_a_copied_context_runs_on_its_span_and_the_worker_gets_its_own_back(recorder, tracer):
    """The pool thread has a span of its own (attached by its initializer):
    a work item in a copied context runs on the submitter's span, and the
    worker is back on its own span after it; an item without a context stays there."""
    pool_span = tracer.start_span("pool thread", attributes={"mm.modality": "video"})
    seen = []

    def work(name: str) -> int:
        seen.append((name, recorder.current()))
        return threading.get_native_id()

    with concurrent.futures.ThreadPoolExecutor(
            1, initializer=lambda: context.attach(trace.set_span_in_context(pool_span))) as pool:
        with tracer.start_as_current_span("request", attributes={"mm.modality": "text"}) as span:
            tid = pool.submit(contextvars.copy_context().run, work, "copied").result(30)
            pool.submit(work, "plain").result(30)
            pool.submit(functools.partial(contextvars.copy_context().run, work, "partial")).result(30)
    mine, own = span_mark(span, 1), span_mark(pool_span, 4)
    assert seen == [("copied", mine), ("plain", own), ("partial", mine)]
    assert _thread_marks(recorder)[tid] == [own, mine, own, mine, own]


def test_context_attached_in_a_worker_thread_lands_on_its_span_and_is_left(recorder, tracer):
    seen = {}

    def worker(ctx) -> None:
        seen["tid"] = threading.get_native_id()
        token = context.attach(ctx)
        seen["in"] = recorder.current()
        with tracer.start_as_current_span("child") as child:
            seen["child"], seen["in child"] = child, recorder.current()
        seen["back"] = recorder.current()
        context.detach(token)
        seen["out"] = recorder.current()

    with tracer.start_as_current_span("request", attributes={"mm.modality": "audio"}) as span:
        t = threading.Thread(target=worker, args=(context.get_current(),))
        t.start()
        t.join(30)
    mine, child = span_mark(span, 3), span_mark(seen["child"])
    assert (seen["in"], seen["in child"], seen["back"], seen["out"]) == (mine, child, mine, CLEAR)
    assert _thread_marks(recorder)[seen["tid"]] == [mine, child, mine, CLEAR]


def test_a_failed_detach_still_leaves_the_kernel_on_the_real_context(recorder, tracer, caplog):
    """A token detached in another context (OTel logs it and goes on): the
    kernel stays on what the thread's context really is."""
    span = tracer.start_span("s")
    token = context.attach(trace.set_span_in_context(span))
    contextvars.Context().run(context.detach, token)  # fails inside OTel's detach
    assert recorder.current() == span_mark(span)
    context.detach(token)
    assert recorder.marks() == [span_mark(span), CLEAR]


def test_another_runtime_context_is_followed_through_its_own_attach_and_detach(recorder, monkeypatch):
    """A runtime context other than OTel's default (OTEL_PYTHON_CONTEXT): its
    own methods set and read the context, each attach and detach is followed;
    asyncio is not hooked (no contextvar to read another context's span from)."""
    calls = []

    class OtherRuntime(ContextVarsRuntimeContext):
        def attach(self, ctx):
            calls.append("attach")
            return super().attach(ctx)

        def detach(self, token):
            calls.append("detach")
            super().detach(token)

        def get_current(self):
            calls.append("get_current")
            return super().get_current()

    monkeypatch.setattr(otel_context, "_RUNTIME_CONTEXT", OtherRuntime())
    provider = TracerProvider()
    provider.add_span_processor(client.SpanletSpanProcessor(recorder.path))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("request", attributes={"mm.modality": "image"}) as request:
        with tracer.start_as_current_span("decode") as decode:
            pass
    assert recorder.marks() == [span_mark(request, 2), span_mark(decode), span_mark(request, 2), CLEAR]
    assert {"attach", "detach", "get_current"} <= set(calls)
    assert not hasattr(asyncio.events.Handle._run, "__spanlet_wraps__")


# Bad input and bounds.

def test_a_reused_span_id_in_another_trace_does_not_unmark_the_current_span(recorder):
    class SameSpanId(RandomIdGenerator):
        def generate_span_id(self) -> int:
            return 0x5A5A5A5A5A5A5A5A

    provider = TracerProvider(id_generator=SameSpanId())
    provider.add_span_processor(client.SpanletSpanProcessor(recorder.path))
    tracer = provider.get_tracer("t")
    a, b = tracer.start_span("a"), tracer.start_span("b")
    assert a.get_span_context().span_id == b.get_span_context().span_id
    assert a.get_span_context().trace_id != b.get_span_context().trace_id
    with current(a):
        b.end()  # same span id, another trace, not current: a stays marked
        assert recorder.current() == span_mark(a)
    assert recorder.marks() == [span_mark(a), CLEAR]


def _traced_bytes(snapshot: tracemalloc.Snapshot) -> int:
    """All that is allocated, by whatever frame: the client's hot paths are C
    (the marker's Follower), called from the SDK's frames."""
    kept = snapshot.filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    return sum(s.size for s in kept.statistics("filename"))


def _leak_spans(tracer, count: int, made_current: bool) -> list:
    """`count` spans started and never ended (made current and never detached,
    if asked); weak references to every 1000th; the test's context restored."""
    refs, tokens = [], []
    for i in range(count):
        span = tracer.start_span("leak", attributes={"mm.modality": "image"})
        if made_current:
            tokens[1:] = [context.attach(trace.set_span_in_context(span))]  # never detached
        if i % 1000 == 0:
            refs.append(weakref.ref(span))
    if tokens:
        context.detach(tokens[0])  # back to the test's own context, in no span
    return refs


def _containers(obj) -> dict[str, int]:
    return {name: len(value) for name, value in vars(obj).items()
            if isinstance(value, (dict, list, set)) and not name.startswith("__")}


@pytest.mark.parametrize("made_current", [False, True], ids=["started only", "made current, never detached"])
def test_100000_spans_never_ended_leave_nothing_behind_in_the_client(recorder, tracer, made_current):
    """No container of the client grows with spans, and no span stays
    referenced by it once the app drops them."""
    proc = tracer.span_processor._span_processors[0]
    before = _containers(client), _containers(proc)
    refs = _leak_spans(tracer, 100_000, made_current)
    gc.collect()
    assert [r for r in refs if r() is not None] == []
    assert (_containers(client), _containers(proc)) == before
    # made current: each span once (the log keeps the first 65,536), then none
    assert recorder.module.record_count() == (100_001 if made_current else 0)


def test_what_the_client_allocates_for_a_span_goes_with_the_span(recorder, tracer):
    _leak_spans(tracer, 100, made_current=True)  # what is made once per process (caches), before
    gc.collect()
    tracemalloc.start()
    try:
        before = _traced_bytes(tracemalloc.take_snapshot())
        _leak_spans(tracer, 5_000, made_current=True)
        gc.collect()
        after = _traced_bytes(tracemalloc.take_snapshot())
    finally:
        tracemalloc.stop()
    # a few hundred bytes of the OTel context's own; a byte a span would be 5 kB
    assert after - before < 4096, f"{after - before} bytes kept after 5,000 spans were dropped"


def test_a_thread_that_exits_inside_a_span_leaves_no_reference_to_it(recorder, tracer):
    box = {}

    def worker() -> None:
        span = tracer.start_span("never left")
        context.attach(trace.set_span_in_context(span))
        box["ref"], box["tid"] = weakref.ref(span), threading.get_native_id()

    t = threading.Thread(target=worker)
    t.start()
    t.join(30)
    gc.collect()
    assert box["ref"]() is None  # nothing of the client holds the span its thread died in
    assert [r.tid for r in recorder.records()] == [box["tid"]]


def test_a_forked_child_tells_the_kernel_its_current_span_at_once(recorder, tracer):
    """The child's thread is new to the kernel: it is marked as soon as it runs."""
    with tracer.start_as_current_span("across fork", attributes={"mm.modality": "video"}) as span:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what the kernel holds for this thread, and leave
            try:
                os.write(write, repr(recorder.current() == span_mark(span, 4)).encode())
            finally:
                os._exit(0)
        os.close(write)
        answer = os.read(read, 100)
        os.close(read)
        os.waitpid(pid, 0)
    assert answer == b"True"


def test_a_process_that_exits_right_after_its_last_span_exits_cleanly(record_lib, tmp_path):
    script = (
        "import asyncio, sys\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from spanlet import SpanletSpanProcessor\n"
        "import spanlet.client as c\n"
        "p = TracerProvider(); p.add_span_processor(SpanletSpanProcessor(sys.argv[1])); t = p.get_tracer('x')\n"
        "async def main():\n"
        "    with t.start_as_current_span('last'):\n"
        "        await asyncio.to_thread(lambda: None)\n"
        "asyncio.run(main())\n"
        "m = c.load_extension(sys.argv[1])\n"
        "print(m.record_count())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != client.LIB_ENV}
    out = subprocess.run([sys.executable, "-c", script, record_lib], env=env, capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert int(out.stdout) >= 4  # the span on both threads, then none on both


# What the process's requests run on that is not followed per coroutine.

def test_a_gevent_process_says_so_once_and_every_mark_carries_it(recorder, tracer, monkeypatch, caplog):
    import types
    monkey = types.ModuleType("gevent.monkey")
    monkey.is_anything_patched = lambda: True
    monkeypatch.setitem(sys.modules, "gevent.monkey", monkey)
    with caplog.at_level("WARNING", logger="spanlet.client"):
        for _ in range(3):
            with tracer.start_as_current_span("request") as span:
                pass
    said = [r.getMessage() for r in caplog.records if "followed per thread only" in r.getMessage()]
    assert len(said) == 1 and "run on gevent" in said[0]
    flags = {r.modality >> 16 for r in recorder.records()}
    assert flags == {2}                       # NotFollowed.gevent on every mark, span and clear alike
    assert recorder.marks()[-2:] == [span_mark(span, 2 << 16), (CLEAR[0], 0, 2 << 16)]


def test_a_running_loop_whose_tasks_cannot_be_followed_is_said(recorder, tracer, monkeypatch, caplog):
    """A loop without a task factory to chain (not an asyncio loop, not uvloop)."""
    monkeypatch.setattr(asyncio.events, "_get_running_loop", lambda: object())
    with caplog.at_level("WARNING", logger="spanlet.client"):
        with tracer.start_as_current_span("request"):
            pass
    assert [r.modality >> 16 for r in recorder.records()] == [8, 8]   # NotFollowed.loop
    assert any("run on loop" in r.getMessage() for r in caplog.records)


def test_a_process_on_a_followed_loop_carries_no_flag(recorder, tracer, run):
    async def main() -> None:
        for _ in range(3):
            with tracer.start_as_current_span("request"):
                await asyncio.sleep(0)
    run(main())
    assert recorder.records() and {r.modality >> 16 for r in recorder.records()} == {0}
