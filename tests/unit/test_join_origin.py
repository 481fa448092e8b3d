"""Facts stay in their pod (issue 18), in the join: rows per span and cgroup
(a fake facts map), the sender's origin deciding which a span gets, foreign
rows counted by reason and cgroup, late rows held to the same rule, and the
batch waiting room bounded per sender."""

import time

import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from facts_fakes import FakeFacts, row
from spanlet import join as join_mod
from spanlet.config import JoinConfig
from spanlet.join import SpanJoin, pick_rows

TRACE = bytes(range(1, 17))
STEP_TRACE = bytes(range(101, 117))
VICTIM, IMPOSTOR, WORKER = 1001, 2002, 1003


def rs(*span_ids, trace=TRACE, kind=trace_pb2.Span.SPAN_KIND_SERVER):
    spans = [trace_pb2.Span(trace_id=trace, span_id=i.to_bytes(8, "big"), name=f"s{i}", kind=kind)
             for i in span_ids]
    return [trace_pb2.ResourceSpans(scope_spans=[trace_pb2.ScopeSpans(spans=spans)])]


def launches(resources) -> list[int]:
    return [{kv.key: kv.value.int_value for kv in s.attributes}.get("kernel.gpu.launches", 0)
            for r in resources for ss in r.scope_spans for s in ss.spans]


def make(**cfg):
    facts = FakeFacts(index_cgroups=4)
    return SpanJoin(JoinConfig(**cfg), facts=facts), facts


def test_the_rule():
    a, b, c = (row(TRACE, 1, driver=n, cgroup_id=cg) for n, cg in ((3, 1), (5, 2), (5, 3)))
    assert pick_rows([a], None) == ([a], [])
    # unknown sender: the cgroup that did most, the first made on a tie
    assert pick_rows([a, b, c], None) == ([b], [(1, "conflict"), (3, "conflict")])
    syncs = row(TRACE, 1, cgroup_id=4, syncs=4, violations=1, graph_launches=1)
    assert pick_rows([b, syncs], None) == ([syncs], [(2, "conflict")])
    assert pick_rows([a, b, c], frozenset({1, 3})) == ([a, c], [(2, "other_pod")])
    assert pick_rows([a], frozenset()) == ([], [(1, "other_pod")])


@pytest.mark.parametrize("rep", range(5))
def test_an_impostor_with_the_same_ids_adds_nothing_to_the_victims_span(rep):
    j, facts = make()
    facts.add(TRACE, 7, driver=1000 + rep, cgroup_id=IMPOSTOR)
    facts.add(TRACE, 7, driver=10, cgroup_id=VICTIM)
    req = rs(7)
    assert j.join(req, origin=frozenset({VICTIM})) == [VICTIM]
    assert launches(req) == [10]
    assert (j.stats.foreign_other_pod, j.stats.foreign_conflict) == (1, 0)
    assert j.foreign() == {IMPOSTOR: 1}
    # the impostor's row stays for its own span, which gets its own and nothing more
    assert list(facts.map) == [(TRACE, 7, IMPOSTOR)]
    req = rs(7)
    assert j.join(req, origin=frozenset({IMPOSTOR})) == [IMPOSTOR]
    assert launches(req) == [1000 + rep] and facts.map == {}
    assert j.stats.foreign_other_pod == 1


@pytest.mark.parametrize("rep", range(5))
def test_an_impostors_span_first_takes_nothing_of_the_victims(rep):
    j, facts = make()
    facts.add(TRACE, 7, driver=10, cgroup_id=VICTIM)
    facts.add(TRACE, 7, driver=1000 + rep, cgroup_id=IMPOSTOR)
    first, second = rs(7), rs(7)
    j.join(first, origin=frozenset({IMPOSTOR}))
    j.join(second, origin=frozenset({VICTIM}))
    assert launches(first) == [1000 + rep] and launches(second) == [10]
    assert j.foreign() == {VICTIM: 1} and facts.map == {}


