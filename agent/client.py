"""Client side of span context: an OpenTelemetry SpanProcessor that tells the
spanlet agent, through a native marker the agent uprobes, which span each thread is in.

Usage, in any OTel-instrumented Python process (no privileges needed)::

    from opentelemetry.sdk.trace import TracerProvider
    from spanlet import SpanletSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(SpanletSpanProcessor())
    tracer = provider.get_tracer(__name__)
    with tracer.start_as_current_span("decode", attributes={"mm.modality": "image"}):
        ...  # kernel events of this thread now carry this span's ids and "image"

The kernel sees, in every thread, the span that is current there in the OTel
context (``opentelemetry.trace.get_current_span()``), and the marker is called
only when that changes. The first active processor hooks the places where a
thread's OTel context changes, once per process:

- ``opentelemetry.context.attach`` and ``detach`` (``start_as_current_span``,
  ``use_span``, an explicit ``attach`` in a worker thread): the runtime
  context is wrapped;
- asyncio tasks, on any loop that runs ``asyncio.Task`` (asyncio's own,
  uvloop, eager tasks): each task's coroutine is wrapped, as the task is made,
  in the marker's ``FollowedCoroutine``, whose every step (C) marks the span
  current in the task's own context as it begins and marks again what the
  thread held before as it ends. So coroutines of different spans
  interleaving on one thread each run with their own span marked, and the
  loop's own callbacks between steps run outside them. The wrapping is put
  in a task's way where the task is made: asyncio's ``create_task``; on any
  other loop (uvloop), a task factory set on the loop when ``asyncio.Runner``
  makes it (``asyncio.run``, ``uvloop.run``, uvicorn) or when it starts
  running, chained before the factory the loop had (an app's own, or
  ``asyncio.eager_task_factory``, whose first eager step is followed too);
- ``concurrent.futures.ThreadPoolExecutor`` work items that run in a copied
  context (``submit(ctx.run, fn)``, ``functools.partial(ctx.run, ...)`` as
  ``asyncio.to_thread`` and ``run_in_executor`` with a copied context make):
  the item runs with that context's span marked, and the worker's own
  context is marked again after it.

So:

- A span that is started but never made current (``start_span`` alone) is not
  marked: it is not the thread's current span, and its children would not
  be its children either. A span that ends while it is still current is
  unmarked by its end (what that thread does next belongs to no span until
  its context changes); an ended or non-recording span (a remote parent, a
  sampled-out span) is never marked.
- The modality is read once, from the attributes the span has when it starts:
  pass ``mm.modality`` (text, image, audio, video or other; anything else
  counts as other) to ``start_span(attributes=...)`` or
  ``start_as_current_span(attributes=...)``. Setting it later has no effect.
  (A span of a provider without this processor is marked too when current,
  with the modality it has when it first becomes current.)
- A marker call speaks for the calling thread only: a span ended on another
  thread stays marked in the thread where it is current until that thread's
  context next changes.
- Not followed: plain loop callbacks run in a context of their own
  (``call_soon(fn, context=ctx)``: they run with the thread's mark); a
  ``contextvars.Context.run`` outside those hooks (a hand-made executor or
  thread that runs ``copy_context().run(fn)``; spans started inside are still
  seen); threads started by C extensions, which run no Python context; a
  runtime context other than OTel's default (``OTEL_PYTHON_CONTEXT``): only
  attach and detach are followed then. Requests that run on trio, gevent or
  eventlet, or on a loop whose tasks could not be given the factory, are
  followed per thread only: found at the process's first span starts
  (spanlet/runtimes.py), said once in a warning, and carried by every mark
  to the agent, which counts and shows such processes.

Per span this keeps one tuple, on the span object itself; per thread the
extension keeps the last mark's integers (C thread-local: no reference, gone
with the thread), and calls spanlet_mark only when they change. Nothing grows
with spans that never end. The hot paths (on_start, on_end, the wrapped attach
and detach, the asyncio and executor hooks' follow) are C: the methods of the
extension's ``Follower``, so a span edge runs no Python of spanlet's own.

The marker is the C extension ``spanlet.libspanlet_marker`` that the package
build compiles from native/spanlet_marker.c (another build of it can be named
by path: the argument, or $SPANLET_MARKER_LIB). If it cannot be used (missing,
not an extension of this interpreter, no ``mark``/``follow``/``unmark``/``forget``/
``Follower``, or another ABI version), one
warning is logged per process on logger ``spanlet.client`` and the processor
does nothing. Nothing in here ever raises into the application. This module
imports nothing of the agent daemon: only the standard library and the
OpenTelemetry API and SDK.
"""

