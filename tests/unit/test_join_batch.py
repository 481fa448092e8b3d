"""Batched steps in the join: a step span (a span with links) shares its kernel
facts among the request spans it links to, by weight; requests are held back
for their steps once steps were seen; late, expired and dropped shares counted."""

import threading
import time

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet import config
from spanlet.config import JoinConfig
from spanlet.join import BATCH_SHARES, LATE_SPAN_NAME, SpanJoin
from spanlet.pipeline.spans import SpanPath
from facts_fakes import FakeFacts

REQ_TRACE = bytes(range(1, 17))
STEP_TRACE = bytes(range(101, 117))
SERVER = trace_pb2.Span.SPAN_KIND_SERVER


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def span(span_id, trace=REQ_TRACE, kind=SERVER, links=(), start=5):
    s = trace_pb2.Span(trace_id=trace, span_id=span_id.to_bytes(8, "big"), name=f"s{span_id}",
                       kind=kind, start_time_unix_nano=start)
    for link_trace, link_span, weight in links:
        link = s.links.add(trace_id=link_trace, span_id=link_span.to_bytes(8, "big"))
        if weight is not None:
            kv = link.attributes.add(key="spanlet.weight")
            if isinstance(weight, int):
                kv.value.int_value = weight
            else:
                kv.value.double_value = weight
    return s


def rs(*spans):
    return [trace_pb2.ResourceSpans(scope_spans=[trace_pb2.ScopeSpans(spans=list(spans))])]


def step(span_id, requests, trace=STEP_TRACE):
    """A step span linking to (span id, weight) of REQ_TRACE (weight None: no attribute)."""
    return span(span_id, trace=trace, kind=trace_pb2.Span.SPAN_KIND_INTERNAL,
                links=[(REQ_TRACE, r, w) for r, w in requests])


def batch_attrs(s):
    out = {}
    for kv in s.attributes:
        if kv.key == "kernel.batch.steps":
            out[kv.key] = kv.value.int_value
        elif kv.key.startswith("kernel.batch."):
            assert kv.value.HasField("double_value"), kv
            out[kv.key] = kv.value.double_value
    return out


def shares(steps, launches, graph=0.0, sync=0.0, graph_kernels=0.0, cpu=0.0, runqueue=0.0, blocked=0.0,
           iowait=0.0, h2d=0.0, d2h=0.0, d2d=0.0, other=0.0):
    return {"kernel.batch.steps": steps, "kernel.batch.gpu.launches": pytest.approx(launches, abs=1e-6),
            "kernel.batch.gpu.graph_launches": pytest.approx(graph, abs=1e-6),
            "kernel.batch.gpu.graph_kernels": pytest.approx(graph_kernels, abs=1e-6),
            "kernel.batch.gpu.sync_wait_ns": pytest.approx(sync, abs=1e-6),
            "kernel.batch.sched.cpu_ns": pytest.approx(cpu, abs=1e-6),
            "kernel.batch.sched.runqueue_ns": pytest.approx(runqueue, abs=1e-6),
            "kernel.batch.sched.blocked_ns": pytest.approx(blocked, abs=1e-6),
            "kernel.batch.sched.iowait_ns": pytest.approx(iowait, abs=1e-6),
            "kernel.batch.gpu.memcpy_h2d_bytes": pytest.approx(h2d, abs=1e-6),
            "kernel.batch.gpu.memcpy_d2h_bytes": pytest.approx(d2h, abs=1e-6),
            "kernel.batch.gpu.memcpy_d2d_bytes": pytest.approx(d2d, abs=1e-6),
            "kernel.batch.gpu.memcpy_other_bytes": pytest.approx(other, abs=1e-6)}


def make(**cfg):
    facts, clock = FakeFacts(), Clock()
    return SpanJoin(JoinConfig(**cfg), facts=facts, clock=clock), facts, clock