def test_unknown_sender_with_two_cgroups_is_a_counted_conflict():
    j, facts = make()
    facts.add(TRACE, 7, driver=10, cgroup_id=VICTIM)
    facts.add(TRACE, 7, driver=1000, cgroup_id=IMPOSTOR)
    facts.add(TRACE, 8, driver=4, cgroup_id=VICTIM)
    req = rs(7, 8)
    j.join(req)
    assert launches(req) == [1000, 4]
    assert (j.stats.foreign_other_pod, j.stats.foreign_conflict) == (0, 1)
    assert j.foreign() == {VICTIM: 1}
    assert list(facts.map) == [(TRACE, 7, VICTIM)]      # left for a sender that is known
    req = rs(7)
    j.join(req, origin=frozenset({VICTIM}))
    assert launches(req) == [10] and facts.map == {}


def test_a_worker_of_the_same_pod_counts():
    """Work done for the span by another process of the pod (another container:
    another cgroup of the same origin) is the span's too."""
    j, facts = make()
    facts.add(TRACE, 7, driver=10, cgroup_id=VICTIM)
    facts.add(TRACE, 7, driver=5, syncs=2, cgroup_id=WORKER)
    req = rs(7)
    j.join(req, origin=frozenset({VICTIM, WORKER}))
    assert launches(req) == [15] and j.stats.rows_taken == 2 and j.stats.spans_joined == 1
    assert j.foreign() == {}


def test_four_impostor_cgroups_cannot_hide_the_victims_row():
    """The kernel's index lists four cgroups per span; past it, the join also
    looks up the origin's own rows."""
    j, facts = make()
    for cg in range(1, 5):
        facts.add(TRACE, 7, driver=100, cgroup_id=cg)
    facts.add(TRACE, 7, driver=10, cgroup_id=VICTIM)
    req = rs(7)
    j.join(req, origin=frozenset({VICTIM}))
    assert launches(req) == [10]
    assert j.stats.foreign_other_pod == 4 and sorted(cg for _, _, cg in facts.map) == [1, 2, 3, 4]


def test_late_rows_follow_the_origin_of_the_span():
    out = []
    j, facts = make()
    j.on_late = out.extend
    j.join(rs(7), origin=frozenset({VICTIM}))
    j.join(rs(8))                                             # sender unknown
    now = time.time_ns()
    facts.add(TRACE, 7, driver=500, cgroup_id=IMPOSTOR, first_ns=now)
    facts.add(TRACE, 7, driver=3, cgroup_id=VICTIM, first_ns=now)
    facts.add(TRACE, 8, driver=2, cgroup_id=VICTIM, first_ns=now)
    facts.add(TRACE, 8, driver=9, cgroup_id=IMPOSTOR, first_ns=now)
    # span 7's sender is known: the impostor's row is not its late fact, and
    # stays (for the impostor's own span, else it expires)
    assert j.sweep(force=True) == 3 and list(facts.map) == [(TRACE, 7, IMPOSTOR)]
    assert j.flush_late() == 2
    got = {(cg, s.parent_span_id[-1]): launches([r])[0] for cg, r in out
           for s in r.scope_spans[0].spans}
    assert got == {(VICTIM, 7): 3, (IMPOSTOR, 8): 9}
    assert (j.stats.foreign_other_pod, j.stats.foreign_conflict) == (0, 1)
    assert j.foreign() == {VICTIM: 1} and j.stats.rows_late == 2


def test_the_per_cgroup_table_of_foreign_rows_is_bounded(monkeypatch):
    monkeypatch.setattr(join_mod, "FOREIGN_CGROUPS_MAX", 3)
    j, facts = make()
    for i in range(10):
        facts.add(TRACE, 100 + i, driver=1, cgroup_id=50 + i % 5)
        facts.add(TRACE, 100 + i, driver=1, cgroup_id=VICTIM)
        j.join(rs(100 + i), origin=frozenset({VICTIM}))
    assert j.stats.foreign_other_pod == 10
    assert len(j.foreign()) == 3 and sum(j.foreign().values()) == 6
    assert j.stats.foreign_cgroups_overflow == 4


