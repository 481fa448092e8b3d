"""The span join's common case done in C on a resource's bytes
(SpanFacts.join_resource, native/spanlet_wire.c) against the real span facts
map: for random requests (many resources and scopes, spans with and without
rows, every mix of facts, ids reused across traces, rows of one to six
cgroups for one span, a sender's origin known or not) the spans, the
cgroups, the rows left in the map and the join's counts (foreign rows by
reason and cgroup included) are exactly those of the span-by-span Python
join over the same rows, through the real map and through the fake, and so
are the store's rows made from the bytes it leaves (SpanJoin.join's blobs); the
cases it leaves to Python (links, facts already on a span, malformed ids)
take nothing."""

from __future__ import annotations

import random

import pytest
from spanlet.probes import span_facts as span_facts_mod
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from facts_fakes import FakeFacts
from google.protobuf.message import DecodeError
from wire_gen import mutate
from spanlet import config
from spanlet.exporters.clickhouse import rows
from spanlet.join import MEMORY_FIELDS, SpanJoin

pytestmark = pytest.mark.kernel

FIELDS = ("launches_driver", "launches_runtime", "launch_ns", "sync_wait_ns", "syncs", "violations",
          "graph_launches", "graph_kernels", "cpu_ns", "runqueue_ns", "blocked_ns", "iowait_ns", "switches",
          "preemptions", *MEMORY_FIELDS)


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


CGROUPS = [0, 1, 4242, 4243, 2 ** 40 + 3, 77, 78]


def _plan(rnd: random.Random, req) -> list:
    """Rows for about two spans in three (and rows for spans that are not
    here): (trace id, span id, [(cgroup, facts)]) with one cgroup mostly,
    up to six (past the index's four), facts small enough to tie at times."""
    spans = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    others = [(rnd.randbytes(16), rnd.getrandbits(64)) for _ in range(5)]
    plan = []
    for trace_id, span_id in [(bytes(s.trace_id), int.from_bytes(s.span_id, "big")) for s in spans
                              if rnd.random() < 0.66] + others:
        n = rnd.choice([1, 1, 1, 2, 3, 5, 6])
        cgs = rnd.sample(CGROUPS, n)
        plan.append((trace_id, span_id, [
            (cg, {f: rnd.choice([0, 0, 1, 2, 7, 2 ** 40]) for f in FIELDS}) for cg in cgs]))
    return plan


def _put_rows(plan, span, fake: FakeFacts | None = None) -> None:
    for trace_id, span_id, cg_rows in plan:
        for cg, vals in cg_rows:
            span.facts.put_row(trace_id, span_id, cg, first_ns=10, pid=1, **vals)
            if fake is not None:
                fake.add(trace_id, span_id, driver=vals["launches_driver"],
                         runtime=vals["launches_runtime"], **{f: vals[f] for f in FIELDS[2:]},
                         cgroup_id=cg)


def _left(table) -> set:
    return {(bytes(k.trace_id), k.span_id, k.cgroup_id) for k in table.keys()}


def _clear(span) -> None:
    for table in (span.facts.table, span.facts.index):
        for k in list(table.keys()):
            del table[k]


@pytest.fixture
def span(probes):
    return probes.span_ctx()


ORIGINS = [None, None, frozenset({4242}), frozenset({4242, 4243}), frozenset({77, 1}),
           frozenset({5})]


@pytest.mark.parametrize("seed", range(24))
def test_the_c_join_is_the_python_join(span, seed, monkeypatch):
    rnd = random.Random(seed)
    trace_ids = [rnd.randbytes(16) for _ in range(3)]     # few traces: span ids meet across them
    req = _request(rnd, trace_ids)
    assert _compare(span, rnd, req, ORIGINS[seed % len(ORIGINS)], monkeypatch)


@pytest.mark.parametrize("seed", range(24))
def test_the_c_join_is_the_python_join_on_mutated_requests(span, seed, monkeypatch):
    """Differential fuzzing: requests whose bytes were mutated (what a parse
    keeps of them: unknown fields, groups, odd ids and lengths) join the same
    in C as in Python."""
    rnd = random.Random(1000 + seed)
    joined = tries = 0
    while joined < 3 and tries < 200:
        tries += 1
        data = mutate(rnd, _request(rnd, [rnd.randbytes(16) for _ in range(3)]).SerializeToString())
        try:
            req = ExportTraceServiceRequest.FromString(data)
        except (DecodeError, ValueError, RecursionError):
            continue
        joined += _compare(span, rnd, req, ORIGINS[seed % len(ORIGINS)], monkeypatch)
    assert joined == 3, tries        # mutants that parse and join in C


