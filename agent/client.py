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

On every span start the span is pushed on its thread's stack and the thread's
context becomes that span; on every end it is removed and the thread's context
becomes the new top of the ending thread's stack, or none. The context is keyed
by kernel thread id, so:

- The modality is read once, from the attributes the span has when it starts:
  pass ``mm.modality`` (text, image, audio, video or other; anything else
  counts as other) to ``start_span(attributes=...)`` or
  ``start_as_current_span(attributes=...)``. Setting it later has no effect.
- A span ended on another thread than the one that started it is removed from
  its starting thread's stack, but that thread's kernel context keeps naming
  the span until that thread's next span start or end (a marker call can only
  speak for the calling thread).
- Coroutines sharing a thread share its context: the thread is in the span
  that started last and has not ended.

The marker is the C extension ``spanlet.libspanlet_marker`` that the package
build compiles from native/spanlet_marker.c (another build of it can be named
by path: the argument, or $SPANLET_MARKER_LIB). If it cannot be used (missing,
not an extension of this interpreter, no ``mark``, or another ABI version), one
warning is logged per process on logger ``spanlet.client`` and the processor
does nothing. Nothing in here ever raises into the application. This module
imports nothing of the agent daemon: only the standard library and the
OpenTelemetry SDK.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import os
import threading

from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

logger = logging.getLogger("spanlet.client")

MODALITY_ATTRIBUTE = "mm.modality"
LIB_ENV = "SPANLET_MARKER_LIB"
# The extension's module name; a build loaded from a path is loaded under it too
# (its init function is PyInit_libspanlet_marker).
MARKER_MODULE = "spanlet.libspanlet_marker"
ABI_VERSION = 2
# name -> number; spanlet.modality is stdlib only, so no agent part comes with it
from spanlet.modality import NUMBERS as MODALITIES  # noqa: E402
# Spans started and never ended would otherwise grow a thread's stack forever;
# past this depth the oldest are forgotten.
MAX_STACK_DEPTH = 256

_CLEAR = (0, 0, 0)  # mark()'s arguments for "in no span"

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


class _Stacks(threading.local):
    def __init__(self) -> None:
        self.stack: list[tuple[int, ...]] = []


class SpanletSpanProcessor(SpanProcessor):
    """Marks each thread's current span for the spanlet agent; see the module doc."""

    def __init__(self, lib_path: str | os.PathLike | None = None) -> None:
        self._mark = load_marker(lib_path)
        self._local = _Stacks()
        # span_id -> (stack of the thread that started it, its entry there), so
        # that an end on any thread finds it.
        self._open: dict[int, tuple[list, tuple[int, ...]]] = {}

    @property
    def active(self) -> bool:
        """Whether the marker is in use (False: the processor is a no-op)."""
        return self._mark is not None

    def on_start(self, span: Span, parent_context=None) -> None:
        mark = self._mark
        if mark is None:
            return
        try:
            ctx = span.get_span_context()
            s = ctx.span_id
            try:  # the SDK span's own dict: 0.1 µs where the public mapping costs 1 µs
                modality = span._attributes._dict.get(MODALITY_ATTRIBUTE)
            except AttributeError:  # another SDK version or span class
                modality = _modality_attribute(span)
            entry = (ctx.trace_id, s, MODALITIES.get(modality, 0))  # mark()'s arguments
            stack = self._local.stack
            stack.append(entry)
            self._open[s] = (stack, entry)
            if len(stack) > MAX_STACK_DEPTH:
                self._forget_oldest(stack)
            mark(*entry)
        except Exception:
            _warn_once("spanlet span processor failed in on_start; continuing", exc_info=True)

    def on_end(self, span: ReadableSpan) -> None:
        mark = self._mark
        if mark is None:
            return
        try:
            started = self._open.pop(span.context.span_id, None)
            if started is not None:
                stack, entry = started
                # Only the owning thread appends to or pops the top of its stack,
                # and list.remove is atomic, so another thread's removal is safe.
                if stack and stack[-1] is entry:
                    stack.pop()
                else:  # ended out of order, or by another thread
                    try:
                        stack.remove(entry)  # an equal entry is the same span: either will do
                    except ValueError:
                        pass  # already forgotten by _forget_oldest
            stack = self._local.stack
            mark(*(stack[-1] if stack else _CLEAR))
        except Exception:
            _warn_once("spanlet span processor failed in on_end; continuing", exc_info=True)

    def _forget_oldest(self, stack: list) -> None:
        oldest = stack.pop(0)
        span_id = oldest[1]
        if self._open.get(span_id, (None, None))[1] is oldest:
            del self._open[span_id]

    def shutdown(self) -> None:
        """Clears the calling thread's context and stops marking (safe twice)."""
        mark, self._mark = self._mark, None
        if mark is not None:
            try:
                mark(*_CLEAR)
            except Exception:
                pass
        self._open.clear()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing is buffered: every mark is made at once."""
        return True

