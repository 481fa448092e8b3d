"""The probes' start at agent start-up (probes/starter.py): the span-context
owner started whole in the compile thread, the others compiled there in
order and attached by whoever takes them, a failing one reported while the
others start. The probes here stand in for the real ones (no compile): what
is tested is the order, the threads and the reporting."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from spanlet.probes import compile_cache, span_ctx, starter
from spanlet.probes.base import Probe, ProbeError

MAIN = threading.main_thread()


class Fake(Probe):
    fail_compile: Exception | None = None
    seen: list = []

    def source_text(self):
        return f"// {self.name}"

    def compile(self, pin_dir=None):
        self.seen.append((self.name, "compile", threading.current_thread() is MAIN, pin_dir))
        if self.fail_compile is not None:
            raise self.fail_compile

    def _attach(self):
        self.seen.append((self.name, "attach", threading.current_thread() is MAIN, None))

    def stop(self):
        self.seen.append((self.name, "stop", None, None))
        self.status.attached = False


class Owner(Fake):
    name = "span_ctx"
    maps_watch = None
    pin_dir = Path("/pins")

    def shared_pin_dir(self):
        return "/pins" if self.status.attached else None


def _fake(name, fail=None):
    return type(name, (Fake,), {"name": name, "fail_compile": fail})


class Aside:
    """compile_cache's cache as the starter uses it: what was given to compile_aside."""

    def __init__(self):
        self.given, self.abandoned = [], 0
        self.running: set[str] = set()     # the texts whose process has not ended

    def compile_aside(self, jobs, pin_root):
        self.given.append((jobs, pin_root))
        return len(jobs)

    def aside_running(self, text, flags, templates):
        return text in self.running

    def abandon_aside(self):
        self.abandoned += 1


@pytest.fixture
def fakes(monkeypatch):
    Fake.seen = []
    monkeypatch.setattr(span_ctx, "SpanCtxProbe", Owner)
    monkeypatch.setattr(compile_cache, "cache_of", lambda cfg, _aside=Aside(): _aside)
    # a finished start opens the ring buffer of the "events" map: none here
    monkeypatch.setattr(Probe, "finish_start", _attach_only)
    return monkeypatch


def _attach_only(self):
    try:
        self._attach()
        self.status.attached = True
    except ProbeError as e:
        self._start_failed(e)
    return self.status


def test_owner_in_the_thread_then_each_compiled_in_order_and_attached_by_the_taker(fakes, cfg):
    fakes.setattr(starter, "probe_classes", lambda c: [Owner, _fake("a"), _fake("b")])
    s = starter.ProbeStarter(cfg)
    s.begin()
    probes = s.finish(sink=print)
    assert [p.name for p in probes] == ["span_ctx", "a", "b"]
    assert all(p.status.attached and p.sink is print for p in probes)
    steps = [(n, step, main) for n, step, main, _ in Fake.seen]
    assert steps[:2] == [("span_ctx", "compile", False), ("span_ctx", "attach", False)]
    assert ("a", "compile", False) in steps and ("a", "attach", True) in steps
    assert steps.index(("a", "compile", False)) < steps.index(("b", "compile", False))
    # the others share the owner's pinned maps
    assert [pin for n, step, _, pin in Fake.seen if step == "compile" and n != "span_ctx"] == \
        ["/pins", "/pins"]


def test_the_others_compiles_begin_aside_with_the_owners_pin_folder_before_it_compiles(fakes, cfg):
    fakes.setattr(starter, "probe_classes", lambda c: [Owner, _fake("a"), _fake("b")])
    aside = compile_cache.cache_of(cfg)
    s = starter.ProbeStarter(cfg)
    s.finish()
    ((jobs, pin_root),) = aside.given
    assert pin_root == Path("/")
    assert [(text, templates) for text, _, templates in jobs] == [("// a", {"/pins": "{pin_dir}"}),
                                                                  ("// b", {"/pins": "{pin_dir}"})]
    for (_, flags, _), probe in zip(jobs, s.probes[1:]):
        assert flags == probe.compile_flags("/pins")
    assert aside.abandoned == 1           # what nobody waited for is ended
    assert s.compiles_done.is_set()       # what waits for the compiles to end (the store's start) goes on
    # begun before the owner's compile, so that they run beside it
    assert Fake.seen[0][:2] == ("span_ctx", "compile")