from __future__ import annotations

import asyncio
import asyncio.base_events
import asyncio.events
import asyncio.runners
import asyncio.tasks
import collections.abc
import concurrent.futures.thread
import contextvars
import functools
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
import types
import weakref

import opentelemetry.context as otel_context
from opentelemetry.context.context import Context, _RuntimeContext
from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace import _Span as _SdkSpan  # the class the SDK's tracer makes
from opentelemetry.trace.propagation import _SPAN_KEY

logger = logging.getLogger("spanlet.client")

MODALITY_ATTRIBUTE = "mm.modality"
LIB_ENV = "SPANLET_MARKER_LIB"
# The extension's module name; a build loaded from a path is loaded under it too
# (its init function is PyInit_libspanlet_marker).
MARKER_MODULE = "spanlet.libspanlet_marker"
ABI_VERSION = 5
# name -> number; spanlet.modality is stdlib only, so no agent part comes with it
from spanlet.modality import NUMBERS as MODALITIES  # noqa: E402
from spanlet import runtimes  # noqa: E402  (stdlib only too)

_CLEAR = (0, 0, 0)  # mark()'s arguments for "in no span"
# The attribute of a span object that holds its mark() arguments (written as
# span._spanlet_mark where speed matters).
_ENTRY = "_spanlet_mark"

_warn_lock = threading.Lock()
_warned = False
_libs_lock = threading.Lock()
_libs: dict[str, object] = {}  # path (or MARKER_MODULE) -> its mark, or None
_FOLLOWED_TYPES: set[type] = set()  # the FollowedCoroutine types of the markers loaded


def _warn_once(message: str, *args, exc_info: bool = False) -> None:
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    logger.warning(message, *args, exc_info=exc_info)


def library_path(lib_path: str | os.PathLike | None = None) -> str | None:
    """The marker extension file to load: the argument, else
    $SPANLET_MARKER_LIB, else None (the package's own MARKER_MODULE)."""
    path = lib_path or os.environ.get(LIB_ENV)
    return os.fspath(path) if path else None


