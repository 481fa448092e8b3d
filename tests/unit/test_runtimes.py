"""What a process's requests run on that spanlet follows per thread only
(spanlet/runtimes.py): each runtime found from the modules a process has
loaded and its running loop, and the agent's count of such processes by
reason (spanlet_client_thread_only_processes)."""

from __future__ import annotations

import asyncio
import types

from spanlet import runtimes
from spanlet.metrics import kernel as kernel_metrics


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def test_each_runtime_is_found_only_when_it_is_in_use():
    gevent_patched = {"gevent.monkey": _module("gevent.monkey", is_anything_patched=lambda: True)}
    gevent_idle = {"gevent.monkey": _module("gevent.monkey", is_anything_patched=lambda: False)}
    eventlet = {"eventlet.patcher": _module("eventlet.patcher", is_monkey_patched=lambda m: m == "thread")}
    trio_running = {"trio": _module("trio", lowlevel=types.SimpleNamespace(current_task=lambda: object()))}

    def outside_a_run():
        raise RuntimeError("must be called from async context")
    trio_idle = {"trio": _module("trio", lowlevel=types.SimpleNamespace(current_task=outside_a_run))}
    F = runtimes.NotFollowed
    assert runtimes.detect({}) == 0
    assert runtimes.detect(gevent_patched) == F.gevent
    assert runtimes.detect(gevent_idle) == 0
    assert runtimes.detect(eventlet) == F.eventlet
    assert runtimes.detect(trio_running) == F.trio
    assert runtimes.detect(trio_idle) == 0
    assert runtimes.detect({**gevent_patched, **trio_running}) == F.gevent | F.trio
    loop = asyncio.new_event_loop()
    try:
        assert runtimes.detect({}, loop, loop_followed=True) == 0
        assert runtimes.detect({}, loop, loop_followed=False) == F.loop
    finally:
        loop.close()
    assert runtimes.names(F.trio | F.loop) == ["trio", "loop"]


def test_the_agent_counts_processes_by_each_reason_their_marks_carry():
    span_ctx = types.SimpleNamespace(thread_only_processes=lambda: {10: 2, 11: 3, 12: 8})
    fam = kernel_metrics.spanlet_client_thread_only_processes(span_ctx)
    assert fam.name == "spanlet_client_thread_only_processes"
    assert {dict(s.labels)["runtime"]: s.value for s in fam.samples} == {
        "trio": 1, "gevent": 2, "eventlet": 0, "loop": 1}
