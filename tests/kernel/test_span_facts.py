"""Span facts against the real kernel: the span_ctx and GPU programs with the
stand-in libcuda, default settings (one entry-only uprobe per launch), exact
rows per (trace id, span id) read and deleted by SpanFacts.take()."""

from __future__ import annotations

import secrets
import time

import pytest

from spanlet.events import Api, Modality

from gpu_harness import cgroup_id, counts
from spanlet.probes.gpu import DRIVER_HOOKS

pytestmark = pytest.mark.kernel


def ids() -> tuple[bytes, int]:
    return secrets.token_bytes(16), int.from_bytes(secrets.token_bytes(8), "big") | 1


def launches(api: str, n: int) -> str:
    return f"{api} {n} 1 1 1 1 1 1 0 0"


def test_default_is_one_entry_probe_per_launch_on_the_driver(standin, spawn, kernel):
    w = spawn(standin.workload)
    w.load(standin.lib_dir)
    span, gpu = kernel()
    hooked = {a.library.name: a.symbols for a in gpu.libraries() if a.pid == w.pid}
    # every driver entry point of DRIVER_HOOKS; the runtime is not looked for
    assert sorted(hooked["libcuda.so"]) == sorted(h.symbol for h in DRIVER_HOOKS)
    assert {"cuLaunchKernel", "cuLaunchCooperativeKernel_ptsz", "cuGraphLaunch",
            "cuStreamEndCapture", "cuCtxSynchronize"} <= set(hooked["libcuda.so"])
    assert "libcudart.so" not in hooked
    w.run(launches("cu", 3), launches("cuda", 4))
    cg = cgroup_id(w.pid)
    # the runtime's launches reach the driver: counted there, once each
    assert counts(gpu.launches(), cg) == {(cg, Modality.other, Api.driver): 7}
    assert gpu.events_read == 0 and gpu.poll(10) == 0   # launch_events=off: no records


def test_exact_facts_per_span_while_another_process_floods(standin, spawn, kernel):
    flood, w = spawn(standin.workload), spawn(standin.workload)
    for p in (flood, w):
        p.load(standin.lib_dir)
    span, gpu = kernel()
    cg = cgroup_id(w.pid)
    flood.send("bench 200000000", "go")   # outside any span, on the whole time
    try:
        for rep in range(20):
            trace_id, span_id = ids()
            n_cu, n_ex, n_rt, sync_us = rep + 1, 2 * rep, 3, 200 + 10 * rep
            span.set(w.tid, trace_id, span_id, Modality.video)
            out = w.run(launches("cu", n_cu), launches("cuex", n_ex), launches("cuda", n_rt),
                        f"cusync {sync_us}", f"devsync {sync_us}")
            span.clear(w.tid)            # the span ends before it is exported
            w.run(launches("cu", 5))     # after the span: in no row
            took = sum(int(line.split()[2]) for line in out if line.startswith("sync "))
            row = span.facts.take(trace_id, span_id)
            assert row is not None, rep
            assert row.launches_by_api == {"driver": n_cu + n_ex + n_rt, "runtime": 0}, rep
            assert row.launches == n_cu + n_ex + n_rt and row.syncs == 2
            assert 2 * sync_us * 1000 <= row.sync_wait_ns <= took
            assert (row.launch_ns, row.violations, row.sampled_events) == (0, 0, 0)  # untimed
            assert (row.trace_id, row.span_id, row.pid, row.cgroup_id) == (trace_id, span_id,
                                                                            w.pid, cg)
            assert abs(row.first_ns - time.time_ns()) < 10e9
            assert span.facts.take(trace_id, span_id) is None
        # the flood never made a row; it was counted all the while (metric #1)
        assert [r for r in span.facts.rows() if r.pid == flood.pid] == []
        assert counts(gpu.launches(), cg)[(cg, Modality.other, Api.driver)] > 0
        st = span.facts.stats()
        assert (st.taken, st.evicted) == (20, 0)
    finally:
        flood.proc.kill()
        flood.close()


