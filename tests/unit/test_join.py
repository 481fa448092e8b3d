"""The span join: kernel facts rows taken per span (a fake facts map), sampled
events as span events in a bounded buffer, late and expired rows, coverage."""

import time

from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet import events
from spanlet.config import JoinConfig
from spanlet.join import LATE_SPAN_NAME, SpanJoin
from facts_fakes import FakeFacts

TRACE = bytes(range(1, 17))


def launch(span_id, duration_ns=1000, trace=TRACE, ts=1):
    ev = events.GpuLaunch()
    ev.hdr.kind = events.Kind.GPU_LAUNCH
    ev.hdr.span_id = span_id
    ev.hdr.trace_id[:] = list(trace)
    ev.duration_ns = duration_ns
    ev.entry = events.Entry.cuLaunchKernel
    ev.grid[:] = [2, 1, 1]
    ev.epoch_ns = ts
    return ev


def sync(span_id, duration_ns):
    ev = events.GpuSync()
    ev.hdr.kind = events.Kind.GPU_SYNC
    ev.hdr.span_id = span_id
    ev.hdr.trace_id[:] = list(TRACE)
    ev.duration_ns = duration_ns
    ev.entry = events.Entry.cudaDeviceSynchronize
    return ev


def request(*span_ids, trace=TRACE):
    spans = [trace_pb2.Span(trace_id=trace, span_id=s.to_bytes(8, "big"), name=f"s{s}")
             for s in span_ids]
    return [trace_pb2.ResourceSpans(scope_spans=[trace_pb2.ScopeSpans(spans=spans)])]


def attrs(span):
    return {kv.key: kv.value.int_value for kv in span.attributes}


def test_each_span_gets_exactly_its_own_facts():
    facts = FakeFacts()
    facts.add(TRACE, 7, driver=2, runtime=1, launch_ns=300, sync_wait_ns=5000, syncs=1, cgroup_id=5)
    facts.add(TRACE, 8, driver=1)
    j = SpanJoin(JoinConfig(max_span_events=2), facts=facts)
    for _ in range(3):
        j.add_event(launch(7, 100))           # sampled records: span events, never counts
    j.add_event(sync(7, 5000))
    rs = request(7, 8, 9)
    assert j.join(rs) == [5]                  # the cgroup of span 7's row
    s7, s8, s9 = rs[0].scope_spans[0].spans
    assert attrs(s7) == {"kernel.gpu.launches": 3, "kernel.gpu.launch_ns": 300,
                         "kernel.gpu.sync_wait_ns": 5000, "kernel.gpu.syncs": 1}
    assert len(s7.events) == 2 and s7.dropped_events_count == 2   # capped at 2
    assert s7.events[0].name == "kernel.gpu.launch"
    assert attrs(s8) == {"kernel.gpu.launches": 1}
    assert attrs(s9) == {}
    assert j.coverage() == (2 / 3, 1.0)
    assert j.pending_events() == 0
    assert facts.map == {} and facts.takes == 3     # one take per span, rows gone
    assert j.stats.rows_taken == 2


def test_facts_add_to_attributes_a_span_already_carries():
    """A span that comes with facts attributes (joined by another agent on the
    way, or set by the app) has them summed, one attribute each; its
    neighbours in the resource get theirs as usual."""
    facts = FakeFacts()
    facts.add(TRACE, 7, driver=3)
    facts.add(TRACE, 8, driver=2)
    j = SpanJoin(JoinConfig(), facts=facts)
    rs = request(7, 8)
    s7, s8 = rs[0].scope_spans[0].spans
    s7.attributes.add(key="kernel.gpu.launches").value.int_value = 5
    s7.attributes.add(key="http.route").value.string_value = "/x"
    j.join(rs)
    assert [kv.key for kv in s7.attributes] == ["kernel.gpu.launches", "http.route"]
    assert attrs(s7)["kernel.gpu.launches"] == 8
    assert attrs(s8) == {"kernel.gpu.launches": 2}
    # ...and when the resource carries none, each span gets its own attribute
    facts.add(TRACE, 9, driver=1)
    rs = request(9)
    j.join(rs)
    assert [kv.key for kv in rs[0].scope_spans[0].spans[0].attributes] == ["kernel.gpu.launches"]


