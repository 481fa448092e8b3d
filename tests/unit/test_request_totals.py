"""Request totals (agent/request_totals.py): a server span gets its in-process
subtree's kernel facts as kernel.request.*, from spans of one export request
in any order and from earlier ones; a child after its parent is left out;
processes are kept apart; what waits is bounded and its drops counted; the
bytes handed on to the store and the serving metrics are the spans' own; and
the span path puts them on before the serving metrics and the export see
the spans."""

from __future__ import annotations

import itertools
import threading

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet import config
from spanlet.pipeline.spans import SpanPath
import collector_fakes
from facts_fakes import FakeFacts
from spanlet.request_totals import (REQUEST_BLOCKED_NS, REQUEST_CPU_NS, REQUEST_MEMCPY_H2D_BYTES,
                                    REQUEST_RUNQUEUE_NS, TOTALS, _MARKS, RequestTotals)

SERVER = trace_pb2.Span.SPAN_KIND_SERVER
INTERNAL = trace_pb2.Span.SPAN_KIND_INTERNAL
CLIENT = trace_pb2.Span.SPAN_KIND_CLIENT
LOCAL_PARENT, REMOTE_PARENT = 0x100, 0x300      # HAS_IS_REMOTE, and IS_REMOTE with it
T1, T2 = bytes(range(1, 17)), bytes(range(2, 18))
FACT = {"cpu": "kernel.sched.cpu_ns", "rq": "kernel.sched.runqueue_ns", "blocked": "kernel.sched.blocked_ns",
        "h2d": "kernel.gpu.memcpy_h2d_bytes", "iowait": "kernel.sched.iowait_ns",
        "bcpu": "kernel.batch.sched.cpu_ns", "brq": "kernel.batch.sched.runqueue_ns",
        "bh2d": "kernel.batch.gpu.memcpy_h2d_bytes"}


def sid(n: int) -> bytes:
    return n.to_bytes(8, "big")


def span(n: int, parent: int = 0, kind=INTERNAL, trace=T1, flags=0, **facts) -> trace_pb2.Span:
    """Span n (child of `parent`) with some attributes of its own, then its
    facts as the join puts them: ints, the batch shares doubles."""
    s = trace_pb2.Span(trace_id=trace, span_id=sid(n), parent_span_id=sid(parent) if parent else b"",
                       kind=kind, flags=flags, name=f"s{n}")
    s.attributes.add(key="http.route").value.string_value = "/infer/{n}"
    for short, value in facts.items():
        kv = s.attributes.add(key=FACT[short])
        if isinstance(value, float):
            kv.value.double_value = value
        else:
            kv.value.int_value = value
    return s


def resource(*spans, service="svc", scopes=1) -> trace_pb2.ResourceSpans:
    """Spans in `scopes` scopes, dealt round-robin."""
    rs = trace_pb2.ResourceSpans()
    rs.resource.attributes.add(key="service.name").value.string_value = service
    parts = [rs.scope_spans.add() for _ in range(scopes)]
    for i, s in enumerate(spans):
        parts[i % scopes].scope.name = f"scope{i % scopes}"
        parts[i % scopes].spans.append(s)
    return rs


def apply(totals: RequestTotals, *resources, origin=None, blobs=None) -> list:
    """Apply to one export request; checks that the bytes handed on are the
    spans as they are now, and returns the resources."""
    rss = list(resources)
    out = [None] * len(rss) if blobs is None else blobs
    totals.apply(rss, out, origin)
    assert [trace_pb2.ResourceSpans.FromString(b) for b in out] == rss
    return rss


def request_attrs(s: trace_pb2.Span) -> dict:
    return {kv.key: kv.value.int_value for kv in s.attributes if kv.key.startswith("kernel.request.")}


def spans_of(rss) -> dict[int, trace_pb2.Span]:
    return {int.from_bytes(s.span_id, "big"): s for rs in rss for ss in rs.scope_spans for s in ss.spans}


def sched(cpu, rq, blocked) -> dict:
    return {REQUEST_CPU_NS: cpu, REQUEST_RUNQUEUE_NS: rq, REQUEST_BLOCKED_NS: blocked}


def test_a_tree_in_one_request_in_any_order_sums_into_its_server_span():
    tree = [span(1, kind=SERVER, cpu=100, rq=10, blocked=1000, iowait=7),
            span(2, 1, cpu=20, rq=2, h2d=4096), span(3, 2, cpu=3, blocked=5),
            span(4, 1, kind=CLIENT, cpu=1, rq=1), span(5, 4)]
    want = {**sched(124, 13, 1005), REQUEST_MEMCPY_H2D_BYTES: 4096}
    for order in itertools.permutations(range(len(tree))):
        t = RequestTotals()
        got = spans_of(apply(t, resource(*[span_copy(tree[i]) for i in order], scopes=2)))
        assert request_attrs(got[1]) == want, order
        assert all(not request_attrs(got[n]) for n in (2, 3, 4, 5))   # only the server span
        assert t.waiting() == (0, 0) and t.stats.summed == 1


