"""Client side of span context: an OpenTelemetry SpanProcessor that tells the
spanlet agent, through a native marker the agent uprobes, which span each thread is in.

Usage, in any OTel-instrumented Python process (no privileges needed)::

    from opentelemetry.sdk.trace import TracerProvider
    from spanlet.client import SpanletSpanProcessor

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

If the marker library cannot be used (missing, wrong architecture, symbols or
ABI version), one warning is logged per process on logger ``spanlet.client``
and the processor does nothing. Nothing in here ever raises into the
application. This module imports nothing of the agent daemon: only the
standard library and the OpenTelemetry SDK.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

logger = logging.getLogger("spanlet.client")

MODALITY_ATTRIBUTE = "mm.modality"
LIB_ENV = "SPANLET_MARKER_LIB"
DEFAULT_LIB = Path(__file__).resolve().parent / "_native" / "libspanlet_marker.so"
ABI_VERSION = 1
# name -> number; spanlet.modality is stdlib only, so no agent part comes with it
from spanlet.modality import NUMBERS as MODALITIES  # noqa: E402
# Spans started and never ended would otherwise grow a thread's stack forever;
# past this depth the oldest are forgotten.
MAX_STACK_DEPTH = 256

_M32 = 0xFFFFFFFF
_CLEAR = (0, 0, 0, 0, 0, 0, 0)

_warn_lock = threading.Lock()
_warned = False
_libs_lock = threading.Lock()
_libs: dict[str, object] = {}  # path -> its spanlet_mark_halves, or None


def _warn_once(message: str, *args, exc_info: bool = False) -> None:
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    logger.warning(message, *args, exc_info=exc_info)


def library_path(lib_path: str | os.PathLike | None = None) -> str:
    """The marker library to load: the argument, else $SPANLET_MARKER_LIB, else
    agent/_native/libspanlet_marker.so next to this module."""
    return os.fspath(lib_path or os.environ.get(LIB_ENV) or DEFAULT_LIB)


def load_marker(lib_path: str | os.PathLike | None = None):
    """The library's spanlet_mark_halves, ready to call, or None (after one
    warning per process) when the library cannot be used."""
    path = library_path(lib_path)
    with _libs_lock:
        if path in _libs:
            return _libs[path]
        try:
            mark = _open(path)
        except Exception as e:  # OSError, AttributeError, ABI mismatch: all mean "cannot use it"
            _warn_once("spanlet marker library unusable, spans will not reach the spanlet agent: %s: %s",
                       path, e)
            mark = None
        _libs[path] = mark
        return mark


def _open(path: str):
    # PyDLL: the call keeps the GIL (the marker is a few instructions; a GIL
    # release and re-take would cost more than the call itself).
    lib = ctypes.PyDLL(path)
    version = lib.spanlet_marker_abi_version
    version.argtypes, version.restype = [], ctypes.c_uint32
    if version() != ABI_VERSION:
        raise ValueError(f"marker ABI version {version()}, this client speaks {ABI_VERSION}")
    # spanlet_mark is what the agent probes; the client calls it through spanlet_mark_halves.
    for symbol in ("spanlet_mark", "spanlet_mark_halves"):
        if not hasattr(lib, symbol):
            raise AttributeError(f"no {symbol} in the library")
    mark = lib.spanlet_mark_halves
    # No argtypes on purpose: with them ctypes builds a temporary object per
    # argument (about 1 µs a call); without, a Python int < 2**32 goes straight
    # into its register. Every argument passed is masked to 32 bits below.
    mark.argtypes, mark.restype = None, None
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
        """Whether the marker library is in use (False: the processor is a no-op)."""
        return self._mark is not None

    def on_start(self, span: Span, parent_context=None) -> None:
        mark = self._mark
        if mark is None:
            return
        try:
            ctx = span.get_span_context()
            t, s = ctx.trace_id, ctx.span_id
            try:  # the SDK span's own dict: 0.1 µs where the public mapping costs 1 µs
                modality = span._attributes._dict.get(MODALITY_ATTRIBUTE)
            except AttributeError:  # another SDK version or span class
                modality = _modality_attribute(span)
            # The marker's arguments: the ids in 32-bit halves, then the modality.
            entry = (t >> 96, (t >> 64) & _M32, (t >> 32) & _M32, t & _M32, s >> 32, s & _M32,
                     MODALITIES.get(modality, 0))
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
        span_id = oldest[4] << 32 | oldest[5]
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

