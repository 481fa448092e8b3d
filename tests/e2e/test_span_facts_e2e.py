"""Exact per-span kernel facts (issue 13): real OTel SDK children launch known
numbers of stand-in kernels in each span and export their spans to one agent;
every span must arrive upstream with exactly its own kernel.gpu.launches."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import cuda_standin
from facts_agent import Agent, running_agent
from gpu_harness import cgroup_id
from otlp_upstream import wait_for
from spanlet.metrics.catalogue import BY_NAME

pytestmark = pytest.mark.kernel

RUNS = 20
SPAN_FACTS_MAX = 4096   # the agent's span facts map, small enough to flood in a second
# case → (the child's span processor, its commands); each span of a case makes a known,
# different number of launches (see span_facts_child.py)
CASES = {
    "4x5-batch": ("batch", ["threads 4 5"]),
    "4x5-simple": ("simple", ["threads 4 5"]),
    "8x5-batch": ("batch", ["threads 8 5"]),
    "asyncio-4-coroutines": ("batch", ["asyncio 4 6"]),
    "asyncio.to_thread": ("batch", ["to_thread 5"]),
    "executor-copy_context": ("batch", ["executor 5"]),
    "context.attach-thread": ("batch", ["attach 5"]),
}
SPANS_PER_CASE = {"4x5-batch": 20, "4x5-simple": 20, "8x5-batch": 40, "asyncio-4-coroutines": 4,
                  "asyncio.to_thread": 5, "executor-copy_context": 5, "context.attach-thread": 5}


def assert_exact(agent: Agent, expected: dict) -> None:
    """Each span arrived once, with exactly its launches; no late record for any of them
    (after a settle); none of their rows left in the map."""
    got = agent.arrived(expected)
    wrong = {k: (expected[k], v) for k, v in got.items() if v != [expected[k]]}
    try:
        agent.settle()
        settle_error = None
    except Exception as e:   # the agent's own sweep failing: said after the counts
        settle_error = e
    late = agent.late_records(expected)
    late_launches = sum(a.get("kernel.gpu.launches", 0) for _, a in late)
    assert not wrong and not late, (
        f"{len(expected) - len(wrong)} of {len(expected)} spans exact; (expected, got on the span) "
        f"of the others: {sorted(wrong.values())}; {len(late)} late records of these spans "
        f"({late_launches} launches)")
    if settle_error is not None:
        raise AssertionError(f"the spans were exact, then the agent's sweep failed: {settle_error!r}") \
            from settle_error
    left = {(r.trace_id.hex(), f"{r.span_id:016x}") for r in agent.facts.rows()} & expected.keys()
    assert not left, f"{len(left)} rows of spans already joined are still in span_facts"


@pytest.fixture(scope="module")
def agent(standin):
    # the flood below is one pod's: its own bound (join.span_facts_max_per_cgroup) set
    # past what it marks, so that the map's total bound and the LRU are what it meets
    with running_agent(standin.lib_dir / cuda_standin.DRIVER, f"join.span_facts_max={SPAN_FACTS_MAX}",
                       f"join.span_facts_max_per_cgroup={8 * SPAN_FACTS_MAX}") as a:
        yield a
    assert not a.pins_left, "the agent's stop left its pinned maps behind"


class Flood:
    """A stand-in CUDA process launching back to back, outside any span, until closed."""

    def __init__(self, standin: cuda_standin.StandIn):
        self.w = cuda_standin.Workload(standin.workload)
        self.w.load(standin.lib_dir)
        self.stop, self.launched = threading.Event(), 0
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            (line,) = self.w.run("paced 100000 50000")    # 2 s at 50,000/s
            self.launched += int(line.split()[1])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        self.w.close()


@pytest.fixture(scope="module", params=["quiet", "flood"])
def background(request, agent, standin):
    """Nothing else launching, or another process flooding launches outside spans."""
    if request.param == "quiet":
        yield None
        return
    flood = Flood(standin)
    try:
        wait_for(lambda: flood.launched > 0, 30, "the flood to run")
        yield flood
    finally:
        flood.close()


@pytest.mark.parametrize("run", range(RUNS))
@pytest.mark.parametrize("case", CASES)
def test_every_span_gets_exactly_its_own_launches(agent, background, case, run):
    processor, commands = CASES[case]
    with agent.child(processor) as child:
        for cmd in commands:
            child.command(cmd)
        child.command("flush", "flushed")
    assert len(child.expected) == SPANS_PER_CASE[case]
    assert len(set(child.expected.values())) > 1      # counts differ from span to span
    assert_exact(agent, child.expected)


@pytest.mark.parametrize("run", range(5))
@pytest.mark.parametrize("case", CASES)
def test_the_kernel_rows_are_exact_before_any_span_is_exported(agent, case, run):
    """The same cases with no exporter: the span_facts rows themselves (the client's
    marks and the kernel's counting, without the join) hold each span's launches."""
    _, commands = CASES[case]
    with agent.child("none") as child:
        for cmd in commands:
            child.command(cmd)
    got = {}
    for trace, span in child.expected:          # read and deleted, as the join does
        row = agent.facts.take(bytes.fromhex(trace), int(span, 16))
        got[(trace, span)] = row.launches if row else 0
    assert got == child.expected, sorted((child.expected[k], v) for k, v in got.items())


def test_a_row_whose_span_never_comes_is_deleted_unread_and_counted(agent):
    """What the sweep does with an expired row: delete it, count it as swept."""
    with agent.child("none") as child:
        child.command("threads 1 1")
        cgroup = cgroup_id(child.pid)                  # the row is the child's cgroup's
    ((trace, span),) = child.expected
    key = (bytes.fromhex(trace), int(span, 16))
    swept = agent.facts.stats().swept
    try:
        assert not agent.facts.delete(*key, cgroup + 1)   # another cgroup's: none
        assert agent.facts.delete(*key, cgroup)
        assert agent.facts.stats().swept == swept + 1
        assert agent.facts.take(*key) is None
    finally:
        agent.facts.take(*key)     # no row of this test left to expire under the next ones


# ---- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("run", range(RUNS))
def test_a_span_id_reused_in_another_trace_gets_only_its_own_launches(agent, run):
    """Pairs of spans with one span id in two traces, both open at once."""
    with agent.child() as child:
        child.command("reused 3")
        child.command("flush", "flushed")
    assert len(child.expected) == 6 and len({s for _, s in child.expected}) == 3
    assert_exact(agent, child.expected)


@pytest.mark.parametrize("run", range(RUNS))
def test_a_thread_that_exits_inside_a_span_lends_nothing_to_others(agent, run):
    """The span keeps what its thread launched before exiting; launches of the
    threads after it (outside any span) go to no span."""
    with agent.child() as child:
        child.command("thread_exit 7")
        child.command("outside 9")
        child.command("threads 2 2")
        child.command("flush", "flushed")
    assert sorted(child.expected.values()) == [1, 2, 3, 4, 7]
    assert_exact(agent, child.expected)


@pytest.mark.parametrize("processor", ["batch", "simple"])
@pytest.mark.parametrize("run", range(RUNS))
def test_a_process_that_exits_right_after_its_last_span(agent, processor, run):
    """The spans reach the agent after their process is gone (exported at shutdown)."""
    child = agent.child(processor)
    try:
        child.command("threads 2 3")
        assert child.exit() == 0
    finally:
        child.close()
    assert_exact(agent, child.expected)


def rss_kb() -> int:
    """This process's resident set (the agent runs in it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


EVICTED = BY_NAME["spanlet_span_facts_evicted_total"].name    # the catalogue's own entry


def evictions_counted(agent: Agent) -> float:
    """The agent's self-metric of span facts rows lost to the LRU bound, by its
    catalogue name: exactly one sample of it."""
    samples = [s for fam in agent.daemon.registry.collect() for s in fam.samples if s.name == EVICTED]
    assert len(samples) == 1, samples
    return samples[0].value


def test_a_flood_of_marks_for_spans_that_never_arrive_stays_bounded(agent):
    """Spans that each launch once and are never exported, 3 x 2 x the map's bound:
    the map holds at most its bound, every row made is either still there or
    counted lost (pushed out, exactly as many as the metric says, or expired),
    the agent's memory does not follow the flood, and the next spans are still
    exact."""
    facts = agent.facts
    present0 = len(facts.rows())               # reading the map refreshes the counts
    before = facts.stats()
    metric0 = evictions_counted(agent)
    rss = []
    try:
        with agent.child("none") as child:
            for _ in range(3):
                child.command(f"marks {2 * SPAN_FACTS_MAX}")
                rows = facts.rows()
                rss.append(rss_kb())
                assert len(rows) <= SPAN_FACTS_MAX
        present1 = len(facts.rows())
        after = facts.stats()
        evicted = evictions_counted(agent) - metric0
    finally:
        for r in facts.rows():     # no row of the flood left to expire under the next tests
            facts.take(r.trace_id, r.span_id)
    flooded = 3 * 2 * SPAN_FACTS_MAX
    assert after.created - before.created == flooded
    assert after.taken == before.taken          # no span came: nothing was taken
    swept = after.swept - before.swept
    assert evicted == after.evicted - before.evicted
    assert evicted + swept == flooded + present0 - present1
    assert evicted >= flooded - SPAN_FACTS_MAX
    # the first round may warm caches; after it the agent's memory stays where it was
    assert rss[-1] - rss[0] < 8 * 1024, f"RSS grew {rss[-1] - rss[0]} kB over the flood: {rss}"
    with agent.child() as child:
        child.command("threads 4 5")
        child.command("flush", "flushed")
    assert_exact(agent, child.expected)


def test_a_row_whose_span_never_comes_expires_counted_and_the_agent_goes_on(agent, standin, tmp_path):
    """join.ttl_s after its first event, the sweep deletes a row nobody took and
    counts it; the agent then still finds new libraries (its refresh loop runs on)
    and joins new spans. (The module's agent with a 1 s TTL for the time of the
    test: a second agent in this process could not attach BCC's uprobes of the
    same names.)"""
    join_cfg = agent.daemon.spans.join.cfg
    ttl = join_cfg.ttl_s
    expired = lambda: agent.metric(lambda name, _: name == "spanlet_span_facts_expired_total") or 0  # noqa: E731
    before = expired()
    with agent.child("none") as child:
        child.command("threads 1 1")
    ((trace, span),) = child.expected
    key = (bytes.fromhex(trace), int(span, 16))
    join_cfg.ttl_s = 1.0
    try:
        wait_for(lambda: expired() >= before + 1, 15, "the row to expire")
        assert agent.facts.take(*key) is None
    finally:
        join_cfg.ttl_s = ttl
        agent.facts.take(*key)
    # a library file the agent has not seen (new inodes): found by the refresh loop
    libcuda = agent.libcuda
    agent.libcuda = standin.copy_libs(tmp_path / "copy") / cuda_standin.DRIVER
    try:
        agent.wait_attached()
        with agent.child() as child:
            child.command("threads 2 2")
            child.command("flush", "flushed")
        assert_exact(agent, child.expected)
    finally:
        agent.libcuda = libcuda