def span_copy(s: trace_pb2.Span) -> trace_pb2.Span:
    out = trace_pb2.Span()
    out.CopyFrom(s)
    return out


def test_children_from_earlier_requests_are_in_the_total_and_then_forgotten():
    t = RequestTotals()
    apply(t, resource(span(3, 2, cpu=3, rq=1)))              # a grandchild first
    apply(t, resource(span(2, 1, cpu=20), span(6, 1, blocked=9)))
    assert t.waiting() == (1, 1)                             # one sum, waiting for span 1
    got = spans_of(apply(t, resource(span(1, kind=SERVER, cpu=100, h2d=8))))
    assert request_attrs(got[1]) == {**sched(123, 1, 9), REQUEST_MEMCPY_H2D_BYTES: 8}
    assert t.waiting() == (0, 0)


def test_a_child_after_its_parent_is_left_out_and_dropped_with_its_trace():
    now = [0.0]
    t = RequestTotals(ttl_s=60, clock=lambda: now[0])
    got = spans_of(apply(t, resource(span(1, kind=SERVER, cpu=100), span(2, 1, cpu=20))))
    assert request_attrs(got[1]) == sched(120, 0, 0)
    late = spans_of(apply(t, resource(span(3, 1, cpu=50), span(4, 3, cpu=5))))
    assert not request_attrs(late[3]) and t.waiting() == (1, 1)
    now[0] = 61.0
    apply(t, resource(span(9, trace=T2)))                    # any later request evicts it
    assert t.waiting() == (0, 0) and t.stats.dropped["age"] == 1
    assert request_attrs(got[1]) == sched(120, 0, 0)         # the parent never changes again


def test_two_processes_with_one_trace_id_are_kept_apart():
    t = RequestTotals()
    # another process's span names span 1 as its parent (it is not in that process)
    apply(t, resource(span(2, 1, cpu=500), service="other"))
    apply(t, resource(span(3, 1, cpu=700)), origin=frozenset({42}))    # same resource, another pod
    got = spans_of(apply(t, resource(span(1, kind=SERVER, cpu=100), span(4, 1, cpu=1)),
                         origin=frozenset({7})))
    assert request_attrs(got[1]) == sched(101, 0, 0)
    # in one export request too
    rss = apply(RequestTotals(), resource(span(2, 1, cpu=500), service="other"),
                resource(span(1, kind=SERVER, cpu=100)))
    assert request_attrs(spans_of(rss)[1]) == sched(100, 0, 0)


def test_other_traces_and_non_server_spans_are_untouched():
    t = RequestTotals()
    rss = apply(t, resource(span(1, kind=SERVER, cpu=100), span(2, 1, cpu=1, trace=T2),
                            span(3, kind=INTERNAL, cpu=9), span(4, 3, cpu=9)))
    got = spans_of(rss)
    assert request_attrs(got[1]) == sched(100, 0, 0)
    assert [request_attrs(got[n]) for n in (2, 3, 4)] == [{}, {}, {}]
    assert t.waiting() == (1, 1)       # span 2's sum waits for span 1 of trace T2


def test_which_attributes_a_server_span_gets():
    t = RequestTotals()
    # nothing: no attribute at all, bytes unchanged
    rs = resource(span(1, kind=SERVER), span(2, 1))
    before = rs.SerializeToString()
    blobs = [before]
    apply(t, rs, blobs=blobs)
    assert blobs[0] is before and not request_attrs(rs.scope_spans[0].spans[0])
    # copies only: the scheduler's three are not claimed to be zero
    got = spans_of(apply(t, resource(span(1, kind=SERVER, trace=T2), span(2, 1, trace=T2, h2d=64))))
    assert request_attrs(got[1]) == {REQUEST_MEMCPY_H2D_BYTES: 64}
    # run queue only: all three, the zeros measured
    got = spans_of(apply(t, resource(span(7, kind=SERVER, rq=5))))
    assert request_attrs(got[7]) == sched(0, 5, 0)
    assert [k for k, _ in TOTALS] == [REQUEST_CPU_NS, REQUEST_RUNQUEUE_NS, REQUEST_BLOCKED_NS,
                                      REQUEST_MEMCPY_H2D_BYTES]