def _compare(span, rnd: random.Random, req, origin, monkeypatch) -> bool:
    """The C join, the Python join through the real map and through the fake
    give the same spans, rows left, counts and store rows; whether C joined any."""
    table, cfg = span.facts.table, config.load(env={}).join
    _clear(span)
    plan = _plan(rnd, req)
    fake = FakeFacts(index_cgroups=4)
    _put_rows(plan, span, fake)
    c_req, py_req, real_req = (ExportTraceServiceRequest() for _ in range(3))
    for r in (c_req, py_req, real_req):
        r.CopyFrom(req)
    in_c, in_py, in_real = (SpanJoin(cfg, facts=f) for f in (span.facts, fake, span.facts))
    taken_before = span.facts.stats().taken
    c_blobs, real_blobs = [], []
    c_cgroups = in_c.join(c_req.resource_spans, origin=origin, blobs=c_blobs)
    c_left = _left(table)
    # the Python join through the real map's reader, span by span (no C part)
    _clear(span)
    _put_rows(plan, span)
    with monkeypatch.context() as m:
        m.setattr(span_facts_mod, "_join_resource", None)
        real_cgroups = in_real.join(real_req.resource_spans, origin=origin, blobs=real_blobs)
    py_cgroups = in_py.join(py_req.resource_spans, origin=origin)
    assert c_req == py_req == real_req
    assert c_cgroups == py_cgroups == real_cgroups
    assert c_left == _left(table) == set(fake.map)
    assert in_c.stats.as_dict() == in_py.stats.as_dict() == in_real.stats.as_dict()
    assert in_c.foreign() == in_py.foreign() == in_real.foreign()
    assert list(in_c._done) == list(in_py._done) == list(in_real._done)
    assert (span.facts.stats().taken - taken_before) // 2 == fake.st.taken
    # the store's rows from the C join's bytes: the joined spans' rows; the Python join gives none
    assert len(c_blobs) == len(real_blobs) == len(req.resource_spans) and set(real_blobs) <= {None}
    assert rows.rows_from_span_protos(rows.span_proto_rows(c_req.resource_spans, c_blobs)) == \
        rows.span_rows(py_req.resource_spans)
    _clear(span)
    return any(b is not None for b in c_blobs)


def test_the_joins_see_rows_of_many_cgroups_and_foreign_ones(span):
    """The random requests above do meet every rule (checked once here)."""
    seen = {"other_pod": 0, "conflict": 0, "overflow origin": 0}
    for seed in range(24):
        rnd = random.Random(seed)
        req = _request(rnd, [rnd.randbytes(16) for _ in range(3)])
        plan, origin = _plan(rnd, req), ORIGINS[seed % len(ORIGINS)]
        fake = FakeFacts(index_cgroups=4)
        _put_rows(plan, span, fake)
        _clear(span)
        j = SpanJoin(config.load(env={}).join, facts=fake)
        j.join(req.resource_spans, origin=origin)
        seen["other_pod"] += j.stats.foreign_other_pod
        seen["conflict"] += j.stats.foreign_conflict
        seen["overflow origin"] += bool(origin) and any(
            len(rows) > 4 and {cg for cg, _ in rows[4:]} & origin for _, _, rows in plan)
    assert all(seen.values()), seen


@pytest.mark.parametrize("case", ["link", "facts already", "short span id", "no trace id", "bad bytes"])
def test_what_the_c_join_leaves_to_python_takes_nothing(span, case):
    rnd = random.Random(case)
    table = span.facts.table
    _clear(span)
    req = _request(rnd, [rnd.randbytes(16)])
    rs = req.resource_spans.add()
    s = rs.scope_spans.add().spans.add(name="odd", trace_id=rnd.randbytes(16), span_id=rnd.randbytes(8))
    _put_rows(_plan(rnd, req), span)
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
    assert span.facts.join_resource(blob, frozenset({4242})) is None
    assert _left(table) == before
    _clear(span)


@pytest.mark.parametrize("path", ["c", "python"])
def test_an_index_entry_that_lost_a_slot_still_gives_the_sender_its_row(span, path, monkeypatch):
    """Two CPUs making rows for one span at once may write one index slot
    twice (n = 2, one cgroup listed): the sender's row is looked up directly,
    another cgroup's unlisted row waits for the sweep."""
    if path == "python":
        monkeypatch.setattr(span_facts_mod, "_join_resource", None)
    _clear(span)
    rnd = random.Random(path)
    trace_id, span_id = rnd.randbytes(16), rnd.getrandbits(63) | 1
    for cg, n in ((4242, 100), (77, 6), (78, 9)):
        span.facts.put_row(trace_id, span_id, cg, launches_driver=n)
    index = span.facts.index
    ik = index.Key()
    ik.trace_id[:] = list(trace_id)
    ik.span_id = span_id
    iv = index[ik]
    iv.cgroups[1], iv.cgroups[2], iv.n = 4242, 0, 3      # 77 and 78 lost to the race
    index[ik] = iv
    join = SpanJoin(config.load(env={}).join, facts=span.facts)
    req = ExportTraceServiceRequest()
    req.resource_spans.add().scope_spans.add().spans.add(
        trace_id=trace_id, span_id=span_id.to_bytes(8, "big"))
    join.join(req.resource_spans, origin=frozenset({77}))
    (s,) = req.resource_spans[0].scope_spans[0].spans
    assert {kv.key: kv.value.int_value for kv in s.attributes} == {"kernel.gpu.launches": 6}
    assert join.foreign() == {4242: 1}
    # the other pod's row stays for its own span; 78's, unlisted, for the sweep
    assert _left(span.facts.table) == {(trace_id, span_id, 4242), (trace_id, span_id, 78)}
    _clear(span)
