"""Batched steps end to end (issue 15): a front-end process makes the request
(SERVER) spans, an engine process makes step spans linked to them (known
compositions and weights, known launches per step through the stand-in
libcuda), both export over OTLP to one agent; every request span must arrive
with exactly its steps and its shares, whichever side arrives first, while a
third process makes unrelated spans."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

import cuda_standin
from facts_agent import LATE_SPAN_NAME, running_agent
from facts_child import FactsChild
from otlp_upstream import wait_for
from spanlet import inspect

pytestmark = pytest.mark.kernel

CHILD = Path(__file__).resolve().parents[1] / "support" / "batch_child.py"
RUNS = 5
WAIT_S = 3.0            # join.batch_wait_s: the engine's steps come well within it
REQUESTS = 8
STEPS = 6
SHARES = ("kernel.batch.gpu.launches", "kernel.batch.gpu.graph_launches", "kernel.batch.gpu.graph_kernels",
          "kernel.batch.gpu.sync_wait_ns")


@pytest.fixture(scope="module")
def agent(standin):
    with running_agent(standin.lib_dir / cuda_standin.DRIVER, f"join.batch_wait_s={WAIT_S}") as a:
        yield a
    assert not a.pins_left, "the agent's stop left its pinned maps behind"


def child(agent, role: str) -> FactsChild:
    return FactsChild(agent.endpoint, agent.libcuda, role, script=CHILD)


def attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = v.double_value if v.HasField("double_value") else v.int_value
    return out


def composition(rng: random.Random, n_requests: int) -> list[tuple[int, list[tuple[int, object]]]]:
    """STEPS steps: (launches, [(request index, weight or None)]), every step different."""
    steps = []
    for k in range(STEPS):
        members = rng.sample(range(n_requests - 1), rng.randint(1, n_requests - 1))  # the last: in no step
        steps.append((3 + 2 * k + rng.randint(0, 5),
                      [(i, rng.choice([None, 1, 2, 0.5, 7.25])) for i in members]))
    return steps


def expected_shares(steps, step_launches: list[int]) -> dict[int, tuple[int, float]]:
    out: dict[int, list] = {}
    for (_, members), launches in zip(steps, step_launches):
        total = sum(1.0 if w is None else w for _, w in members)
        for i, w in members:
            acc = out.setdefault(i, [0, 0.0])
            acc[0] += 1
            acc[1] += launches * (1.0 if w is None else w) / total
    return {i: (n, v) for i, (n, v) in out.items()}


def run_engine(engine: FactsChild, steps, tps: list[str], before_flush=None) -> list[tuple[str, str]]:
    ids = []
    for launches, members in steps:
        links = " ".join(f"{tps[i]}:{'-' if w is None else w}" for i, w in members)
        (line,) = engine.command(f"step {launches} 150 {links}")
        assert line[0] == "step" and int(line[3]) == launches
        ids.append((line[1], line[2]))
    if before_flush is not None:
        before_flush()
    engine.command("flush", "flushed")
    return ids


def upstream_spans(agent, keys) -> dict:
    up = agent.upstream
    wait_for(lambda: all(k in up.by_ids for k in keys), 30, "the spans upstream")
    with up.lock:
        return {k: list(up.by_ids[k]) for k in keys}


def late_of(agent, keys) -> list:
    with agent.upstream.lock:
        return [s for (t, _), spans in agent.upstream.by_ids.items() for s in spans
                if s.name == LATE_SPAN_NAME and (t, s.parent_span_id.hex()) in keys]


class Unrelated:
    """A third process making spans with launches of their own, the whole time
    but while paused: the admin ring keeps only the newest spans, so the ring
    check pauses it before the request spans come out."""

    def __init__(self, agent):
        self.agent = agent
        self.child = FactsChild(agent.endpoint, agent.libcuda, "batch")
        self.stop, self.error = threading.Event(), None
        self._pause, self._paused, self._resume = threading.Event(), threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:
            while not self.stop.is_set():
                if self._pause.is_set():
                    self.child.command("flush", "flushed")
                    self._paused.set()
                    self._resume.wait()
                    continue
                self.child.command("threads 2 3")
            self.child.command("flush", "flushed")
        except Exception as e:       # said by close()
            self.error = e
            self._paused.set()

    def pause(self) -> None:
        """Between two commands; returns once all its spans so far are upstream."""
        self._resume.clear()
        self._pause.set()
        assert self._paused.wait(60) and self.error is None, self.error
        upstream_spans(self.agent, dict(self.child.expected))

    def resume(self) -> None:
        self._pause.clear()
        self._paused.clear()
        self._resume.set()

    def close(self) -> dict:
        self.stop.set()
        self.resume()
        self.thread.join(60)
        self.child.close()
        assert self.error is None, self.error
        return self.child.expected


@pytest.fixture
def unrelated(agent):
    u = Unrelated(agent)
    try:
        yield u
    finally:
        if not u.stop.is_set():
            u.close()


def check(agent, steps, req_ids, step_ids):
    """Each request span once, with exactly its steps and shares; each step with its
    own launches; the shares of each step add up to it; no late record."""
    step_spans = upstream_spans(agent, step_ids)
    step_facts = []
    for k in step_ids:
        (s,) = step_spans[k]
        a = attrs(s)
        step_facts.append(a)
        assert len(s.links) == len(steps[len(step_facts) - 1][1])
    launches = [a.get("kernel.gpu.launches", 0) for a in step_facts]
    assert launches == [n for n, _ in steps], (
        f"a step span lacks its own launches: {launches}; the agent's join {agent.daemon.spans.join.stats}")
    want = expected_shares(steps, launches)
    req_spans = upstream_spans(agent, req_ids)
    got, sync_total = {}, 0.0
    for i, k in enumerate(req_ids):
        (s,) = req_spans[k]
        a = attrs(s)
        got[i] = (a.get("kernel.batch.steps", 0), a.get("kernel.batch.gpu.launches", 0.0))
        sync_total += a.get("kernel.batch.gpu.sync_wait_ns", 0.0)
        if i not in want:
            assert not any(key.startswith("kernel.batch.") for key in a), a
    for i, (n, v) in want.items():
        assert got[i][0] == n and got[i][1] == pytest.approx(v, rel=0, abs=1e-6), (i, got[i], (n, v))
    step_sync = sum(a.get("kernel.gpu.sync_wait_ns", 0) for a in step_facts)
    assert step_sync > 0 and sync_total == pytest.approx(step_sync, rel=1e-9)
    assert not late_of(agent, set(req_ids))
    # `spanlet inspect spans` (the admin socket's ring of recent spans; the
    # requests came last) shows each request's steps and shares
    ring = {(r["trace_id"], r["span_id"]): r for r in
            inspect.ask(str(agent.daemon.cfg.admin_socket), "spans", {"limit": 10_000})["data"]["spans"]}
    for i, (n, v) in want.items():
        row = ring[req_ids[i]]
        assert row["batch_steps"] == n and row["batch_gpu_launches"] == pytest.approx(v, abs=1e-6)


@pytest.mark.parametrize("run", range(RUNS))
@pytest.mark.parametrize("order", ["front_first", "engine_first"])
def test_every_request_gets_exactly_its_steps_and_shares(agent, unrelated, order, run):
    rng = random.Random(f"{order}-{run}")
    steps = composition(rng, REQUESTS)
    with child(agent, "front") as front, child(agent, "engine") as engine:
        if run == 0:     # the agent learns that this node batches (a step first)
            run_engine(engine, [(1, [(0, None)])], ["00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"])
        req = [l for l in front.command(f"open {REQUESTS}")]
        req_ids = [(l[1], l[2]) for l in req]
        tps = [l[3] for l in req]
        # the unrelated process launches during every step, and pauses before the
        # request spans come out (the steps' flush, or the front's), until the
        # ring of recent spans was read
        if order == "front_first":
            front.command("close")
            front.command("flush", "flushed")
            def pause():           # the requests wait WAIT_S for their steps: still held
                unrelated.pause()
                assert agent.daemon.spans.held_requests(), "the requests came out before the pause"
            step_ids = run_engine(engine, steps, tps, before_flush=pause)
        else:
            step_ids = run_engine(engine, steps, tps)
            upstream_spans(agent, step_ids)       # the steps went through the agent first
            unrelated.pause()
            front.command("close")
            front.command("flush", "flushed")
        check(agent, steps, req_ids, step_ids)
        unrelated.resume()
    # the unrelated process's spans: each exactly its own launches, no batch attributes
    expected = unrelated.close()
    assert expected
    got = upstream_spans(agent, expected)
    wrong = {k: [attrs(s) for s in v] for k, v in got.items()
             if [attrs(s).get("kernel.gpu.launches", 0) for s in v] != [expected[k]]
             or any(key.startswith("kernel.batch.") for s in v for key in attrs(s))}
    assert not wrong, wrong


@pytest.mark.parametrize("run", range(3))
def test_steps_after_the_wait_go_out_as_late_records_of_the_request(agent, run):
    """The front end's spans leave after join.batch_wait_s with no shares; the
    steps that come after go out as late records of each request's trace,
    carrying exactly its shares, and are counted."""
    cfg = agent.daemon.spans.cfg.join
    wait = cfg.batch_wait_s
    late_metric = lambda: agent.metric(  # noqa: E731
        lambda name, _: name == "spanlet_join_batch_late_shares_total") or 0
    before = late_metric()
    rng = random.Random(f"late-{run}")
    steps = composition(rng, 4)
    cfg.batch_wait_s = 0.3
    try:
        with child(agent, "front") as front, child(agent, "engine") as engine:
            run_engine(engine, [(1, [(0, None)])], ["00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"])
            req = front.command("open 4")
            req_ids, tps = [(l[1], l[2]) for l in req], [l[3] for l in req]
            front.command("close")
            front.command("flush", "flushed")
            spans = upstream_spans(agent, req_ids)     # went out, without shares
            assert all(not any(k.startswith("kernel.batch.") for k in attrs(s))
                       for v in spans.values() for s in v)
            step_ids = run_engine(engine, steps, tps)
    finally:
        cfg.batch_wait_s = wait
    step_spans = upstream_spans(agent, step_ids)
    launches = [attrs(v[0]).get("kernel.gpu.launches", 0) for v in (step_spans[k] for k in step_ids)]
    assert launches == [n for n, _ in steps]
    want = expected_shares(steps, launches)
    agent.settle()
    keys = set(req_ids)
    wait_for(lambda: len(late_of(agent, keys)) >= len(want), 10, "the late records")
    late = late_of(agent, keys)
    by_req = {}
    for s in late:
        a = attrs(s)
        acc = by_req.setdefault(s.parent_span_id.hex(), [0, 0.0])
        acc[0] += a.get("kernel.batch.steps", 0)
        acc[1] += a.get("kernel.batch.gpu.launches", 0.0)
    for i, (n, v) in want.items():
        got = by_req.get(req_ids[i][1])
        assert got is not None and got[0] == n and got[1] == pytest.approx(v, abs=1e-6), (i, got, n, v)
    assert set(by_req) == {req_ids[i][1] for i in want}
    assert late_metric() - before >= len(want)