def test_batched_step_shares_are_part_of_the_request():
    got = spans_of(apply(RequestTotals(), resource(
        span(1, kind=SERVER, cpu=100), span(2, 1, bcpu=2500.4, brq=10.6, cpu=5, bh2d=1024.0))))
    assert request_attrs(got[1]) == {**sched(2605, 11, 0), REQUEST_MEMCPY_H2D_BYTES: 1024}


def test_nested_server_spans_each_get_their_own_subtree():
    t = RequestTotals()
    got = spans_of(apply(t, resource(
        span(1, kind=SERVER, cpu=1000),
        span(2, 1, kind=SERVER, flags=LOCAL_PARENT, cpu=100),       # a layer of the same request
        span(3, 2, cpu=10),
        span(4, 1, kind=SERVER, cpu=7),                              # flags unsaid: a request of its own
        span(5, 4, cpu=1))))
    assert request_attrs(got[2]) == sched(110, 0, 0)
    assert request_attrs(got[4]) == sched(8, 0, 0)
    assert request_attrs(got[1]) == sched(1110, 0, 0)
    # a parent said to be remote takes nothing, even when its id is here
    got = spans_of(apply(RequestTotals(), resource(
        span(1, kind=SERVER, cpu=1), span(2, 1, kind=SERVER, flags=REMOTE_PARENT, cpu=5),
        span(3, 1, kind=INTERNAL, flags=REMOTE_PARENT, cpu=9))))
    assert request_attrs(got[1]) == sched(1, 0, 0) and request_attrs(got[2]) == sched(5, 0, 0)


def test_a_server_span_with_totals_already_keeps_them():
    s = span(1, kind=SERVER, cpu=100)
    s.attributes.add(key=REQUEST_CPU_NS).value.int_value = 5
    got = spans_of(apply(RequestTotals(), resource(s, span(2, 1, cpu=1))))
    assert [kv.key for kv in got[1].attributes].count(REQUEST_CPU_NS) == 1
    assert request_attrs(got[1]) == {REQUEST_CPU_NS: 5}


def test_waiting_subtrees_are_bounded_and_their_drops_counted():
    t = RequestTotals(max_traces=2, max_subtrees=3, max_subtrees_per_trace=2)
    traces = [bytes([k]) * 16 for k in range(1, 6)]
    apply(t, resource(span(2, 1, trace=traces[0], cpu=1)))
    apply(t, resource(span(3, 1, trace=traces[1], cpu=1), span(4, 9, trace=traces[1], cpu=1),
                      span(5, 8, trace=traces[1], cpu=1)))     # a third parent: past the trace's bound
    assert t.waiting() == (2, 3) and t.stats.dropped["trace_full"] == 1
    apply(t, resource(span(6, 1, trace=traces[2], cpu=1)))    # a third trace: the oldest goes
    assert t.waiting() == (2, 3) and t.stats.dropped["traces"] == 1
    apply(t, resource(span(7, 1, trace=traces[2], cpu=1), span(8, 2, trace=traces[2], cpu=1)))
    # 4 subtrees > 3: the least recently touched trace (traces[1], 2 subtrees) goes
    assert t.waiting() == (1, 2) and t.stats.dropped["subtrees"] == 2
    got = spans_of(apply(t, resource(span(1, kind=SERVER, trace=traces[2], cpu=10))))
    assert request_attrs(got[1]) == sched(12, 0, 0)            # spans 6 and 7
    assert t.stats.as_dict() == {"summed": 1, "dropped_age": 0, "dropped_traces": 1,
                                 "dropped_subtrees": 2, "dropped_trace_full": 1}
    # and the self-metric says so, by reason
    src = collector_fakes.sources([])
    src.request_totals = t
    fam = next(f for f in collector_fakes.engine(src).families()
               if f.name == "spanlet_request_totals_dropped_subtrees_total")
    assert {dict(x.labels)["reason"]: x.value for x in fam.samples} == {
        "age": 0, "traces": 1, "subtrees": 2, "trace_full": 1}


def test_bytes_of_the_join_are_patched_for_many_spans_and_scopes():
    rs = resource(*[span(n, kind=SERVER, trace=bytes([n]) * 16, cpu=n * 1000) for n in range(1, 40)],
                  *[span(100 + n, n, trace=bytes([n]) * 16, cpu=1) for n in range(1, 40)], scopes=3)
    rs.schema_url = "https://example/schema"
    got = spans_of(apply(RequestTotals(), rs, blobs=[rs.SerializeToString()]))
    assert all(request_attrs(got[n]) == sched(n * 1000 + 1, 0, 0) for n in range(1, 40))


