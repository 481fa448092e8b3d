"""The admin state's ring of recent spans (what `spanlet inspect spans` shows):
the newest RING_SPANS spans over any number of requests, oldest first, each
with its own resource and arrival time."""

from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet.admin import RING_SPANS, AdminState


def request(first: int, spans_per_scope: list[int], pod: str) -> list[trace_pb2.ResourceSpans]:
    rs = trace_pb2.ResourceSpans()
    rs.resource.attributes.add(key="k8s.pod.name").value.string_value = pod
    n = first
    for count in spans_per_scope:
        ss = rs.scope_spans.add()
        for _ in range(count):
            ss.spans.add(name=f"s{n}", span_id=n.to_bytes(8, "big"), trace_id=b"\1" * 16)
            n += 1
    return [rs]


def test_the_newest_spans_are_kept_across_requests_oldest_first():
    st = AdminState()
    assert st.spans == []
    st.on_joined(request(0, [3, 0, 2], "a"))
    assert [s.name for _, s, _ in st.spans] == ["s0", "s1", "s2", "s3", "s4"]
    st.on_joined(request(5, [RING_SPANS - 2], "b"))
    st.on_joined(request(5 + RING_SPANS - 2, [4], "c"))
    got = st.spans
    assert len(got) == RING_SPANS
    assert [s.name for _, s, _ in got] == [f"s{i}" for i in range(RING_SPANS + 7 - RING_SPANS,
                                                                     RING_SPANS + 7)]
    pods = [res.attributes[0].value.string_value for res, _, _ in got]
    assert pods[0] == "b" and pods[-1] == "c" and pods.count("c") == 4
    assert len(st._chunks) <= 3          # lists wholly older than the ring are let go
    _, rows, _ = st.snapshot()
    assert len(rows) == RING_SPANS


def test_one_request_larger_than_the_ring_keeps_its_newest():
    st = AdminState()
    st.on_joined(request(0, [RING_SPANS * 3], "a"))
    assert [s.name for _, s, _ in st.spans][-1] == f"s{RING_SPANS * 3 - 1}"
    assert len(st.spans) == RING_SPANS
    st.on_joined(request(10_000, [1], "b"))
    assert len(st.spans) == RING_SPANS and st.spans[-1][1].name == "s10000"


def _switches(tid: int) -> int:
    for line in open(f"/proc/self/task/{tid}/status"):
        if line.startswith("voluntary_ctxt_switches"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches")


def test_the_admin_thread_sleeps_until_a_client_comes(tmp_path):
    """The rates' history is sampled by the agent's refresh loop (AdminServer.sample), so the
    admin thread wakes for clients and stop() only."""
    import time

    from spanlet import config
    from spanlet.admin import AdminServer
    srv = AdminServer(config.load(env={}), probes=[], names=None, join=None, receiver=None,
                      span_export=None, store=None, nvml=None, memory_peaks=dict, families=list,
                      hints=dict, path=str(tmp_path / "admin.sock"))
    srv.start()
    try:
        tid = srv._thread.native_id
        time.sleep(0.2)
        before = _switches(tid)
        time.sleep(2.5)                     # a thread on a 1 s accept timeout wakes twice
        assert _switches(tid) - before == 0
        srv.sample()
        assert len(srv._history) == 1
    finally:
        srv.stop()
    assert srv._thread is None