def test_every_facts_attribute_has_the_prefix_the_join_searches_for():
    from spanlet.join import _FACT_PREFIX, FACT_ATTRIBUTES
    assert all(key.encode().startswith(_FACT_PREFIX) for key, _ in FACT_ATTRIBUTES)


def test_graph_replays_and_their_kernels_are_span_attributes():
    # a row alone (the fast path) and a row with sampled events (through Facts)
    facts = FakeFacts()
    facts.add(TRACE, 7, driver=2, graph_launches=3, graph_kernels=12)
    facts.add(TRACE, 8, graph_launches=1)
    j = SpanJoin(JoinConfig(), facts=facts)
    j.add_event(launch(8))
    rs = request(7, 8)
    j.join(rs)
    s7, s8 = rs[0].scope_spans[0].spans
    assert attrs(s7) == {"kernel.gpu.launches": 2, "kernel.gpu.graph_launches": 3,
                         "kernel.gpu.graph_kernels": 12}
    # a replay of a graph the agent did not see made: a graph launch, no kernels
    assert attrs(s8) == {"kernel.gpu.graph_launches": 1}


def test_counts_come_from_the_kernel_row_only():
    # sampled events of a span without a row: span events, no counts made of them
    j = SpanJoin(JoinConfig(), facts=FakeFacts())
    for _ in range(5):
        j.add_event(launch(7, 100))
    rs = request(7)
    assert j.join(rs) == [1]
    span = rs[0].scope_spans[0].spans[0]
    assert attrs(span) == {} and len(span.events) == 5


def test_other_trace_with_same_span_id_does_not_join():
    facts = FakeFacts()
    facts.add(b"\x09" * 16, 7, driver=4)
    j = SpanJoin(JoinConfig(), facts=facts)
    j.add_event(launch(7, trace=b"\x09" * 16))
    assert j.join(request(7)) == [0]
    assert facts.spans() == [(b"\x09" * 16, 7)]    # still waiting for its own span
    rs = request(7, trace=b"\x09" * 16)
    assert j.join(rs) == [1] and attrs(rs[0].scope_spans[0].spans[0])["kernel.gpu.launches"] == 4


def test_no_facts_reader_means_no_kernel_facts():
    j = SpanJoin(JoinConfig())
    j.add_event(sync(7, 10))
    rs = request(7)
    assert j.join(rs) == [1] and attrs(rs[0].scope_spans[0].spans[0]) == {}
    assert j.sweep(force=True) == 0 and j.facts_stats() is None


def test_buffer_is_bounded_and_evictions_counted():
    j = SpanJoin(JoinConfig(buffer_events=100))
    for span in range(1, 1001):
        j.add_event(launch(span))
    assert j.pending_events() == 100
    assert j.stats.events_evicted == 900
    assert j.join(request(1000)) == [1]      # the newest are kept
    assert j.join(request(1)) == [0]


def test_ttl_evicts_old_events():
    now = [0.0]
    j = SpanJoin(JoinConfig(ttl_s=5), clock=lambda: now[0])
    j.add_event(launch(1))
    now[0] = 6.0
    j.add_event(launch(2))
    assert j.stats.events_evicted == 1
    assert j.join(request(1)) == [0] and j.join(request(2)) == [1]


def test_sampled_event_after_its_span_is_counted_not_kept():
    j = SpanJoin(JoinConfig())
    j.join(request(7))
    j.add_event(launch(7))
    assert j.pending_events() == 0 and j.stats.events_evicted == 1


def test_late_facts_become_their_own_record():
    out = []
    facts = FakeFacts()
    j = SpanJoin(JoinConfig(), facts=facts, on_late=out.extend)
    j.join(request(7))
    # a thread still working for span 7 after it was passed on: a new row
    facts.add(TRACE, 7, driver=2, launch_ns=42, cgroup_id=99, first_ns=123)
    facts.add(TRACE, 8, driver=1, first_ns=time.time_ns())   # span 8 has not come yet
    assert j.sweep(force=True) == 1
    assert j.flush_late() == 1
    ((cgroup, rs),) = out
    assert cgroup == 99
    (late,) = rs.scope_spans[0].spans
    assert late.name == LATE_SPAN_NAME and late.start_time_unix_nano == 123
    assert late.trace_id == TRACE and late.parent_span_id == (7).to_bytes(8, "big")
    assert attrs(late) == {"kernel.gpu.launches": 2, "kernel.gpu.launch_ns": 42}
    assert j.flush_late() == 0 and j.stats.late_records == 1 and j.stats.rows_late == 1
    assert facts.spans() == [(TRACE, 8)]


