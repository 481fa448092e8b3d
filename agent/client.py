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
- asyncio: every callback of the standard event loops, task steps included,
  runs through ``asyncio.Handle._run``, which marks the span current in the
  callback's own context first, so coroutines of different spans interleaving
  on one thread each run with their own span marked; when ``run_forever``
  returns, the thread's own context is marked again;
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
- A marker call speaks for the calling thread only: a span ended on another
  thread stays marked in the thread where it is current until that thread's
  context next changes.
- Not followed: event loops that do not run their callbacks through
  ``asyncio.Handle`` (uvloop, for example: its coroutines share one mark,
  that of the last context change seen on the thread); a
  ``contextvars.Context.run`` outside those hooks (a hand-made executor or
  thread that runs ``copy_context().run(fn)``; spans started inside are still
  seen); threads started by C extensions, which run no Python context; a
  runtime context other than OTel's default (``OTEL_PYTHON_CONTEXT``): only
  attach and detach are followed then.

Per span this keeps one tuple, on the span object itself; per thread one
reference to the span last marked there (thread-local, gone with the thread).
Nothing grows with spans that never end.

The marker is the C extension ``spanlet.libspanlet_marker`` that the package
build compiles from native/spanlet_marker.c (another build of it can be named
by path: the argument, or $SPANLET_MARKER_LIB). If it cannot be used (missing,
not an extension of this interpreter, no ``mark``, or another ABI version), one
warning is logged per process on logger ``spanlet.client`` and the processor
does nothing. Nothing in here ever raises into the application. This module
imports nothing of the agent daemon: only the standard library and the
OpenTelemetry API and SDK.
"""

from __future__ import annotations

import asyncio.base_events
import asyncio.events
import concurrent.futures.thread
import contextvars
import functools
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import threading
import weakref

import opentelemetry.context as otel_context
from opentelemetry.context.context import _RuntimeContext
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
ABI_VERSION = 2
# name -> number; spanlet.modality is stdlib only, so no agent part comes with it
from spanlet.modality import NUMBERS as MODALITIES  # noqa: E402

_CLEAR = (0, 0, 0)  # mark()'s arguments for "in no span"
# The attribute of a span object that holds its mark() arguments (written as
# span._spanlet_mark where speed matters).
_ENTRY = "_spanlet_mark"

_warn_lock = threading.Lock()
_warned = False
_libs_lock = threading.Lock()
_libs: dict[str, object] = {}  # path (or MARKER_MODULE) -> its mark, or None


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
    """The marker's mark(trace_id, span_id, modality), ready to call, or None
    (after one warning per process) when the marker cannot be used."""
    path = library_path(lib_path)
    key = path or MARKER_MODULE
    with _libs_lock:
        if key in _libs:
            return _libs[key]
        try:
            mark = _checked_mark(load_extension(path))
        except Exception as e:  # ImportError, AttributeError, ABI mismatch: all mean "cannot use it"
            _warn_once("spanlet marker unusable, spans will not reach the spanlet agent: %s: %s", key, e)
            mark = None
        _libs[key] = mark
        return mark


def _checked_mark(module):
    version = getattr(module, "ABI_VERSION", None)
    if version != ABI_VERSION:
        raise ValueError(f"marker ABI version {version}, this client speaks {ABI_VERSION}")
    mark = getattr(module, "mark", None)
    if not callable(mark):
        raise AttributeError(f"no mark() in {module.__file__}")
    return mark


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


# What the marker was last told, per thread: [the span object last followed
# (None: none; held, so `is` is safe), the arguments of the last mark()]. One
# list, because each threading.local attribute access costs ~70 ns.
class _ThreadMark(threading.local):
    def __init__(self) -> None:
        self.last = [None, _CLEAR]  # a thread that never marked is in no span


_thread = _ThreadMark()
_mark = None  # the newest active processor's mark(), or None: follow nothing
_owners: list[weakref.ref] = []  # the active processors, newest last
_owners_lock = threading.Lock()


def _follow(span, last: list) -> None:
    """Tell the marker that `span` (a span object or None) is now this thread's
    current span, if that changes what it was last told; `last` is the thread's."""
    mark = _mark
    if mark is None:
        return
    last[0] = span
    try:
        if span is None:
            entry = _CLEAR
        elif type(span) is _SdkSpan:  # is_recording() without its call
            if span._end_time is not None:
                entry = _CLEAR
            else:
                try:
                    entry = span._spanlet_mark
                except AttributeError:  # started by a provider without our processor
                    entry = _entry_of(span)
        elif span.is_recording():
            entry = getattr(span, _ENTRY, None) or _entry_of(span)
        else:
            entry = _CLEAR
        if entry is not last[1]:
            last[1] = entry
            mark(*entry)
    except Exception:
        _warn_once("spanlet span processor failed to mark a context change; continuing", exc_info=True)