def load_extension(path: str | None):
    """The marker extension module: the package's own (path None), or the build
    at `path` (any file name) loaded under MARKER_MODULE's name. Raises
    ImportError when it cannot be loaded."""
    if path is None:
        return importlib.import_module(MARKER_MODULE)
    loader = importlib.machinery.ExtensionFileLoader(MARKER_MODULE, path)
    spec = importlib.util.spec_from_file_location(MARKER_MODULE, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load_marker(lib_path: str | os.PathLike | None = None):
    """The marker module, checked (its ABI version; mark, follow, unmark,
    forget and Follower), or None (after one warning per process) when it cannot be used."""
    path = library_path(lib_path)
    key = path or MARKER_MODULE
    with _libs_lock:
        if key in _libs:
            return _libs[key]
        try:
            marker = _checked_marker(load_extension(path))
        except Exception as e:  # ImportError, AttributeError, ABI mismatch: all mean "cannot use it"
            _warn_once("spanlet marker unusable, spans will not reach the spanlet agent: %s: %s", key, e)
            marker = None
        _libs[key] = marker
        return marker


def _checked_marker(module):
    version = getattr(module, "ABI_VERSION", None)
    if version != ABI_VERSION:
        raise ValueError(f"marker ABI version {version}, this client speaks {ABI_VERSION}")
    for name in ("mark", "follow", "unmark", "forget", "set_follow_flags", "Follower", "FollowedCoroutine"):
        if not callable(getattr(module, name, None)):
            raise AttributeError(f"no {name}() in {module.__file__}")
    # A Task takes any registered Coroutine: the wrapped coroutines of the task factory
    collections.abc.Coroutine.register(module.FollowedCoroutine)
    _FOLLOWED_TYPES.add(module.FollowedCoroutine)
    return module


def _modality_attribute(span):
    """The span's mm.modality value through the public API, or None."""
    attributes = span.attributes
    return attributes.get(MODALITY_ATTRIBUTE) if attributes else None


def _entry_of(span) -> tuple[int, int, int]:
    """mark()'s arguments for `span`, from the attributes it has now."""
    ctx = span.get_span_context()
    try:  # the SDK span's own dict: 0.1 µs where the public mapping costs 1 µs
        modality = span._attributes._dict.get(MODALITY_ATTRIBUTE)
    except AttributeError:  # another SDK version or span class
        modality = _modality_attribute(span)
    return (ctx.trace_id, ctx.span_id, MODALITIES.get(modality, 0))


def _entry_for(span) -> tuple[int, int, int]:
    """mark()'s arguments for a current span that the Follower's direct path
    does not know: another span class, or an SDK span started by a provider
    without this processor (not ended: the Follower checked)."""
    if type(span) is not _SdkSpan:
        if not span.is_recording():
            return _CLEAR
        entry = getattr(span, _ENTRY, None)
        if entry:
            return entry
    return _entry_of(span)


def _keep_entry(span) -> None:
    """on_start's work the public way: the Follower's for a span not of the
    SDK's own class, and the class's own on_start."""
    setattr(span, _ENTRY, _entry_of(span))


def _report(where: str, exc: BaseException) -> None:
    """What the Follower calls when a hot path failed (and went on)."""
    _warn_once("spanlet span processor failed %s; continuing", where, exc_info=exc)


# The hot paths (the processor's on_start and on_end, the runtime context's
# attach and detach, the asyncio and executor hooks) are the methods of a
# Follower, a type of the marker extension, made for the newest active
# processor's marker: C, so that a span edge runs no Python of spanlet's own.
# What the marker was last told is kept per thread in the extension (C
# thread-local integers: no reference held, nothing left when a thread exits);
# it calls spanlet_mark only when that changes.
_follower = None  # the newest active processor's marker's Follower, or None: follow nothing
_owners: list[weakref.ref] = []  # the active processors, newest last
_owners_lock = threading.Lock()


def _follow_current() -> None:
    """Follow the calling thread's current OTel context."""
    follower = _follower
    if follower is not None:
        follower.follow_current()


class _FollowingRuntimeContext(_RuntimeContext):
    """OTel's runtime context, with every attach and detach followed by a mark
    when the thread's current span changed: while a processor is active its
    attach and detach are the Follower's, set on the instance (_wire); the
    methods here only pass through."""

    def __init__(self, inner: _RuntimeContext) -> None:
        self.inner = inner
        var = inner._current_context if type(inner) is ContextVarsRuntimeContext else None
        # The ContextVar's own methods where it is OTel's default (one Python
        # call less than the inner object's), else the inner object's.
        self.get_current = var.get if var is not None else inner.get_current
        self._set = var.set if var is not None else inner.attach
        self._reset = var.reset if var is not None else inner.detach

    def attach(self, context):  # the Follower's while a processor is active
        return self._set(context)

    def get_current(self):  # replaced per instance in __init__; here for the ABC
        return self.inner.get_current()

    def detach(self, token) -> None:  # the Follower's while a processor is active
        self._reset(token)


_runtime: _FollowingRuntimeContext | None = None  # what _install_hooks put in place


def _make_follower(marker, runtime: _FollowingRuntimeContext | None):
    """The marker's Follower, reading the context of `runtime`'s inner
    runtime context (None: of the OTel runtime context as it is)."""
    inner = runtime.inner if runtime is not None else otel_context._RUNTIME_CONTEXT
    var = inner._current_context if type(inner) is ContextVarsRuntimeContext else None
    return marker.Follower(
        span_type=_SdkSpan, readable_type=ReadableSpan, context_type=Context, span_key=_SPAN_KEY,
        modalities=MODALITIES, modality_key=MODALITY_ATTRIBUTE, entry_of=_entry_for,
        start_of=_keep_entry, report=_report, var=var, runtime=None if var is not None else inner,
        first_start=_look_at_runtime)


# The processor's methods that are the Follower's, set on the instance, while
# it is active (where a subclass does not override them).
_HOT_METHODS = ("on_start", "on_end")


def _wire() -> None:
    """(With _owners_lock held.) Points every hot path at a Follower of the
    newest processor still active; with none, at nothing."""
    global _follower
    _owners[:] = [ref for ref in _owners if ref() is not None and ref()._marker is not None]
    owners = [ref() for ref in _owners]
    runtime = _runtime
    follower = _make_follower(owners[-1]._marker, runtime) if owners else None
    _follower = follower
    if runtime is not None:
        if follower is not None:
            runtime.attach, runtime.detach = follower.attach, follower.detach
        else:
            vars(runtime).pop("attach", None)
            vars(runtime).pop("detach", None)
    for processor in owners:
        for name in _HOT_METHODS:
            if getattr(type(processor), name) is getattr(SpanletSpanProcessor, name):  # not overridden
                setattr(processor, name, getattr(follower, name))


# -- asyncio tasks: every step followed, on any loop that runs asyncio.Task ------

def _followed(coro):
    """The task's coroutine wrapped so that each of its steps is followed
    (as it is, where nothing follows, it is no coroutine, or it is wrapped)."""
    follower = _follower
    if follower is None or type(coro) in _FOLLOWED_TYPES:
        return coro
    if type(coro) is not types.CoroutineType and not asyncio.iscoroutine(coro):
        return coro  # not a coroutine: the Task's own check speaks for it
    return follower.wrap(coro)


def _following_factory(inner):
    """A task factory that wraps each task's coroutine, then makes the task
    as `inner` (a loop's factory; None: asyncio.Task, as loops do without one)."""
    if getattr(inner, "__spanlet_follows__", False):
        return inner

    def follow_task_steps(loop, coro, **kwargs):
        coro = _followed(coro)
        if inner is None:
            return asyncio.Task(coro, loop=loop, **kwargs)
        return inner(loop, coro, **kwargs)
    follow_task_steps.__spanlet_follows__ = True
    follow_task_steps.__wrapped__ = inner
    return follow_task_steps


def _loop_followed(loop) -> bool:
    """Whether the tasks `loop` makes are followed: asyncio's own loops (their
    create_task is hooked), or a loop given the following factory."""
    if isinstance(loop, asyncio.base_events.BaseEventLoop):
        return True
    get = getattr(loop, "get_task_factory", None)
    try:
        return get is not None and getattr(get(), "__spanlet_follows__", False)
    except Exception:
        return False


def _follow_tasks_of(loop) -> bool:
    """Give a loop that is not asyncio's own (uvloop) the following task
    factory, chained before the one it has; whether its tasks are followed."""
    if loop is None or _loop_followed(loop):
        return True
    try:
        loop.set_task_factory(_following_factory(loop.get_task_factory()))
    except Exception:
        return False
    return True


def _wrap_create_task(create_task):
    @functools.wraps(create_task)
    def create_task_followed(self, coro, *args, **kwargs):
        return create_task(self, _followed(coro), *args, **kwargs)
    create_task_followed.__spanlet_wraps__ = create_task
    return create_task_followed


def _wrap_lazy_init(lazy_init):
    @functools.wraps(lazy_init)
    def lazy_init_then_follow(self, *args, **kwargs):
        result = lazy_init(self, *args, **kwargs)
        _follow_tasks_of(getattr(self, "_loop", None))
        return result
    lazy_init_then_follow.__spanlet_wraps__ = lazy_init
    return lazy_init_then_follow


def _wrap_set_running_loop(set_running_loop):
    @functools.wraps(set_running_loop)
    def set_running_loop_followed(loop):
        if loop is not None and _follower is not None:
            _follow_tasks_of(loop)
        return set_running_loop(loop)
    set_running_loop_followed.__spanlet_wraps__ = set_running_loop
    return set_running_loop_followed


def _wrap_eager_factory(factory):
    followed = _following_factory(factory)
    followed.__spanlet_wraps__ = factory
    return followed


def _wrap_make_eager_factory(make):
    @functools.wraps(make)
    def make_followed(*args, **kwargs):
        return _following_factory(make(*args, **kwargs))
    make_followed.__spanlet_wraps__ = make
    return make_followed


# -- what the process's requests run on, looked at while its first spans start -----

_LOOKS = 1000          # span starts looked at for a running loop before giving up
_looks_left = _LOOKS
_follow_flags = 0      # runtimes.NotFollowed flags found (0: every span followed per coroutine)


def _look_at_runtime() -> bool:
    """Called by the Follower at the process's first span starts: finds what
    its requests run on that spanlet cannot follow per coroutine, sets the
    flags in the marker (every mark carries them to the agent) and says so
    once. True: look again at the next span start (no event loop seen yet)."""
    global _looks_left, _follow_flags
    loop = asyncio.events._get_running_loop()
    followed = loop is None or _follow_tasks_of(loop)
    flags = runtimes.detect(sys.modules, loop, followed)
    _looks_left -= 1
    if flags:
        if flags != _follow_flags:     # (a forked child inherits what its parent found and said)
            _follow_flags = flags
            for ref in list(_owners):
                processor = ref()
                if processor is not None and processor._marker is not None:
                    processor._marker.set_follow_flags(flags)
            logger.warning("spanlet: this process's requests run on %s: its spans are followed per "
                           "thread only (kernel facts of requests sharing a thread may land on each "
                           "other's spans)", " and ".join(runtimes.names(flags)))
        return False
    return loop is None and _looks_left > 0


def _copied_context_of(fn) -> contextvars.Context | None:
    """The context that a work item `fn` runs itself in: `ctx.run`, bound, or in
    a functools.partial (what asyncio.to_thread submits); else None."""
    if type(fn) is functools.partial:
        fn = fn.func
    ctx = getattr(fn, "__self__", None)
    return ctx if type(ctx) is contextvars.Context and fn == ctx.run else None


def _wrap_work_item_run(run):
    @functools.wraps(run)
    def run_in_its_context(self):
        follower, ctx = _follower, None
        if follower is not None:
            try:
                ctx = _copied_context_of(self.fn)
                if ctx is not None:
                    follower.follow_context(ctx)
            except Exception:
                ctx = None
        try:
            return run(self)
        finally:
            if ctx is not None:
                _follow_current()
    run_in_its_context.__spanlet_wraps__ = run
    return run_in_its_context


_hooks_lock = threading.Lock()
_hooked = False
_forked_hook = False
# (owner, attribute name, the wrapper factory) of each hook on a class or a
# module (where the name is missing, as eager tasks before 3.12, none).
_CLASS_HOOKS = (
    (asyncio.base_events.BaseEventLoop, "create_task", _wrap_create_task),
    (asyncio.runners.Runner, "_lazy_init", _wrap_lazy_init),
    (asyncio.events, "_set_running_loop", _wrap_set_running_loop),
    (asyncio, "_set_running_loop", _wrap_set_running_loop),   # what uvloop binds at its import
    (asyncio.tasks, "eager_task_factory", _wrap_eager_factory),
    (asyncio, "eager_task_factory", _wrap_eager_factory),
    (asyncio.tasks, "create_eager_task_factory", _wrap_make_eager_factory),
    (asyncio, "create_eager_task_factory", _wrap_make_eager_factory),
    (concurrent.futures.thread._WorkItem, "run", _wrap_work_item_run),
)


def _install_hooks() -> None:
    """Hook, once per process, where a thread's OTel context changes (see the module doc)."""
    global _hooked, _forked_hook, _runtime
    with _hooks_lock:
        if _hooked:
            return
        _hooked = True
        runtime = _FollowingRuntimeContext(otel_context._RUNTIME_CONTEXT)
        with _owners_lock:
            _runtime = runtime
            _wire()
        otel_context._RUNTIME_CONTEXT = runtime
        if not _forked_hook:  # a forked child's thread is new to the kernel: tell it the current span
            os.register_at_fork(after_in_child=_remark_after_fork)
            _forked_hook = True
        if type(runtime.inner) is not ContextVarsRuntimeContext:
            return  # no contextvar to read another context's span from
        for owner, name, wrap in _CLASS_HOOKS:
            if hasattr(owner, name):
                setattr(owner, name, wrap(getattr(owner, name)))
        # a loop already running on this thread (a processor made inside a coroutine)
        _follow_tasks_of(asyncio.events._get_running_loop())


def _remove_hooks() -> None:
    """Undo _install_hooks (for the bench and the tests: the app never needs it)."""
    global _hooked, _runtime
    with _hooks_lock:
        if not _hooked:
            return
        _hooked = False
        _runtime = None
        runtime = otel_context._RUNTIME_CONTEXT
        if isinstance(runtime, _FollowingRuntimeContext):
            otel_context._RUNTIME_CONTEXT = runtime.inner
        for owner, name, _ in _CLASS_HOOKS:
            original = getattr(getattr(owner, name, None), "__spanlet_wraps__", None)
            if original is not None:
                setattr(owner, name, original)


def _remark_after_fork() -> None:
    global _looks_left
    _looks_left = _LOOKS   # the child may run on something else (a gevent worker): look again
    for ref in list(_owners):
        processor = ref()
        if processor is not None and processor._marker is not None:
            processor._marker.forget()
    if _hooked:
        _follow_current()


class SpanletSpanProcessor(SpanProcessor):
    """Marks each thread's current span for the spanlet agent; see the module doc."""

    def __init__(self, lib_path: str | os.PathLike | None = None) -> None:
        self._marker = load_marker(lib_path)
        self._mark = self._marker.mark if self._marker is not None else None
        if self._marker is None:
            return
        try:
            _install_hooks()
            with _owners_lock:
                _owners.append(weakref.ref(self))
                _wire()
            _follow_current()  # a span current already: tell this marker
        except Exception:
            _warn_once("spanlet span processor could not hook the OTel context; continuing", exc_info=True)

    @property
    def active(self) -> bool:
        """Whether the marker is in use (False: the processor is a no-op)."""
        return self._mark is not None

    # While the processor is active, on_start and on_end are the Follower's, set
    # on the instance (_wire): C. These are what it has otherwise.

    def on_start(self, span: Span, parent_context=None) -> None:
        """Keeps the span's mark() arguments on it (span._spanlet_mark), for when it becomes current."""
        if self._mark is None:
            return
        try:
            _keep_entry(span)
        except Exception:
            _warn_once("spanlet span processor failed in on_start; continuing", exc_info=True)

    def on_end(self, span: ReadableSpan) -> None:
        """A span that ends while current in this thread is unmarked at once."""
        follower = _follower
        if follower is not None:
            follower.on_end(span)

    def shutdown(self) -> None:
        """Clears the calling thread's context and stops marking (safe twice)."""
        marker, self._marker, self._mark = self._marker, None, None
        if marker is None:
            return
        try:
            marker.follow(*_CLEAR)
            with _owners_lock:
                for name in _HOT_METHODS:  # back to the class's
                    vars(self).pop(name, None)
                _wire()
        except Exception:
            pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing is buffered: every mark is made at once."""
        return True