def step(span_id, requests):
    s = trace_pb2.Span(trace_id=STEP_TRACE, span_id=span_id.to_bytes(8, "big"), name="step",
                       kind=trace_pb2.Span.SPAN_KIND_INTERNAL)
    for r in requests:
        s.links.add(trace_id=TRACE, span_id=r.to_bytes(8, "big"))
    return [trace_pb2.ResourceSpans(scope_spans=[trace_pb2.ScopeSpans(spans=[s])])]


def test_a_flood_of_steps_for_requests_that_never_come_pushes_out_only_its_own_shares():
    engine_a, engine_b = frozenset({VICTIM}), frozenset({IMPOSTOR})
    j, facts = make(batch_max_pending=100, batch_max_pending_per_pod=60)
    facts.add(STEP_TRACE, 1, driver=8, cgroup_id=VICTIM)
    j.join(step(1, [10, 11]), origin=engine_a)               # victim's shares: requests 10, 11
    for i in range(50):                                      # 50 steps x 20 links: 1,000 shares
        facts.add(STEP_TRACE, 100 + i, driver=1, cgroup_id=IMPOSTOR)
        j.join(step(100 + i, range(10_000 + 20 * i, 10_020 + 20 * i)), origin=engine_b)
    by = j.batch_by_owner()
    assert by[VICTIM]["pending"] == 2 and by[VICTIM]["dropped"] == 0
    assert by[IMPOSTOR]["pending"] == 60 and by[IMPOSTOR]["dropped"] == 1000 - 60
    assert j.stats.batch_pod_dropped == 1000 - 60
    req = rs(10, 11)
    j.join(req, origin=frozenset({3}))
    attrs = [{kv.key: kv.value for kv in s.attributes} for s in req[0].scope_spans[0].spans]
    assert [a["kernel.batch.gpu.launches"].double_value for a in attrs] == [4.0, 4.0]


def test_past_the_total_the_sender_with_most_waiting_loses_its_oldest():
    j, facts = make(batch_max_pending=30, batch_max_pending_per_pod=25)
    facts.add(STEP_TRACE, 1, driver=2, cgroup_id=VICTIM)
    j.join(step(1, range(1, 11)), origin=frozenset({VICTIM}))   # 10 shares
    facts.add(STEP_TRACE, 2, driver=2, cgroup_id=IMPOSTOR)
    j.join(step(2, range(100, 125)), origin=frozenset({IMPOSTOR}))   # 25: total 35 > 30
    by = j.batch_by_owner()
    assert by[VICTIM]["pending"] == 10 and by[IMPOSTOR]["pending"] == 20
    assert j.stats.batch_expired == 5 and j.stats.batch_pod_dropped == 0


def test_held_request_spans_are_bounded_per_sender():
    j, facts = make(batch_max_held_per_pod=16, batch_max_held_spans=1000)
    facts.add(STEP_TRACE, 1, driver=1, cgroup_id=VICTIM)
    j.join(step(1, [5]))                                      # steps seen: requests are held
    flood, mine = [], []
    j.join(rs(*range(100, 140)), flood, origin=frozenset({IMPOSTOR}))
    j.join(rs(*range(200, 210)), mine, origin=frozenset({VICTIM}))
    assert (len(flood), len(mine)) == (16, 10)
    assert j.stats.batch_pod_hold_full == 24 and j.batch_hold_full_by_owner == {IMPOSTOR: 24}
    assert j.batch_by_owner()[IMPOSTOR]["held"] == 16
    j.release(flood)
    j.release(mine)
    assert j.batch_pending() == (0, 1) and IMPOSTOR not in j._owner_held