def test_each_is_loaded_once_its_process_has_ended_whatever_the_start_order(fakes, cfg):
    # "a" compiles longer in its process than "b": "b" is loaded and attached first
    aside = compile_cache.cache_of(cfg)
    aside.running.add("// a")

    class B(_fake("b")):
        def compile(self, pin_dir=None):
            super().compile(pin_dir)
            aside.running.discard("// a")          # "a"'s process ends after "b"'s
    fakes.setattr(starter, "probe_classes", lambda c: [Owner, _fake("a"), B])
    s = starter.ProbeStarter(cfg)
    probes = s.finish()
    assert [p.name for p in probes] == ["span_ctx", "b", "a"]
    assert [n for n, step, _, _ in Fake.seen if step == "compile"] == ["span_ctx", "b", "a"]
    assert [p.name for p in s.probes] == ["span_ctx", "a", "b"]    # the start order, for the stop
    assert all(p.status.attached for p in probes)


def test_the_aside_compiles_are_begun_before_the_owners_compile_ends(fakes, cfg):
    # the agent waits for aside_begun before its own imports: it is set once
    # the processes are begun, while the owner still compiles
    release = threading.Event()
    seen_while_compiling = []

    class SlowOwner(Owner):
        def compile(self, pin_dir=None):
            seen_while_compiling.append(s.aside_begun.is_set())
            release.wait(10)

    fakes.setattr(span_ctx, "SpanCtxProbe", SlowOwner)
    fakes.setattr(starter, "probe_classes", lambda c: [SlowOwner, _fake("a")])
    s = starter.ProbeStarter(cfg)
    assert not s.aside_begun.is_set()
    s.begin()
    assert s.aside_begun.wait(10) and not s.compiles_done.is_set()
    release.set()
    s.finish()
    assert seen_while_compiling == [True]
    assert len(compile_cache.cache_of(cfg).given) == 1


def test_without_the_compile_cache_nothing_is_compiled_aside(fakes, cfg):
    from spanlet import config

    fakes.setattr(starter, "probe_classes", lambda c: [Owner, _fake("a")])
    cfg = config.load(env={}, overrides=["compile_cache=false"])
    starter.ProbeStarter(cfg).finish()
    assert compile_cache.cache_of(cfg).given == []


@pytest.mark.parametrize("error", [ProbeError("refused"), RuntimeError("a bug")])
def test_a_probe_that_fails_is_reported_and_the_next_still_starts(fakes, cfg, error):
    fakes.setattr(starter, "probe_classes", lambda c: [Owner, _fake("bad", error), _fake("good")])
    s = starter.ProbeStarter(cfg)
    probes = s.finish()
    bad, good = probes[1], probes[2]
    assert not bad.status.attached and str(error) in bad.status.reason
    assert good.status.attached
    assert [st.name for st in s.statuses()] == ["span_ctx", "bad", "good"]


def test_a_probe_that_cannot_be_made_is_raised_and_abandon_stops_the_rest(fakes, cfg):
    def broken(*a, **kw):
        raise RuntimeError("no such probe")
    fakes.setattr(starter, "probe_classes", lambda c: [Owner, broken])
    s = starter.ProbeStarter(cfg)
    s.begin()
    assert s.aside_begun.wait(10)         # the agent, waiting for it, goes on
    with pytest.raises(RuntimeError, match="no such probe"):
        s.finish()
    assert not s.probes[0].status.attached       # the others are made before the owner starts
    s.abandon()
    assert ("span_ctx", "stop", None, None) in Fake.seen