# Set by _install() when the runtime context is OTel's contextvars one: the
# ContextVar holding each context's OTel Context, and its get().
_CONTEXT_VAR: contextvars.ContextVar | None = None
_current_context = None


def _follow_current() -> None:
    """Follow the calling thread's current OTel context."""
    try:
        span = _current_context().get(_SPAN_KEY)
    except Exception:
        span = None
    last = _thread.last
    if span is not last[0]:
        _follow(span, last)


def _follow_context(ctx: contextvars.Context) -> None:
    """Follow the OTel context held in `ctx`, a contextvars context about to run here."""
    otel = ctx.get(_CONTEXT_VAR)
    span = otel.get(_SPAN_KEY) if otel is not None else None
    last = _thread.last
    if span is not last[0]:
        _follow(span, last)


class _FollowingRuntimeContext(_RuntimeContext):
    """OTel's runtime context, with every attach and detach followed by a mark
    when the thread's current span changed."""

    def __init__(self, inner: _RuntimeContext) -> None:
        self.inner = inner
        var = inner._current_context if type(inner) is ContextVarsRuntimeContext else None
        # The ContextVar's own methods where it is OTel's default (one Python
        # call less than the inner object's), else the inner object's.
        self.get_current = var.get if var is not None else inner.get_current
        self._set = var.set if var is not None else inner.attach
        self._reset = var.reset if var is not None else inner.detach

    def attach(self, context):
        token = self._set(context)
        try:
            span = context.get(_SPAN_KEY)
            last = _thread.last
            if span is not last[0]:
                _follow(span, last)
        except Exception:  # not an OTel Context: the OTel API's own checks speak for it
            pass
        return token

    def get_current(self):  # replaced per instance in __init__; here for the ABC
        return self.inner.get_current()

    def detach(self, token) -> None:
        self._reset(token)  # when it raises (OTel logs it), the context did not change
        try:  # _follow_current(), inlined: this runs on every span's end
            span = self.get_current().get(_SPAN_KEY)
            last = _thread.last
            if span is not last[0]:
                _follow(span, last)
        except Exception:
            pass


def _wrap_handle_run(run):
    @functools.wraps(run)
    def _run(self):
        try:
            _follow_context(self._context)
        except Exception:
            pass
        return run(self)
    _run.__spanlet_wraps__ = run
    return _run


def _wrap_run_forever(run_forever):
    @functools.wraps(run_forever)
    def run_forever_then_follow(self, *args, **kwargs):
        try:
            return run_forever(self, *args, **kwargs)
        finally:
            _follow_current()
    run_forever_then_follow.__spanlet_wraps__ = run_forever
    return run_forever_then_follow


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
        try:
            ctx = _copied_context_of(self.fn)
            if ctx is not None:
                _follow_context(ctx)
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
# (owner, attribute name, the wrapper factory) of each hook on a class.
_CLASS_HOOKS = (
    (asyncio.events.Handle, "_run", _wrap_handle_run),
    (asyncio.base_events.BaseEventLoop, "run_forever", _wrap_run_forever),
    (concurrent.futures.thread._WorkItem, "run", _wrap_work_item_run),
)


