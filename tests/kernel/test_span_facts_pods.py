"""Facts stay in their pod (issue 18) against the real kernel: processes in
cgroups of their own (each a pod here) mark the same or many span ids; the
kernel keeps one row per span and cgroup, the join adds only the rows of the
sender's cgroups, and a cgroup that marks spans that never arrive fills only
its own part of the map."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

import cuda_standin
from facts_child import FactsChild
from gpu_harness import cgroup2_root, cgroup_id, remove_cgroup
from spanlet import config
from spanlet.events import Modality
from spanlet.join import SpanJoin
from spanlet.probes import span_facts as span_facts_mod

pytestmark = pytest.mark.kernel

RUNS = 5


@pytest.fixture
def pods():
    """pod() → a new cgroup v2 group (a pod's container here); every one is
    removed at teardown, once the processes moved into it are gone."""
    made: list[Path] = []

    def pod() -> Path:
        path = cgroup2_root() / f"spanlet-pod-test-{os.getpid()}-{os.urandom(3).hex()}"
        path.mkdir()
        made.append(path)
        return path

    yield pod
    for path in made:
        remove_cgroup(path, tries=100)


def move(pid: int, pod: Path) -> None:
    (pod / "cgroup.procs").write_text(str(pid))


def ids() -> tuple[bytes, int]:
    return secrets.token_bytes(16), int.from_bytes(secrets.token_bytes(8), "big") | 1


def launches(n: int) -> str:
    return f"cu {n} 1 1 1 1 1 1 0 0"


def request(trace_id: bytes, span_id: int) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    req.resource_spans.add().scope_spans.add().spans.add(
        name="infer", trace_id=trace_id, span_id=span_id.to_bytes(8, "big"))
    return req


def launches_on(req: ExportTraceServiceRequest) -> int:
    (span,) = req.resource_spans[0].scope_spans[0].spans
    return {kv.key: kv.value.int_value for kv in span.attributes}.get("kernel.gpu.launches", 0)


def two_pods(standin, spawn, pods, kernel):
    """(span_ctx probe, victim, impostor, their cgroup ids): two stand-in CUDA
    processes, the impostor moved to a cgroup of its own."""
    victim, impostor = spawn(standin.workload), spawn(standin.workload)
    for p in (victim, impostor):
        p.load(standin.lib_dir)
    move(impostor.pid, pods())
    span, _ = kernel()
    return span, victim, impostor, cgroup_id(victim.pid), cgroup_id(impostor.pid)


@pytest.mark.parametrize("path", ["c", "python"])
@pytest.mark.parametrize("rep", range(RUNS))
def test_an_impostor_marking_the_same_ids_adds_nothing(standin, spawn, pods, kernel, rep, path,
                                                       monkeypatch):
    """The victim launches 10 in its span; an impostor in another cgroup marks
    the same trace and span ids and launches 1,000. Joined with the victim's
    origin the span gets exactly 10 and the impostor's row is counted foreign
    (other_pod, its cgroup); with the sender unknown it is a conflict and the
    rule picks the cgroup that did most (here the impostor's: why the
    receiver establishes the origin)."""
    if path == "python":
        monkeypatch.setattr(span_facts_mod, "_join_resource", None)
    span, victim, impostor, v_cg, i_cg = two_pods(standin, spawn, pods, kernel)
    assert v_cg != i_cg
    cfg = config.load(env={}).join
    for origin in (frozenset({v_cg}), None):
        trace_id, span_id = ids()
        span.set(victim.tid, trace_id, span_id, Modality.text)
        span.set(impostor.tid, trace_id, span_id, Modality.text)
        impostor.run(launches(1000))
        victim.run(launches(10))
        for p in (victim, impostor):
            span.clear(p.tid)
        join = SpanJoin(cfg, facts=span.facts)
        req = request(trace_id, span_id)
        cgroups = join.join(req.resource_spans, origin=origin)
        st = join.stats
        if origin is not None:
            assert launches_on(req) == 10 and cgroups == [v_cg]
            assert (st.foreign_other_pod, st.foreign_conflict) == (1, 0)
            assert join.foreign() == {i_cg: 1}
        else:
            assert launches_on(req) == 1000 and cgroups == [i_cg]
            assert (st.foreign_other_pod, st.foreign_conflict) == (0, 1)
            assert join.foreign() == {v_cg: 1}
        assert st.rows_taken == 1 and st.spans_joined == 1
        # the row the span did not get stays, for its own sender's span: it
        # gets exactly that row, and then nothing of this span is left
        left = [r for r in span.facts.rows() if r.trace_id == trace_id]
        other = i_cg if origin is not None else v_cg
        assert [(r.cgroup_id, r.launches) for r in left] == [(other, 1000 if other == i_cg else 10)]
        req = request(trace_id, span_id)
        assert SpanJoin(cfg, facts=span.facts).join(req.resource_spans,
                                                    origin=frozenset({other})) == [other]
        assert launches_on(req) == (1000 if other == i_cg else 10)
        assert [r for r in span.facts.rows() if r.trace_id == trace_id] == []


@pytest.mark.parametrize("rep", range(RUNS))
def test_late_rows_of_another_pod_are_not_the_spans(standin, spawn, pods, kernel, rep):
    """After the victim's span went out, the impostor marks its ids: the
    sweep sends no late record with that row (it stays for the impostor's
    own span, else expires) and still sends the victim's own late launches."""
    span, victim, impostor, v_cg, i_cg = two_pods(standin, spawn, pods, kernel)
    late: list = []
    join = SpanJoin(config.load(env={}).join, facts=span.facts, on_late=late.extend)
    trace_id, span_id = ids()
    join.join(request(trace_id, span_id).resource_spans, origin=frozenset({v_cg}))
    for p, n in ((impostor, 500), (victim, 3)):
        span.set(p.tid, trace_id, span_id, Modality.text)
        p.run(launches(n))
        span.clear(p.tid)
    join.sweep(force=True)
    assert join.flush_late() == 1
    ((cg, rs),) = late
    (rec,) = rs.scope_spans[0].spans
    assert cg == v_cg
    assert {kv.key: kv.value.int_value for kv in rec.attributes}["kernel.gpu.launches"] == 3
    assert join.stats.foreign_other_pod == 0 and join.foreign() == {}
    assert [(r.cgroup_id, r.launches) for r in span.facts.rows() if r.trace_id == trace_id] == \
        [(i_cg, 500)]
    span.facts.take_rows(trace_id, span_id)         # the test's own: nothing left behind


def attach_marker(span, pid: int, timeout_s: float = 20) -> None:
    """Refresh discovery until the marker library `pid` maps is attached (one
    uprobe per library file: another process may have brought it first)."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    path = next(line.split()[-1] for line in maps if "libspanlet_marker" in line)
    st = os.stat(path)
    deadline = time.monotonic() + timeout_s
    while not any(lib.key == (st.st_dev, st.st_ino) for lib in span.libraries):
        assert time.monotonic() < deadline, f"marker of {pid} not attached: {span.status}"
        time.sleep(0.1)
        span.refresh()


FLOOD_SPANS = 100_000
PER_CGROUP = 1000


@pytest.mark.parametrize("rep", range(RUNS))
def test_a_pod_marking_spans_that_never_arrive_starves_only_itself(standin, spawn, pods, kernel,
                                                                   rep):
    """A child in its own cgroup marks and launches for 100,000 spans that are
    never exported (the real marker); a victim in another cgroup, during and
    after, has every span's row there and exact; the kernel refused the
    flood's rows past its bound, counted against the flood's cgroup only."""
    victim = spawn(standin.workload)
    victim.load(standin.lib_dir)            # the flood loads the same file: one uprobe for both
    span, _ = kernel(f"join.span_facts_max_per_cgroup={PER_CGROUP}")
    v_cg = cgroup_id(victim.pid)
    flood_pod = pods()
    with FactsChild("localhost:1", standin.lib_dir / cuda_standin.DRIVER, "none") as flood:
        move(flood.pid, flood_pod)
        f_cg = cgroup_id(flood.pid)
        attach_marker(span, flood.pid)
        marks0 = span.marks()
        flood.proc.stdin.write(f"marks {FLOOD_SPANS}\n")
        flood.proc.stdin.flush()
        expected = {}
        for i in range(40):                       # while the flood runs, then after it
            key = ids()
            span.set(victim.tid, *key, Modality.video)
            victim.run(launches(i + 1))
            span.clear(victim.tid)
            expected[key] = i + 1
            if i == 20:
                assert flood.proc.stdout.readline().startswith("done")
                assert span.marks() - marks0 >= 2 * FLOOD_SPANS     # a start and an end each
        mine = {(r.trace_id, r.span_id): r for r in span.facts.rows() if r.cgroup_id == v_cg}
        theirs = [r for r in span.facts.rows() if r.cgroup_id == f_cg]
    st = span.facts.stats()
    assert {k: mine[k].launches for k in expected if k in mine} == expected
    assert len(theirs) <= PER_CGROUP
    assert st.refused_by_cgroup.get(f_cg, 0) >= FLOOD_SPANS - PER_CGROUP
    assert v_cg not in st.refused_by_cgroup
    assert st.refused >= FLOOD_SPANS - PER_CGROUP
    join = SpanJoin(config.load(env={}).join, facts=span.facts)
    for key, n in expected.items():
        req = request(*key)
        join.join(req.resource_spans, origin=frozenset({v_cg}))
        assert launches_on(req) == n
    # the sweep counts the flood's live rows right (what the kernel's bound reads)
    span.facts.ages()
    assert span.facts.stats().live_by_cgroup.get(f_cg, 0) == len(theirs)


@pytest.mark.parametrize("rep", range(RUNS))
def test_rows_taken_or_swept_give_their_cgroup_its_room_back(standin, spawn, kernel, rep):
    """A pod's bound counts live rows: rows its spans took come off at once
    (in batches of RELEASE_BATCH), rows that never find their span come off
    once gone and swept; a pod past its bound gets its room back after."""
    bound = 100
    w = spawn(standin.workload)
    w.load(standin.lib_dir)
    span, _ = kernel(f"join.span_facts_max_per_cgroup={bound}")
    cg = cgroup_id(w.pid)
    join = SpanJoin(config.load(env={}).join, facts=span.facts)

    def spans(n: int) -> list:
        made = []
        for _ in range(n):
            key = ids()
            span.set(w.tid, *key, Modality.text)
            w.run(launches(2))
            made.append(key)
        span.clear(w.tid)
        return made

    for _ in range(3 * bound):                      # each joined as it ends: never near the bound
        req = request(*spans(1)[0])
        join.join(req.resource_spans, origin=frozenset({cg}))
        assert launches_on(req) == 2
    assert span.facts.stats().refused_by_cgroup.get(cg, 0) == 0
    waiting = spans(bound + 50)                     # spans that do not come (yet)
    # rows taken come off in batches: at most RELEASE_BATCH - 1 of them still count;
    # a refusal is counted per event that found no room (two launches a span)
    assert 2 * 50 <= span.facts.stats().refused_by_cgroup[cg] < 2 * (50 + span_facts_mod.RELEASE_BATCH)
    for key in waiting:
        span.facts.take(*key)
    span.facts.ages()                               # the sweep's scan: the figure made exact
    refused = span.facts.stats().refused_by_cgroup[cg]
    again = spans(bound)
    assert span.facts.stats().refused_by_cgroup[cg] == refused
    assert all(span.facts.take(*key).launches == 2 for key in again)
