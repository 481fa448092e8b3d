"""What one pod can do to the others through the kernel side, against the real
programs: marks no span can have take the thread out of its span and are
counted; the records a cgroup may send through the sampled GPU stream are
bounded per cgroup, so a cgroup flooding its own spans leaves another
cgroup's records alone, its refusals counted against it only."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spanlet import config
from spanlet.events import Modality

from gpu_harness import cgroup2_root, cgroup_id, remove_cgroup

pytestmark = pytest.mark.kernel
ROOT = Path(__file__).resolve().parents[2]

# A process that calls the marker with whatever it is told: "T S M" (hex trace
# id, hex span id, modality) → its thread id once marked.
MARKER_CHILD = """
import sys, threading
from spanlet import libspanlet_marker as m
print("ready", flush=True)
for line in sys.stdin:
    t, s, mod = line.split()
    m.mark(int(t, 16), int(s, 16), int(mod))
    print(threading.get_native_id(), flush=True)
"""


@pytest.fixture
def marker_child():
    proc = subprocess.Popen([sys.executable, "-c", MARKER_CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout.readline().strip() == "ready"

    def mark(trace_id: int, span_id: int, modality: int) -> int:
        proc.stdin.write(f"{trace_id:x} {span_id:x} {modality}\n")
        proc.stdin.flush()
        return int(proc.stdout.readline())
    mark.pid = proc.pid
    yield mark
    proc.kill()
    proc.wait(5)


@pytest.fixture
def span_probe():
    from spanlet.probes.span_ctx import SpanCtxProbe
    probe = SpanCtxProbe(config.load(env={}))
    assert probe.start().attached, probe.status.reason
    yield probe
    probe.stop()


@pytest.mark.parametrize("run", range(5))
def test_a_mark_no_span_can_have_takes_the_thread_out_of_its_span(marker_child, span_probe, run):
    span_probe.refresh()                   # attaches the uprobe in the child
    trace_id, span_id = secrets.randbits(128) | 1, secrets.randbits(64) | 1
    tid = marker_child(trace_id, span_id, int(Modality.audio))
    assert span_probe.get(tid) == (trace_id.to_bytes(16, "big"), span_id, Modality.audio)
    before = span_probe.invalid_marks()
    assert marker_child(0, span_id, int(Modality.audio)) == tid   # an all-zero trace id
    assert span_probe.get(tid) is None
    assert span_probe.invalid_marks() == before + 1
    marker_child(trace_id, span_id, 200)                          # a modality out of range
    assert span_probe.get(tid) == (trace_id.to_bytes(16, "big"), span_id, Modality.other)
    assert span_probe.invalid_marks() == before + 1


@pytest.fixture
def second_cgroup():
    path = cgroup2_root() / f"spanlet-tenant-test-{os.getpid()}-{os.urandom(3).hex()}"
    path.mkdir()
    try:
        yield path
    finally:
        remove_cgroup(path)


def launches(api: str, n: int) -> str:
    return f"{api} {n} 1 1 1 1 1 1 0 0"


BOUND = 20          # records a cgroup may send a second (the test's setting)
PER_SPAN = 4        # sampled records a span may send (the default)


@pytest.mark.parametrize("run", range(5))
def test_a_cgroup_flooding_the_sampled_stream_is_bounded_alone(standin, spawn, second_cgroup, run):
    from spanlet.probes.gpu import GpuProbe
    from spanlet.probes.span_ctx import SpanCtxProbe

    cfg = config.load(env={}, overrides=[f"ringbuf_records_per_cgroup_s={BOUND}",
                                         "gpu.launch_events=sampled",
                                         f"gpu.sampled_events_per_span={PER_SPAN}"])
    span = SpanCtxProbe(cfg)
    assert span.start().attached, span.status.reason
    seen = []
    gpu = GpuProbe(cfg, sink=seen.append)
    try:
        assert gpu.start(pin_dir=span.shared_pin_dir()).attached, gpu.status.reason
        flood, victim = spawn(standin.workload), spawn(standin.workload)
        (second_cgroup / "cgroup.procs").write_text(str(victim.pid))
        for w in (flood, victim):
            w.load(standin.lib_dir)
        gpu.refresh()
        flood_cg, victim_cg = cgroup_id(flood.pid), cgroup_id(victim.pid)
        assert flood_cg != victim_cg

        # The flood: 40 spans of 4 launches, each span allowed its 4 records,
        # 160 in all against a bound of 20 a second.
        t0 = time.monotonic()
        for _ in range(40):
            span.set(flood.tid, secrets.token_bytes(16), secrets.randbits(64) | 1, Modality.text)
            flood.run(launches("cu", PER_SPAN))
        # The victim right after, in the same seconds: 5 spans of 4 launches,
        # exactly its bound's worth of records.
        victim_spans = [(secrets.token_bytes(16), secrets.randbits(64) | 1) for _ in range(5)]
        for trace_id, span_id in victim_spans:
            span.set(victim.tid, trace_id, span_id, Modality.text)
            victim.run(launches("cu", PER_SPAN))
        elapsed = time.monotonic() - t0

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            gpu.drain()
            if sum(e.hdr.pid == victim.pid for e in seen) >= 5 * PER_SPAN:
                break
            time.sleep(0.05)
        gpu.drain()
        victim_records = [e for e in seen if e.hdr.pid == victim.pid]
        flood_records = [e for e in seen if e.hdr.pid == flood.pid]
        limited = gpu.cgroup_limited()
        if elapsed < 1.0:     # the victim's 20 fit its own second: every one of them came
            assert len(victim_records) == 5 * PER_SPAN
        assert {(bytes(e.hdr.trace_id), e.hdr.span_id) for e in victim_records} <= set(victim_spans)
        # Every record the flood's spans were allowed was sent or refused for
        # its cgroup; at most BOUND a started second went through.
        assert len(flood_records) + limited.get(flood_cg, 0) + gpu.events_dropped() == 40 * PER_SPAN
        assert len(flood_records) <= BOUND * (int(elapsed) + 1)
        assert limited.get(flood_cg, 0) >= 40 * PER_SPAN - BOUND * (int(elapsed) + 1)
        assert victim_cg not in limited or len(victim_records) + limited[victim_cg] == 5 * PER_SPAN
        if elapsed < 1.0:
            assert victim_cg not in limited
        # The counts the metrics and span facts come from are whole.
        for trace_id, span_id in victim_spans:
            row = span.facts.take(trace_id, span_id)
            assert row is not None and row.launches == PER_SPAN
    finally:
        gpu.stop()
        span.stop()