@pytest.mark.parametrize("steps_first", [True, False])
def test_each_request_gets_its_weighted_share_of_each_of_its_steps(steps_first):
    j, facts, _ = make()
    facts.add(STEP_TRACE, 900, driver=10, graph_launches=3, graph_kernels=21, sync_wait_ns=7000,
              memcpy_h2d_bytes=5000, memcpy_other_bytes=10)
    facts.add(STEP_TRACE, 901, driver=6, sync_wait_ns=600, memcpy_d2h_bytes=300)
    facts.add(STEP_TRACE, 899, driver=1)
    # a first step somewhere (the agent now knows this node batches)
    j.join(rs(step(899, [(50, None)])))
    steps = rs(step(900, [(1, 1), (2, 3.0), (3, None)]), step(901, [(1, 2), (3, 1)]))
    requests = rs(span(1), span(2), span(3), span(4))
    held = []
    if steps_first:
        j.join(steps)
        j.join(requests, held)
    else:
        j.join(requests, held)
        j.join(steps)
    assert [k for k, _ in held] == [(REQ_TRACE, i) for i in (1, 2, 3, 4)]
    s1, s2, s3, s4 = requests[0].scope_spans[0].spans
    assert batch_attrs(s1) == {}              # nothing on them until released
    j.release(held)
    # step 900: weights 1, 3, 1 of 5; step 901: 2, 1 of 3
    assert batch_attrs(s1) == shares(2, 10 * 1 / 5 + 6 * 2 / 3, 3 / 5, 7000 / 5 + 600 * 2 / 3, 21 / 5,
                                     h2d=1000, d2h=200, other=2)
    assert batch_attrs(s2) == shares(1, 10 * 3 / 5, 9 / 5, 7000 * 3 / 5, 63 / 5, h2d=3000, other=6)
    assert batch_attrs(s3) == shares(2, 10 / 5 + 6 / 3, 3 / 5, 7000 / 5 + 600 / 3, 21 / 5,
                                     h2d=1000, d2h=100, other=2)
    assert batch_attrs(s4) == {}               # a request in no step
    # the steps keep their own facts
    st900 = steps[0].scope_spans[0].spans[0]
    assert {kv.key: kv.value.int_value for kv in st900.attributes}["kernel.gpu.launches"] == 10
    # the shares of one step add up to its facts
    for attr, total in (("kernel.batch.gpu.launches", 16), ("kernel.batch.gpu.sync_wait_ns", 7600),
                        ("kernel.batch.gpu.graph_launches", 3), ("kernel.batch.gpu.graph_kernels", 21)):
        assert sum(batch_attrs(s).get(attr, 0) for s in (s1, s2, s3)) == pytest.approx(total, abs=1e-6)
    assert j.stats.batch_steps == 3 and j.stats.batch_requests == 3 and j.stats.batch_held == 4
    assert j.batch_pending() == (0, 1)        # request 50 never came (yet)


def test_nothing_is_held_before_a_step_is_seen_and_the_common_path_reads_no_attributes():
    j, facts, _ = make()
    facts.add(REQ_TRACE, 1, driver=2)
    held = []
    requests = rs(span(1), span(2))
    j.join(requests, held)
    assert held == [] and not j.steps_seen
    assert j.stats.batch_held == 0
    j2, facts2, _ = make(batch_wait_s=0)      # 0: never hold, even with steps
    facts2.add(STEP_TRACE, 9, driver=1)
    j2.join(rs(step(9, [(1, 1)])))
    j2.join(rs(span(1)), held)
    assert held == [] and j2.steps_seen


def test_a_step_linked_to_a_request_that_never_arrives_expires_counted():
    j, facts, clock = make(ttl_s=5)
    facts.add(STEP_TRACE, 900, driver=4)
    j.join(rs(step(900, [(1, 1), (2, 1)])))
    assert j.batch_pending() == (0, 2)
    clock.t += 6
    other, held = rs(span(3)), []
    j.join(other, held)                        # any join evicts what is too old
    assert j.batch_pending() == (1, 0)         # (this one held)
    j.release(held)
    assert j.stats.batch_expired == 2
    # the request coming after its shares expired gets none, and nothing else got them
    held = []
    late = rs(span(1))
    j.join(late, held)
    j.release(held)
    assert batch_attrs(late[0].scope_spans[0].spans[0]) == {}
    assert batch_attrs(other[0].scope_spans[0].spans[0]) == {}


def test_a_link_to_a_span_of_another_trace_goes_to_that_trace_only():
    j, facts, _ = make()
    facts.add(STEP_TRACE, 900, driver=8)
    other_trace = bytes(range(200, 216))
    j.join(rs(span(900, trace=STEP_TRACE, kind=trace_pb2.Span.SPAN_KIND_INTERNAL,
                   links=[(other_trace, 1, 1), (REQ_TRACE, 2, 3)])))
    held = []
    same_id = rs(span(1), span(2))              # span 1 of REQ_TRACE: not the linked span 1
    linked = rs(span(1, trace=other_trace))
    j.join(same_id, held)
    j.join(linked, held)
    j.release(held)
    a1, a2 = same_id[0].scope_spans[0].spans
    assert batch_attrs(a1) == {}
    assert batch_attrs(a2) == shares(1, 6)
    assert batch_attrs(linked[0].scope_spans[0].spans[0]) == shares(1, 2)