def test_rows_whose_span_never_comes_expire_after_ttl():
    facts = FakeFacts()
    j = SpanJoin(JoinConfig(ttl_s=30), facts=facts)
    facts.add(TRACE, 1, driver=1, first_ns=time.time_ns() - 31 * 10**9)
    facts.add(TRACE, 2, driver=1, first_ns=time.time_ns() - 29 * 10**9)
    assert j.sweep(force=True) == 1
    assert facts.spans() == [(TRACE, 2)] and j.stats.rows_expired == 1
    assert facts.stats().swept == 1


def test_sweep_reads_the_map_at_most_every_interval():
    now = [100.0]
    facts = FakeFacts()
    reads = []
    ages = facts.ages
    facts.ages = lambda: reads.append(now[0]) or ages()
    j = SpanJoin(JoinConfig(sweep_interval_s=2), facts=facts, clock=lambda: now[0])
    for t in range(20):
        now[0] = 100.0 + t * 0.5
        j.sweep()
    assert reads == [100.0, 102.0, 104.0, 106.0, 108.0]


def test_events_without_span_are_not_buffered():
    j = SpanJoin(JoinConfig())
    j.add_event(launch(0))
    assert j.pending_events() == 0 and j.stats.events_in == 0


def test_flood_of_events_whose_spans_never_come_keeps_memory_flat():
    import gc
    import tracemalloc

    j = SpanJoin(JoinConfig(buffer_events=2_000, ttl_s=3600))
    tracemalloc.start()
    used = []
    for flood in range(3):
        for span in range(1 + flood * 20_000, 20_001 + flood * 20_000):
            j.add_event(launch(span))
        gc.collect()
        used.append(tracemalloc.get_traced_memory()[0])
    tracemalloc.stop()
    assert j.pending_events() == 2_000
    assert j.stats.events_evicted == 58_000
    # a full buffer is a few MB; further floods replace it without growth
    assert abs(used[2] - used[1]) < 0.05 * used[1], used


def http_event(trace, parent, flow_port=40000):
    ev = events.HttpRequest()
    ev.hdr.kind = events.Kind.HTTP
    ev.hdr.trace_id[:] = list(trace)
    ev.hdr.span_id = parent
    ev.hdr.flags = events.HttpRequest.HAS_TRACEPARENT
    ev.flow.sport, ev.flow.dport, ev.flow.family = flow_port, 80, 4
    return ev


def http_bytes(trace, parent, ingress, egress, req_dir=0):
    ev = events.HttpBytes()
    ev.hdr.kind = events.Kind.HTTP_BYTES
    ev.hdr.trace_id[:] = list(trace)
    ev.hdr.span_id = parent
    ev.bytes[:] = [ingress, egress]
    ev.req_dir = req_dir
    return ev


def server_span(span_id, parent, trace=TRACE):
    sp = trace_pb2.Span(trace_id=trace, span_id=span_id.to_bytes(8, "big"),
                        parent_span_id=parent.to_bytes(8, "big"), name="server", kind=2)
    return [trace_pb2.ResourceSpans(scope_spans=[trace_pb2.ScopeSpans(spans=[sp])])]


def test_server_span_gets_the_bytes_of_its_finished_request():
    j = SpanJoin(JoinConfig())
    j.add_event(http_event(TRACE, 0xC1))
    j.add_event(http_bytes(TRACE, 0xC1, ingress=700, egress=9000, req_dir=0))
    rs = server_span(0x51, parent=0xC1)
    assert j.join(rs) == [1]
    a = attrs(rs[0].scope_spans[0].spans[0])
    assert a["kernel.net.rx_bytes"] == 700 and a["kernel.net.tx_bytes"] == 9000
    # a span of another trace with the same parent id gets nothing
    j.add_event(http_bytes(TRACE, 0xC2, 1, 1))
    assert j.join(server_span(0x52, parent=0xC2, trace=b"\x07" * 16)) == [0]


