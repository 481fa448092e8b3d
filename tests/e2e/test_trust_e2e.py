"""Issue 18's impostor, as a user would meet it: a victim (a real OTel SDK
process in a cgroup of its own) opens a span and launches 10 stand-in kernels;
while the span is open an impostor in another cgroup (another pod on the same
node) makes a span with the victim's trace id and span id, as anyone who saw
its traceparent could, and launches 1,000 in it. The victim's span must reach
the upstream with exactly its own 10; the impostor's row counted as foreign,
against the impostor's cgroup; the impostor's own span, when it sends one,
gets its own 1,000 and nothing of the victim's, whichever span comes first."""

from __future__ import annotations

import os

import pytest

import cuda_standin
from facts_agent import Agent, running_agent
from gpu_harness import cgroup2_root, cgroup_id, remove_cgroup
from otlp_upstream import kernel_attrs, wait_for

pytestmark = pytest.mark.kernel

RUNS = 5
VICTIM, IMPOSTOR = 10, 1000


@pytest.fixture(scope="module")
def agent(standin):
    with running_agent(standin.lib_dir / cuda_standin.DRIVER) as a:
        yield a


@pytest.fixture
def cgroups():
    """Two cgroups of this test's own ("pods"), removed at the end."""
    made = []
    for name in ("victim", "impostor"):
        path = cgroup2_root() / f"spanlet-trust-{name}-{os.getpid()}-{os.urandom(3).hex()}"
        path.mkdir()
        made.append(path)
    try:
        yield made
    finally:
        for path in made:
            remove_cgroup(path)


def foreign(agent: Agent, reason: str) -> float:
    return agent.metric(lambda name, lab: name == "spanlet_join_foreign_facts_total"
                        and lab.get("reason") == reason) or 0.0


def foreign_of(agent: Agent, cg: int) -> int:
    return agent.daemon.spans.join.foreign_by_cgroup.get(cg, 0)


@pytest.mark.parametrize("run", range(RUNS))
@pytest.mark.parametrize("impostor_sends", ["silent", "impostor-first", "victim-first"])
def test_an_impostor_in_another_pod_adds_to_and_takes_nothing_from_the_victims_span(
        agent, cgroups, impostor_sends, run):
    victim_cg_dir, impostor_cg_dir = cgroups
    # The SDK's own batch processor (an export every 5 s) so that the flushes
    # below decide which span arrives first.
    victim = agent.child("batch-sdk")
    impostor = agent.child("none" if impostor_sends == "silent" else "batch-sdk")
    try:
        # each in its pod before it connects or launches anything
        (victim_cg_dir / "cgroup.procs").write_text(str(victim.pid))
        (impostor_cg_dir / "cgroup.procs").write_text(str(impostor.pid))
        victim_cg, impostor_cg = cgroup_id(victim.pid), cgroup_id(impostor.pid)
        before = foreign(agent, "other_pod")      # the cgroups are new: nothing counted for them yet

        (_, trace_hex, span_hex), = victim.command(f"open {VICTIM}")
        key = (trace_hex, span_hex)
        impostor.command(f"impersonate {trace_hex} {span_hex} {IMPOSTOR}")
        victim.command("close")
        senders = {"silent": [victim], "impostor-first": [impostor, victim],
                   "victim-first": [victim, impostor]}[impostor_sends]
        for child in senders:
            child.command("flush", done="flushed")
            if len(senders) > 1:       # the first one's span is in before the other's is sent
                wait_for(lambda: any(s.name == ("impostor" if child is impostor else "held")
                                     for s in agent.upstream.by_ids.get(key, [])), 30,
                         "the first span upstream")

        names = {"held"} | ({"impostor"} if impostor_sends != "silent" else set())
        up = agent.upstream
        wait_for(lambda: names <= {s.name for s in up.by_ids.get(key, [])}, 30, "the spans upstream")
        agent.settle()
        with up.lock:
            got = [(s.name, kernel_attrs(s).get("kernel.gpu.launches", 0)) for s in up.by_ids[key]]
        launches = dict(got)
        assert len(got) == len(names), got
        assert launches["held"] == VICTIM, got                 # exactly its own
        if impostor_sends != "silent":
            assert launches["impostor"] == IMPOSTOR, got       # its own, none of the victim's
        # one row of another pod was seen by a span that did not get it; it is
        # the impostor's (or, when the impostor's span came first, the victim's)
        assert foreign(agent, "other_pod") == before + 1
        seen, unseen = (victim_cg, impostor_cg) if impostor_sends == "impostor-first" else \
            (impostor_cg, victim_cg)
        assert (foreign_of(agent, seen), foreign_of(agent, unseen)) == (1, 0)
        # nothing of either is left for a late record
        late = [s for s in up.by_ids.get(key, []) if s.name not in names]
        assert not late, late
    finally:
        victim.close()
        impostor.close()