def test_ten_thousand_links_in_one_step_are_bounded_counted_and_exact():
    j, facts, _ = make(batch_max_links=1024, batch_max_pending=512)
    facts.add(STEP_TRACE, 900, driver=10_000)
    links = [(i, 1) for i in range(1, 10_001)]
    j.join(rs(step(900, links)))
    st = j.stats
    assert st.batch_links == 1024 and st.batch_links_dropped == 10_000 - 1024
    assert j.batch_pending() == (0, 512)         # the table's bound
    assert st.batch_expired == 1024 - 512       # pushed out of it, counted
    held = []
    requests = rs(*(span(i) for i in (1, 600, 1024, 1025, 9999)))
    j.join(requests, held)
    j.release(held)
    got = [batch_attrs(s) for s in requests[0].scope_spans[0].spans]
    # 1: pushed out by the bound; 600, 1024: each its 1/10,000; past the cap: nothing
    assert got[0] == {} and got[3] == {} and got[4] == {}
    assert got[1] == shares(1, 1.0) and got[2] == shares(1, 1.0)


def test_a_step_after_its_request_went_out_is_a_late_record_of_the_request():
    out = []
    j, facts, clock = make()
    j.on_late = out.extend
    facts.add(STEP_TRACE, 898, driver=1)
    j.join(rs(step(898, [(77, 1)])))            # steps seen
    held = []
    requests = rs(span(1), span(2))
    j.join(requests, held)
    j.release(held)                              # the requests went out without shares
    facts.add(STEP_TRACE, 900, driver=9, sync_wait_ns=300)
    j.join(rs(step(900, [(1, 2), (2, 1)])))
    assert j.flush_late() == 2
    late = {s.parent_span_id: s for _, r in out for ss in r.scope_spans for s in ss.spans}
    assert set(late) == {(1).to_bytes(8, "big"), (2).to_bytes(8, "big")}
    one = late[(1).to_bytes(8, "big")]
    assert one.name == LATE_SPAN_NAME and one.trace_id == REQ_TRACE
    assert batch_attrs(one) == shares(1, 6, 0, 200)
    assert batch_attrs(late[(2).to_bytes(8, "big")]) == shares(1, 3, 0, 100)
    assert j.stats.batch_late == 2 and j.stats.late_records == 2
    assert j.flush_late() == 0


def test_weights_zero_everywhere_share_equally_and_bad_weights_count_one():
    j, facts, _ = make()
    facts.add(STEP_TRACE, 900, driver=6)
    facts.add(STEP_TRACE, 901, driver=6)
    j.join(rs(step(900, [(1, 0), (2, 0), (3, 0)]), step(901, [(4, float("nan")), (5, -2.0), (6, 4)])))
    held = []
    requests = rs(*(span(i) for i in range(1, 7)))
    j.join(requests, held)
    j.release(held)
    got = [batch_attrs(s)["kernel.batch.gpu.launches"] for s in requests[0].scope_spans[0].spans]
    assert got == pytest.approx([2, 2, 2, 1, 1, 4])


def test_a_request_linked_twice_in_one_step_counts_one_step_with_both_weights():
    j, facts, _ = make()
    facts.add(STEP_TRACE, 900, driver=4)
    j.join(rs(step(900, [(1, 1), (1, 1), (2, 2)])))
    held = []
    requests = rs(span(1), span(2))
    j.join(requests, held)
    j.release(held)
    a1, a2 = (batch_attrs(s) for s in requests[0].scope_spans[0].spans)
    assert a1 == shares(1, 2) and a2 == shares(1, 2)


def test_held_spans_are_bounded():
    j, facts, _ = make(batch_max_held_spans=16)
    facts.add(STEP_TRACE, 900, driver=1)
    j.join(rs(step(900, [(1000, 1)])))
    held = []
    j.join(rs(*(span(i) for i in range(1, 21))), held)
    assert len(held) == 16 and j.stats.batch_hold_full == 4
    j.release(held)
    assert j.batch_pending()[0] == 0