def test_reused_span_id_in_another_trace_stays_separate(standin, spawn, kernel):
    a, b = spawn(standin.workload), spawn(standin.workload)
    for p in (a, b):
        p.load(standin.lib_dir)
    span, _ = kernel()
    (trace_a, span_id), (trace_b, _) = ids(), ids()
    span.set(a.tid, trace_a, span_id, Modality.text)
    span.set(b.tid, trace_b, span_id, Modality.text)
    a.run(launches("cu", 3))
    b.run(launches("cuex", 8), "cusync 100")
    got_b = span.facts.take(trace_b, span_id)
    got_a = span.facts.take(trace_a, span_id)
    assert (got_a.launches, got_a.syncs, got_a.pid) == (3, 0, a.pid)
    assert (got_b.launches, got_b.syncs, got_b.pid) == (8, 1, b.pid)


def test_thread_exiting_inside_a_span(standin, spawn, kernel):
    w = spawn(standin.workload)
    w.load(standin.lib_dir)
    span, _ = kernel()
    trace_id, span_id = ids()
    tid = w.thread(6)
    span.set(tid, trace_id, span_id, Modality.audio)
    w.release()                      # 6 launches, then the thread exits inside the span
    assert span.get(tid) is None     # its context went with it
    w.run(launches("cu", 4))         # the main thread, in no span
    row = span.facts.take(trace_id, span_id)
    assert (row.launches, row.pid) == (6, w.pid)
    assert span.facts.rows() == []


def test_marks_for_spans_that_never_arrive_keep_the_map_at_its_bound(standin, spawn, kernel):
    w = spawn(standin.workload)
    w.load(standin.lib_dir)
    bound, spans = 64, 600
    span, _ = kernel(span_facts_max=bound)
    last = None
    for _ in range(spans):
        last = ids()
        span.set(w.tid, *last, Modality.image)
        w.run(launches("cu", 1))
    present = span.facts.rows()
    st = span.facts.stats()
    assert len(present) <= bound and st.present == len(present)
    # one row per span, every one counted (other processes on the host may add theirs)
    assert st.created >= spans
    assert st.evicted == st.created - len(present) >= spans - bound
    assert all(r.launches == 1 for r in present if r.pid == w.pid)  # none got another's launch
    row = span.facts.take(*last)                       # the newest span is still there
    assert row is not None and row.launches == 1


def test_an_empty_map_is_read_again_only_once_the_kernel_made_a_row(standin, spawn, kernel):
    """Each sweep reads the map; the kernel walks all of an empty map's buckets for it. Once a scan
    found nothing, scans read nothing until the kernel's count of rows made moves: a row written
    past that count (as no program writes one) stays unseen, the next row a launch makes shows both."""
    w = spawn(standin.workload)
    w.load(standin.lib_dir)
    span, _ = kernel()
    facts = span.facts
    for _ in range(3):                   # a quiet map (and its per-cgroup tables) after two scans
        facts.ages()
    hidden_trace, hidden_span = ids()
    k, v = facts.table.Key(), facts.table.Leaf()
    k.trace_id[:] = list(hidden_trace)
    k.span_id, k.cgroup_id = hidden_span, 7
    v.cgroup_id = 7
    facts.table[k] = v                   # not counted as made
    seen = [(t, s) for t, s, _, _ in facts.ages()]
    assert (hidden_trace, hidden_span) not in seen
    trace_id, span_id = ids()
    span.set(w.tid, trace_id, span_id, Modality.text)
    w.run(launches("cu", 2))
    span.clear(w.tid)
    seen = [(t, s) for t, s, _, _ in facts.ages()]
    assert (hidden_trace, hidden_span) in seen and (trace_id, span_id) in seen
    assert facts.take(trace_id, span_id).launches == 2
    assert facts.delete(hidden_trace, hidden_span, 7)
