"""The span join's common case done in C on a resource's bytes
(SpanFacts.join_resource, native/spanlet_wire.c) against the real span facts
map: for random requests (many resources and scopes, spans with and without
rows, every mix of facts, ids reused across traces) the spans, the cgroups,
the rows left in the map and the join's counts are exactly those of the
span-by-span Python join over the same rows; the cases it leaves to Python
(links, facts already on a span, malformed ids) take nothing."""

from __future__ import annotations

import random

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from facts_fakes import FakeFacts
from spanlet import config
from spanlet.join import SpanJoin

pytestmark = pytest.mark.kernel

FIELDS = ("launches_driver", "launches_runtime", "launch_ns", "sync_wait_ns", "syncs", "violations",
          "graph_launches", "graph_kernels")


def _request(rnd: random.Random, trace_ids: list[bytes]) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    for r in range(rnd.randint(1, 4)):
        rs = req.resource_spans.add()
        rs.resource.attributes.add(key="service.name").value.string_value = f"svc-{r}"
        rs.schema_url = rnd.choice(["", "https://opentelemetry.io/schemas/1.21.0"])
        for _ in range(rnd.randint(0, 3)):
            ss = rs.scope_spans.add()
            ss.scope.name = rnd.choice(["a", "", "x" * 200])
            for _ in range(rnd.randint(0, 40)):
                s = ss.spans.add(name=rnd.choice(["infer", "", "n" * 300]),
                                 trace_id=rnd.choice(trace_ids), span_id=rnd.randbytes(8),
                                 kind=rnd.randint(0, 5), start_time_unix_nano=rnd.getrandbits(62),
                                 end_time_unix_nano=rnd.getrandbits(62))
                for j in range(rnd.randint(0, 3)):
                    s.attributes.add(key=f"k{j}").value.string_value = "v" * rnd.randint(0, 200)
                if rnd.random() < 0.2:
                    s.events.add(name="e", time_unix_nano=5)
    return req


def _put_rows(rnd: random.Random, req, table, fake: FakeFacts) -> None:
    """Rows for about two spans in three (and rows for spans that are not here)."""
    spans = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    others = [(rnd.randbytes(16), rnd.getrandbits(64)) for _ in range(5)]
    for trace_id, span_id in [(bytes(s.trace_id), int.from_bytes(s.span_id, "big")) for s in spans
                              if rnd.random() < 0.66] + others:
        vals = {f: rnd.choice([0, 0, 1, 7, 2 ** 40, 2 ** 61 - 1]) for f in FIELDS}
        cgroup = rnd.choice([0, 1, 4242, 2 ** 40 + 3])
        k, v = table.Key(), table.Leaf()
        k.trace_id[:] = list(trace_id)
        k.span_id = span_id
        for f, x in vals.items():
            setattr(v, f, x)
        v.cgroup_id, v.first_ns, v.pid = cgroup, 10, 1
        table[k] = v
        fake.add(trace_id, span_id, driver=vals["launches_driver"], runtime=vals["launches_runtime"],
                 **{f: vals[f] for f in FIELDS[2:]}, cgroup_id=cgroup)


def _left(table) -> set:
    return {(bytes(k.trace_id), k.span_id) for k in table.keys()}


def _clear(table) -> None:
    for k in list(table.keys()):
        del table[k]


@pytest.fixture
def span(probes):
    return probes.span_ctx()


@pytest.mark.parametrize("seed", range(12))
def test_the_c_join_is_the_python_join(span, seed):
    rnd = random.Random(seed)
    table, cfg = span.facts.table, config.load(env={}).join
    _clear(table)
    trace_ids = [rnd.randbytes(16) for _ in range(3)]     # few traces: span ids meet across them
    req = _request(rnd, trace_ids)
    fake = FakeFacts()
    _put_rows(rnd, req, table, fake)
    c_req, py_req = ExportTraceServiceRequest(), ExportTraceServiceRequest()
    c_req.CopyFrom(req)
    py_req.CopyFrom(req)
    in_c, in_py = SpanJoin(cfg, facts=span.facts), SpanJoin(cfg, facts=fake)
    taken_before = span.facts.stats().taken
    c_cgroups = in_c.join(c_req.resource_spans)
    py_cgroups = in_py.join(py_req.resource_spans)
    assert c_req == py_req
    assert c_cgroups == py_cgroups
    assert _left(table) == set(fake.map)
    assert in_c.stats.as_dict() == in_py.stats.as_dict()
    assert list(in_c._done) == list(in_py._done)
    assert span.facts.stats().taken - taken_before == fake.st.taken
    _clear(table)


@pytest.mark.parametrize("case", ["link", "facts already", "short span id", "no trace id", "bad bytes"])
def test_what_the_c_join_leaves_to_python_takes_nothing(span, case):
    rnd = random.Random(case)
    table = span.facts.table
    _clear(table)
    req = _request(rnd, [rnd.randbytes(16)])
    rs = req.resource_spans.add()
    s = rs.scope_spans.add().spans.add(name="odd", trace_id=rnd.randbytes(16), span_id=rnd.randbytes(8))
    fake = FakeFacts()
    _put_rows(rnd, req, table, fake)
    before = _left(table)
    if case == "link":
        s.links.add(trace_id=rnd.randbytes(16), span_id=rnd.randbytes(8))
    elif case == "facts already":
        s.attributes.add(key="kernel.gpu.launches").value.int_value = 3
    elif case == "short span id":
        s.span_id = b"\x01\x02"
    elif case == "no trace id":
        s.ClearField("trace_id")
    if case == "bad bytes":
        blob = rs.SerializeToString()[:-3]          # a length past the end
    else:
        blob = rs.SerializeToString()
    assert span.facts.join_resource(blob) is None
    assert _left(table) == before
    _clear(table)
