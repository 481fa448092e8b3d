"""CFS quota throttling against the real kernel: a real OTel-instrumented child
in a pod-shaped cgroup with 0.2 CPU (cgroup v2 cpu.max, or the v1 cpu
hierarchy of a hybrid host) spins past its quota inside its spans, 20 runs.
The throttling shows on the spans as run-queue time (kernel.sched.runqueue_ns:
at least the throttled time that the cgroup's cpu.stat gained while the spans
were open, which the child reads at their edges) and in
spanlet_pod_cpu_throttled_seconds_total of that pod, named by the agent's pod
naming: exactly the cgroup's cpu.stat, before and after each run."""

from __future__ import annotations

import os

import pytest

import anatomy
from gpu_harness import cgroup2_root
from pod_throttle import pod_names, registry, throttle_engine, throttled
from quota_cgroup import quota_pod
from spanlet.cpu_throttle import PodCpuThrottle

pytestmark = pytest.mark.kernel
RUNS = 20
CPU = 1 if os.cpu_count() > 1 else 0
MS = 1_000_000
# 50 ms of CPU every 250 ms (0.2 CPU). Each span spins 200 ms of CPU: the
# quota runs out at least 3 times in it. It then sleeps longer than a period,
# so that what the child runs between its spans starts with a whole period's
# quota. Its exit is another matter: the interpreter's shutdown took 22-37 ms
# of CPU here, and where it takes more than the period's quota left, the exit
# is throttled, outside any span (the suite failed so twice: the run's
# throttled time 143 ms above the thread's wait in its spans, a throttling's
# worth, where the spans were held to the whole run's throttled time). So
# the spans are held to the throttled time that the cgroup's cpu.stat gained
# between their edges (the child reads it there), not to the whole run's.
QUOTA_MS, PERIOD_MS = 50, 250
SPANS, SPIN_MS, SLEEP_MS = 2, 200, 300
# How much of one throttling the thread's run-queue time may lack. The kernel
# counts a cgroup's throttled time from when its first task is taken off the
# CPU by the throttle (Linux 6.18, "sched/fair: task based throttle time
# accounting"; before it, from the throttle itself, which the switch out
# follows on the same path) to the unthrottle at the next period, which comes
# before the thread is switched back in. The thread waits in the run queue
# from that switch out to that switch in: the throttled time lies inside it
# but for the moment between the throttle and the switch (microseconds; the
# thread's own schedstat wait was 0.26 ms or more above the throttled time in
# 210 runs here). 1 ms a throttling is far above that and far below a
# throttling here (up to 200 ms).
SLACK_PER_THROTTLE_NS = 1 * MS
# The sched facts' known gap (test_sched_facts.py): in a few spans in a hundred
# a slice of the thread's time lands in the wrong sum. Under throttling the
# slice can be as long as a throttling: once in ~300 runs here the spans' run
# queue came 77 ms short of the throttled time (and their CPU time 25 ms short
# of the thread's own). The spans' run queue is checked against the throttled
# time for all but this share of the runs.
SPLIT_MISSES_ALLOWED = 0.05
NAMESPACE, POD = "spanlet-test", "quota"


@pytest.fixture(scope="module")
def sched(tmp_path_factory):
    """(the span context probe with the scheduler facts on, the built spinner)."""
    spin = anatomy.build(tmp_path_factory.mktemp("spin"))
    with anatomy.span_ctx_probe("sched.enabled=true") as probe:
        yield probe, spin


@pytest.fixture(scope="module")
def pod():
    with quota_pod(QUOTA_MS * 1000, PERIOD_MS * 1000) as p:
        yield p


def test_throttling_is_run_queue_on_the_spans_and_the_pods_throttled_seconds(sched, pod):
    """20 runs, 2 spans each, the quota running out ~8 times a run: the
    throttled time gained inside each run's spans lies inside the thread's
    run-queue wait and the spans' run-queue time (all but the known gap's
    share of the runs), and the pod's counter is the cgroup's cpu.stat
    exactly, before and after each run."""
    probe, spin = sched
    reg = registry(throttle_engine(PodCpuThrottle(), pod_names(cgroup2_root(), {pod.uid: (NAMESPACE, POD)})))
    misses = []
    for _ in range(RUNS):
        before, metric_before = pod.cpu_stat(), throttled(reg, NAMESPACE, POD)
        spans = anatomy.run_child(probe, spin, "threads", str(CPU), "1", str(SPANS), str(SPIN_MS),
                                  str(SLEEP_MS), "1", cgroup=pod.cpu)
        after, metric_after = pod.cpu_stat(), throttled(reg, NAMESPACE, POD)
        now = pod.cpu_stat()       # nr_periods goes on while the period timer runs out
        throttles = after["nr_throttled"] - before["nr_throttled"]
        throttled_ns = pod.throttled_ns(after) - pod.throttled_ns(before)
        assert len(spans) == SPANS
        rows = [probe.facts.take_rows(*key) for key in spans]
        assert all(len(r) == 1 for r in rows), rows
        runqueue_ns, cpu_ns = sum(r[0].runqueue_ns for r in rows), sum(r[0].cpu_ns for r in rows)
        own_wait_ns = sum(figures[1] for figures in spans.values())     # schedstat, inside the edges
        inside_ns = sum(figures[14] for figures in spans.values())      # cpu.stat, inside the edges
        slack = throttles * SLACK_PER_THROTTLE_NS
        seen = (f"spans: cpu {cpu_ns} run queue {runqueue_ns}; the thread's own wait {own_wait_ns}; "
                f"cgroup: {throttles} throttles, {throttled_ns} ns throttled, {inside_ns} ns of it inside the spans")

        # the quota ran out in every span, again and again, and the thread waited it out
        assert throttles >= SPANS * (SPIN_MS // QUOTA_MS - 1), seen
        assert 0 < inside_ns <= throttled_ns, seen
        assert own_wait_ns >= inside_ns - slack, seen
        # (a) on the spans the throttling is run-queue time, much more than the CPU time
        assert runqueue_ns >= 2 * cpu_ns and inside_ns >= cpu_ns, seen
        if runqueue_ns < inside_ns - slack:
            misses.append(seen)
        # (b) the pod's counter is the cgroup's cpu.stat, exactly, at each scrape
        assert (now["nr_throttled"], pod.throttled_ns(now)) == (after["nr_throttled"], pod.throttled_ns(after))
        assert metric_before == pod.throttled_ns(before) / 1e9, seen
        assert metric_after == pod.throttled_ns(after) / 1e9, seen
    assert len(misses) <= SPLIT_MISSES_ALLOWED * RUNS, "\n".join(misses)