def test_the_span_path_bounds_the_waiting_subtrees_as_configured():
    cfg = config.load(env={"SPANLET_JOIN_REQUEST_TOTALS_TTL_S": "5"}, overrides=[
        "otlp.grpc_port=0", "otlp.http_port=0", "join.request_totals_max_traces=20",
        "join.request_totals_max_subtrees=30", "join.request_totals_max_subtrees_per_trace=4"])
    t = SpanPath(cfg).request_totals
    assert (t.max_traces, t.max_subtrees, t.max_subtrees_per_trace, t.ttl_s) == (20, 30, 4, 5.0)
    with pytest.raises(Exception):
        config.load(env={}, overrides=["join.request_totals_max_subtrees_per_trace=0"])


def test_the_span_path_puts_totals_on_before_metrics_and_export_see_them():
    cfg = config.load(env={}, overrides=["otlp.grpc_port=0", "otlp.http_port=0"])
    seen = []
    lock = threading.Lock()

    def on_joined(resource_spans, blobs):
        with lock:
            for rs, blob in zip(resource_spans, blobs):
                assert trace_pb2.ResourceSpans.FromString(blob).scope_spans == rs.scope_spans
                seen.extend(s for ss in rs.scope_spans for s in ss.spans)

    path = SpanPath(cfg, on_joined=on_joined)
    exported = []
    path.exporter.export = lambda resource_spans: exported.extend(
        s for rs in resource_spans for ss in rs.scope_spans for s in ss.spans)
    path.on_request(ExportTraceServiceRequest(resource_spans=[resource(span(2, 1, cpu=20, rq=3))]))
    path.on_request(ExportTraceServiceRequest(resource_spans=[resource(span(1, kind=SERVER, cpu=100))]))
    server = [s for s in seen if s.kind == SERVER]
    assert [request_attrs(s) for s in server] == [sched(120, 3, 0)]
    assert [request_attrs(s) for s in exported if s.kind == SERVER] == [sched(120, 3, 0)]
    assert path.request_totals.stats.summed == 1


@pytest.mark.parametrize("bad", [b"\x12\x05\x12\x03abc", b"\x12\x7f", b"\x0f"])
def test_bytes_that_are_not_a_resource_are_left_alone(bad):
    t = RequestTotals()
    rs = resource(span(1, kind=SERVER, cpu=1))
    blobs = [bad + b"\x4a\x17\x0a\x13kernel.sched.cpu_ns\x12\x02\x18\x01"]
    t.apply([rs], blobs)
    assert not request_attrs(rs.scope_spans[0].spans[0]) and t.waiting() == (0, 0)


def test_every_summed_key_is_seen_by_the_resource_check():
    keys = [key.encode() for _, keys in TOTALS for key in keys]
    assert all(any(mark in key for mark in _MARKS) for key in keys)
    assert not any(mark in b"kernel.gpu.launches kernel.gpu.sync_wait_ns" for mark in _MARKS)


def test_a_held_request_gets_its_joined_facts_and_step_shares_summed():
    """The real join (a stand-in facts map): a request held for its batched
    step is summed once released, the step's share in it."""
    cfg = config.load(env={}, overrides=["join.batch_wait_s=30", "otlp.grpc_port=0", "otlp.http_port=0"])
    seen = []
    path = SpanPath(cfg, on_joined=lambda resource_spans, blobs: seen.extend(
        s for rs in resource_spans for ss in rs.scope_spans for s in ss.spans))
    path.exporter.export = lambda resource_spans: None
    path.join.facts = facts = FakeFacts()
    step = trace_pb2.Span(trace_id=T2, span_id=sid(900), name="step")
    step.links.add(trace_id=T1, span_id=sid(1))
    facts.add(T2, 900, driver=1, cpu_ns=1000)
    facts.add(T1, 1, cpu_ns=100, runqueue_ns=4)
    facts.add(T1, 2, cpu_ns=20)
    try:
        path.on_request(ExportTraceServiceRequest(resource_spans=[resource(step)]))
        path.on_request(ExportTraceServiceRequest(resource_spans=[resource(
            trace_pb2.Span(trace_id=T1, span_id=sid(2), parent_span_id=sid(1), name="child"),
            trace_pb2.Span(trace_id=T1, span_id=sid(1), kind=SERVER, name="request"))]))
        assert path.held_requests() == 1 and len(seen) == 1
        path.release_held()
    finally:
        path.release_held()
    (server,) = [s for s in seen if s.kind == SERVER]
    assert request_attrs(server) == sched(1120, 4, 0)
