"""What a serving process's requests may run on that spanlet cannot follow per
coroutine: the one definition of the follow flags (stdlib only, so the client
imports it without the agent). The client finds them once, at its first span
starts, and sets them in its marker; every mark then carries them in the high
16 bits of its modality argument, where the agent's uprobe keeps them per
process (bpf/span_ctx.bpf.c, span_ctx_thread_only)."""

from __future__ import annotations

import enum


class NotFollowed(enum.IntFlag):
    """Why a process's spans are followed per thread only."""
    trio = 1            # trio tasks: no asyncio Task, no contextvars switch spanlet sees
    gevent = 2          # gevent's greenlets: many requests on one OS thread
    eventlet = 4        # eventlet's green threads: the same
    loop = 8            # an event loop whose tasks spanlet could not follow (no task factory)


def names(flags: int) -> list[str]:
    """The names of the flags set, in bit order."""
    return [f.name for f in NotFollowed if flags & f]


def detect(modules: dict, loop=None, loop_followed: bool = True) -> int:
    """The flags that hold now: `modules` is sys.modules, `loop` the running
    event loop of the calling thread (None: none), `loop_followed` whether
    its tasks are followed."""
    flags = 0
    monkey = modules.get("gevent.monkey")
    if monkey is not None and _true(getattr(monkey, "is_anything_patched", None)):
        flags |= NotFollowed.gevent
    patcher = modules.get("eventlet.patcher")
    if patcher is not None and _true(getattr(patcher, "is_monkey_patched", None), "thread"):
        flags |= NotFollowed.eventlet
    trio = modules.get("trio")
    if trio is not None and _true(getattr(getattr(trio, "lowlevel", None), "current_task", None)):
        flags |= NotFollowed.trio
    if loop is not None and not loop_followed:
        flags |= NotFollowed.loop
    return int(flags)


def _true(fn, *args) -> bool:
    """fn(*args) is truthy; False where it is missing or raises (trio's
    current_task() outside a trio run)."""
    if fn is None:
        return False
    try:
        return bool(fn(*args))
    except Exception:
        return False