def _install_hooks() -> None:
    """Hook, once per process, where a thread's OTel context changes (see the module doc)."""
    global _hooked, _forked_hook, _CONTEXT_VAR, _current_context
    with _hooks_lock:
        if _hooked:
            return
        _hooked = True
        runtime = _FollowingRuntimeContext(otel_context._RUNTIME_CONTEXT)
        _current_context = runtime.get_current
        otel_context._RUNTIME_CONTEXT = runtime
        if not _forked_hook:  # a forked child's thread is new to the kernel: tell it the current span
            os.register_at_fork(after_in_child=_remark_after_fork)
            _forked_hook = True
        if type(runtime.inner) is not ContextVarsRuntimeContext:
            return  # no contextvar to read another context's span from
        _CONTEXT_VAR = runtime.inner._current_context
        for owner, name, wrap in _CLASS_HOOKS:
            setattr(owner, name, wrap(getattr(owner, name)))


def _remove_hooks() -> None:
    """Undo _install_hooks (for the bench and the tests: the app never needs it)."""
    global _hooked
    with _hooks_lock:
        if not _hooked:
            return
        _hooked = False
        runtime = otel_context._RUNTIME_CONTEXT
        if isinstance(runtime, _FollowingRuntimeContext):
            otel_context._RUNTIME_CONTEXT = runtime.inner
        for owner, name, _ in _CLASS_HOOKS:
            original = getattr(getattr(owner, name), "__spanlet_wraps__", None)
            if original is not None:
                setattr(owner, name, original)


def _remark_after_fork() -> None:
    if _hooked:
        _thread.last[:] = [object(), None]
        _follow_current()


def _use_newest_owner() -> None:
    """Mark through the newest processor still active; none: follow nothing."""
    global _mark
    _owners[:] = [ref for ref in _owners if ref() is not None and ref()._mark is not None]
    _mark = _owners[-1]()._mark if _owners else None


class SpanletSpanProcessor(SpanProcessor):
    """Marks each thread's current span for the spanlet agent; see the module doc."""

    def __init__(self, lib_path: str | os.PathLike | None = None) -> None:
        self._mark = load_marker(lib_path)
        if self._mark is None:
            return
        try:
            _install_hooks()
            with _owners_lock:
                _owners.append(weakref.ref(self))
                _use_newest_owner()
            _thread.last[0] = object()  # a span current already: tell this marker
            _follow_current()
        except Exception:
            _warn_once("spanlet span processor could not hook the OTel context; continuing", exc_info=True)

    @property
    def active(self) -> bool:
        """Whether the marker is in use (False: the processor is a no-op)."""
        return self._mark is not None

    def on_start(self, span: Span, parent_context=None) -> None:
        """Keeps the span's mark() arguments on it, for when it becomes current."""
        if self._mark is None:
            return
        try:
            if type(span) is _SdkSpan:  # the SDK's own fields: a third of the public calls' cost
                ctx = span._context  # a SpanContext: a tuple (trace_id, span_id, ...)
                span._spanlet_mark = (ctx[0], ctx[1], MODALITIES.get(span._attributes._dict.get(MODALITY_ATTRIBUTE), 0))
            else:
                setattr(span, _ENTRY, _entry_of(span))
        except Exception:
            _warn_once("spanlet span processor failed in on_start; continuing", exc_info=True)

    def on_end(self, span: ReadableSpan) -> None:
        """A span that ends while current in this thread is unmarked at once."""
        try:
            last, mark = _thread.last, _mark
            entry = last[1]
            if entry is _CLEAR or mark is None:
                return
            ctx = span._context if type(span) is ReadableSpan else span.context
            if entry[1] == ctx[1] and entry[0] == ctx[0]:  # a SpanContext is a tuple
                last[1] = _CLEAR
                mark(*_CLEAR)
        except Exception:
            _warn_once("spanlet span processor failed in on_end; continuing", exc_info=True)

    def shutdown(self) -> None:
        """Clears the calling thread's context and stops marking (safe twice)."""
        mark, self._mark = self._mark, None
        if mark is None:
            return
        try:
            mark(*_CLEAR)
            _thread.last[:] = [None, _CLEAR]
            with _owners_lock:
                _use_newest_owner()
        except Exception:
            pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing is buffered: every mark is made at once."""
        return True