def test_every_gpu_and_time_fact_of_a_step_is_shared():
    assert [f for _, f in BATCH_SHARES] == ["launches", "graph_launches", "graph_kernels", "sync_wait_ns",
                                            "cpu_ns", "runqueue_ns", "blocked_ns", "iowait_ns",
                                            "memcpy_h2d_bytes", "memcpy_d2h_bytes", "memcpy_d2d_bytes",
                                            "memcpy_other_bytes"]


def test_the_span_path_holds_requests_for_batch_wait_s_then_exports_them_with_their_shares():
    cfg = config.load(env={}, overrides=["join.batch_wait_s=0.3", "otlp.grpc_port=0",
                                         "otlp.http_port=0"])
    seen, lock = [], threading.Lock()

    def on_joined(resource_spans, blobs):
        with lock:
            seen.append((time.monotonic(), [s for r in resource_spans for ss in r.scope_spans
                                            for s in ss.spans]))

    path = SpanPath(cfg, on_joined=on_joined)
    facts = FakeFacts()
    path.join.facts = facts
    facts.add(STEP_TRACE, 900, driver=6)
    try:
        t0 = time.monotonic()
        path.on_request(ExportTraceServiceRequest(resource_spans=rs(span(1))))
        assert len(seen) == 1                    # no step seen yet: straight on
        path.on_request(ExportTraceServiceRequest(resource_spans=rs(step(900, [(2, 1), (3, 2)]))))
        assert len(seen) == 2                    # a step is never held
        t1 = time.monotonic()
        path.on_request(ExportTraceServiceRequest(resource_spans=rs(span(2), span(3))))
        assert len(seen) == 2 and path.held_requests() == 1
        deadline = time.monotonic() + 5
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        when, spans = seen[2]
        assert when - t1 >= 0.3
        assert [batch_attrs(s) for s in spans] == [shares(1, 2), shares(1, 4)]
        # one more held, released at once by the stop
        path.on_request(ExportTraceServiceRequest(resource_spans=rs(span(4))))
        path.release_held()
        assert len(seen) == 4 and time.monotonic() - t0 < 5
    finally:
        path.release_held()


def test_a_request_in_many_steps_gets_them_all():
    """More than 127 steps: the count takes two bytes on the wire."""
    j, facts, _ = make()
    for k in range(300):
        facts.add(STEP_TRACE, 1000 + k, driver=3, sync_wait_ns=10)
        j.join(rs(step(1000 + k, [(1, 1), (2, 2)])))
    held = []
    requests = rs(span(1))
    j.join(requests, held)
    j.release(held)
    assert batch_attrs(requests[0].scope_spans[0].spans[0]) == shares(300, 300.0, 0, 1000.0)


def test_a_linked_span_that_is_not_held_gets_the_shares_that_came_before_it():
    """A span of another kind than SERVER, and a request with the wait at 0."""
    j, facts, _ = make(batch_wait_s=0)
    facts.add(STEP_TRACE, 900, driver=6)
    j.join(rs(step(900, [(1, 1), (2, 2)])))
    held = []
    internal = rs(span(1, kind=trace_pb2.Span.SPAN_KIND_INTERNAL), span(2), span(3))
    j.join(internal, held)
    assert held == []
    a1, a2, a3 = (batch_attrs(s) for s in internal[0].scope_spans[0].spans)
    assert a1 == shares(1, 2) and a2 == shares(1, 4) and a3 == {}
    assert j.batch_pending() == (0, 0)


def test_a_chance_match_of_the_link_pattern_in_ids_changes_nothing():
    """The resource-bytes search for links may match inside ids; the span then
    is looked at and has none."""
    j, facts, _ = make()
    odd = trace_pb2.Span(trace_id=b"\x6a\x05\x0a\x10" + bytes(12), span_id=(7).to_bytes(8, "big"),
                         kind=SERVER)
    facts.add(odd.trace_id, 7, driver=2)
    r = rs(odd)
    j.join(r, [])
    assert not j.steps_seen and j.stats.batch_steps == 0
    assert {kv.key: kv.value.int_value for kv in r[0].scope_spans[0].spans[0].attributes} == \
        {"kernel.gpu.launches": 2}