def test_request_still_in_progress_is_read_live_and_checked():
    j = SpanJoin(JoinConfig())
    seen = []

    def reader(flow):
        seen.append(flow.sport)
        return TRACE, 0xC3, (300, 4000)

    j.http_bytes_reader = reader
    j.add_event(http_event(TRACE, 0xC3, flow_port=41000))
    rs = server_span(0x53, parent=0xC3)
    j.join(rs)
    a = attrs(rs[0].scope_spans[0].spans[0])
    assert (a["kernel.net.rx_bytes"], a["kernel.net.tx_bytes"]) == (300, 4000)
    assert seen == [41000]
    # the connection moved on to another request: no bytes are misattributed
    j.http_bytes_reader = lambda flow: (TRACE, 0xDEAD, (1, 1))
    j.add_event(http_event(TRACE, 0xC4))
    assert j.join(server_span(0x54, parent=0xC4)) == [0]


# -- the memory of spans already passed on is bounded by ttl_s ----------------

def test_late_row_within_ttl_is_late_and_after_ttl_waits_for_its_span():
    now = [0.0]
    out = []
    facts = FakeFacts()
    j = SpanJoin(JoinConfig(ttl_s=5), facts=facts, on_late=out.extend, clock=lambda: now[0])
    j.join(request(7, 8))
    now[0] = 4.0
    facts.add(TRACE, 7, driver=1, first_ns=time.time_ns())   # within ttl_s of its span: late
    j.sweep(force=True)
    now[0] = 6.0
    facts.add(TRACE, 8, driver=1, first_ns=time.time_ns())   # span 8 passed on 6 s ago: forgotten
    j.sweep(force=True)
    assert j.flush_late() == 1 and len(out) == 1
    assert facts.spans() == [(TRACE, 8)] and j.stats.late_records == 1
    assert j.join(request(8)) == [1] and facts.map == {}


def test_rejoined_span_is_remembered_from_its_last_pass():
    now = [0.0]
    facts = FakeFacts()
    j = SpanJoin(JoinConfig(ttl_s=5), facts=facts, clock=lambda: now[0])
    j.join(request(1, 2))
    now[0] = 4.0
    j.join(request(1))                            # span 1 again: its age restarts
    now[0] = 7.0
    j.join(request(3))                            # evicts what is older than 2.0: span 2 only
    facts.add(TRACE, 1, driver=1, first_ns=time.time_ns())
    facts.add(TRACE, 2, driver=1, first_ns=time.time_ns())
    assert j.sweep(force=True) == 1
    assert j.flush_late() == 1 and facts.spans() == [(TRACE, 2)]


def test_steady_span_stream_keeps_memory_of_passed_spans_flat():
    import gc
    import tracemalloc

    now = [0.0]
    j = SpanJoin(JoinConfig(ttl_s=5, buffer_events=1_000_000), clock=lambda: now[0])
    tracemalloc.start()
    used = []
    span = 0
    for second in range(60):                      # 200 spans/s for 60 simulated seconds
        now[0] = float(second)
        for _ in range(4):
            j.join(request(*range(span + 1, span + 51)))
            span += 50
        if second in (20, 40, 59):
            gc.collect()
            used.append(tracemalloc.get_traced_memory()[0])
    tracemalloc.stop()
    # ttl_s of spans (~1,200 here), not one entry per span ever seen
    assert abs(used[2] - used[1]) < 0.05 * used[1], used
    assert abs(used[1] - used[0]) < 0.05 * used[0], used


def test_a_real_loss_of_records_still_lowers_the_event_coverage():
    """Metric #17's what=events: records whose span never came (gone after
    ttl_s) and records that came after their span are losses, below the
    0.95 threshold; the records that met their span are the rest."""
    now = [0.0]
    j = SpanJoin(JoinConfig(ttl_s=5), clock=lambda: now[0])
    j.add_event(launch(7))
    j.join(request(7))                     # met its span
    j.add_event(launch(7))                 # after its span: lost
    j.add_event(launch(8))                 # its span never comes
    j.add_event(launch(8))
    assert j.coverage() == (1.0, 1 / 2)    # settled so far: 1 joined, 1 late
    now[0] = 6.0
    j.add_event(launch(9))                 # the expiry sweep runs as records come
    assert j.coverage() == (1.0, 1 / 4)
    assert j.stats.events_evicted == 3