def test_a_copy_of_a_held_request_leaves_the_first_with_its_shares():
    """An exporter's retry: the same request span twice while the first is held."""
    j, facts, _ = make()
    facts.add(STEP_TRACE, 900, driver=4)
    facts.add(STEP_TRACE, 899, driver=1)
    j.join(rs(step(899, [(50, None)])))
    first, again, held1, held2 = rs(span(1)), rs(span(1)), [], []
    j.join(first, held1)
    j.join(again, held2)
    j.join(rs(step(900, [(1, 1)])))
    j.release(held2)
    j.release(held1)
    assert held2 == [] and batch_attrs(first[0].scope_spans[0].spans[0]) == shares(1, 4)


def test_a_flood_of_links_to_requests_that_never_come_stays_bounded_and_counted():
    j, facts, _ = make(batch_max_pending=1000, batch_max_links=100)
    for k in range(300):                      # 300 steps x 100 links, 30,000 requests never sent
        j.join(rs(step(10_000 + k, [(100 * k + i + 1, 1) for i in range(100)])))
        assert j.batch_pending()[1] <= 1000
    assert j.stats.batch_links == 30_000 and j.stats.batch_expired == 29_000
    # the most recent requests still get exactly theirs
    held = []
    last = rs(span(30_000))
    j.join(last, held)
    j.release(held)
    assert batch_attrs(last[0].scope_spans[0].spans[0]) == shares(1, 0)   # the steps had no launches


def test_spans_with_links_and_no_gpu_work_do_not_make_the_node_hold_requests():
    j, facts, _ = make()
    j.join(rs(step(900, [(1, 1)])))             # links, no facts row: not a GPU step
    facts.add(STEP_TRACE, 901, syncs=1)          # a row with nothing the shares carry
    j.join(rs(step(901, [(1, 1)])))
    held = []
    j.join(rs(span(2)), held)
    assert held == [] and not j.steps_seen and j.stats.batch_steps == 2
    facts.add(STEP_TRACE, 902, sync_wait_ns=5)
    j.join(rs(step(902, [(1, 1)])))
    j.join(rs(span(3)), held)
    assert len(held) == 1 and j.steps_seen


def test_a_shard_of_a_step_adds_its_facts_to_the_shares_but_not_a_step():
    # tensor parallelism: ranks 1.. of a step carry spanlet.batch.shard (spanlet.vllm)
    j, facts, _ = make()
    facts.add(STEP_TRACE, 900, driver=10, cpu_ns=3000)
    facts.add(STEP_TRACE, 901, driver=6, cpu_ns=900)
    facts.add(STEP_TRACE, 902, driver=4)
    rank0 = step(900, [(1, 1), (2, 2)])
    rank1 = step(901, [(1, 1), (2, 2)])
    rank1.attributes.add(key="spanlet.batch.shard").value.int_value = 1
    rank0_again = step(902, [(1, 1)])
    rank0_again.attributes.add(key="spanlet.batch.shard").value.int_value = 0   # rank 0 said: a step
    j.join(rs(rank0, rank1, rank0_again))
    requests = rs(span(1), span(2))
    j.join(requests)
    s1, s2 = requests[0].scope_spans[0].spans
    assert batch_attrs(s1) == shares(2, 10 / 3 + 6 / 3 + 4, cpu=3000 / 3 + 900 / 3)
    assert batch_attrs(s2) == shares(1, 20 / 3 + 12 / 3, cpu=6000 / 3 + 1800 / 3)


def test_weights_in_one_array_on_the_step_stand_for_each_links_own():
    # spanlet.batch.weights (spanlet.vllm): link i's weight is its element i; a link
    # past the array's end has its own spanlet.weight (or 1); bad elements count 1
    j, facts, _ = make()
    facts.add(STEP_TRACE, 900, driver=12)
    s = step(900, [(1, None), (2, 100), (3, None), (4, 5)])
    arr = s.attributes.add(key="spanlet.batch.weights").value.array_value
    arr.values.add().int_value = 3
    arr.values.add().double_value = 1.0
    arr.values.add().double_value = float("nan")
    j.join(rs(s))
    requests = rs(span(1), span(2), span(3), span(4))
    j.join(requests)
    got = [batch_attrs(x)["kernel.batch.gpu.launches"] for x in requests[0].scope_spans[0].spans]
    assert got == pytest.approx([12 * 3 / 10, 12 * 1 / 10, 12 * 1 / 10, 12 * 5 / 10], abs=1e-9)
