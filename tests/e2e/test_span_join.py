"""Kernel facts joined to the OTel spans of a real, unprivileged-style serving
process: the kernel aggregates each span's facts in its span facts row, the
agent (in this process) receives the spans over OTLP, takes each span's row,
and exports the spans with exactly their facts to a stand-in upstream."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import cuda_standin
from spanlet import events
from spanlet.daemon import Daemon
from otlp_upstream import Upstream, agent_config, kernel_attrs, wait_for

pytestmark = pytest.mark.kernel
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def agent(tmp_path, request):
    up = Upstream()
    up.rx.start()
    d = Daemon(agent_config(up, f"gpu.launch_events={getattr(request, 'param', 'off')}"))
    d.check_node()
    d.start()
    d.upstream = up
    try:
        yield d
    finally:
        d.stop()
        up.rx.stop()


@pytest.fixture
def child(agent, tmp_path):
    standin = cuda_standin.build(tmp_path / "cuda")
    # The child loads the marker extension that the package build made (no
    # SPANLET_MARKER_LIB), as an installed serving process would.
    env = {k: v for k, v in os.environ.items() if k != "SPANLET_MARKER_LIB"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "support" / "span_child.py"),
         f"127.0.0.1:{agent.spans.receiver.grpc_port}", str(standin.lib_dir / cuda_standin.DRIVER)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready"), line
        pid = int(line.split()[1])
        span_ctx, gpu = agent.probes[0], next(p for p in agent.probes if p.name == "gpu_launch")
        wait_for(lambda: any(l.pid == pid for l in span_ctx.libraries)
                 and any(a.pid == pid for a in gpu.libraries()), 5, "the agent to attach to the child")
        yield proc, pid
    finally:
        proc.stdin.close()
        proc.wait(10)


def run(proc, cmd: str, done: str) -> list[str]:
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()
    lines = []
    for line in proc.stdout:
        if line.startswith(done):
            return lines
        lines.append(line.split())
    raise AssertionError(f"child exited before {done!r}")


SAMPLED = 4   # gpu.sampled_events_per_span, default


@pytest.mark.parametrize("threads, spans, agent", [(1, 3, "off"), (8, 4, "off"), (8, 4, "sampled")],
                         indirect=["agent"], ids=["1x3", "8x4", "8x4-sampled"])
def test_each_span_gets_exactly_its_own_kernel_facts(agent, child, threads, spans):
    proc, pid = child
    expected = {sid: (int(n), int(us), int(took))
                for _, sid, n, us, took in run(proc, f"work {threads} {spans}", "worked")}
    assert len(expected) == threads * spans
    total = sum(n for n, _, _ in expected.values())
    join = agent.spans.join
    sampled = agent.cfg.gpu.launch_events == "sampled"
    # the facts are complete in the kernel the moment the spans end: nothing to wait for
    rows = {f"{r.span_id:016x}": r for r in agent.probes.span_ctx.facts.rows() if r.pid == pid}
    assert {sid: (r.launches, r.syncs) for sid, r in rows.items()} == \
        {sid: (n, 1) for sid, (n, _, _) in expected.items()}
    if sampled:   # the side stream: the first SAMPLED calls of each span, before the spans leave
        wait_for(lambda: join.pending_events() >= sum(min(SAMPLED, n + 1) for n, _, _ in
                                                      expected.values()), 10, "the sampled events")
    run(proc, "flush", "flushed")
    up = agent.upstream
    wait_for(lambda: len(up.spans) >= len(expected), 10, "the spans upstream")
    for sid, (n, sync_us, took_ns) in expected.items():
        span, resource = up.spans[sid]
        a = kernel_attrs(span)
        assert a["kernel.gpu.launches"] == n and a["kernel.gpu.syncs"] == 1, span.name
        # at least the requested sleep, at most what the caller timed around the call
        # (a loaded machine stretches the sleep, never shrinks it)
        assert sync_us * 1000 <= a["kernel.gpu.sync_wait_ns"] <= took_ns
        assert "kernel.gpu.launch_ns" not in a          # launches are not timed by default
        if sampled:
            assert [e.name for e in span.events] == ["kernel.gpu.launch"] * min(SAMPLED, n) + \
                ["kernel.gpu.sync_wait"] * (n < SAMPLED)
        else:
            assert list(span.events) == []               # no per-launch records at all
        res = {kv.key: kv.value.string_value for kv in resource.attributes}
        assert res["service.name"] == "span-child"
        assert res["k8s.node.name"] == agent.cfg.node_name
    assert join.stats.events_evicted == 0 and join.stats.late_records == 0
    assert join.stats.rows_taken == len(expected)
    assert [r for r in agent.probes.span_ctx.facts.rows() if r.pid == pid] == []   # taken: gone
    assert join.coverage() == (1.0, 1.0 if sampled else None)
    # the kernel-side counts agree, under the spans' modality
    gpu = next(p for p in agent.probes if p.name == "gpu_launch")
    image = sum(c for (cg, mod, api), c in gpu.launches().items() if mod == events.Modality.image)
    assert image == total


@pytest.mark.parametrize("agent", ["sampled"], indirect=True)
def test_sampled_records_reach_their_spans_exported_at_once(agent, child):
    """Spans exported the moment their work is done, 10 rounds: each gets its
    sampled records, though the read loop may not have woken for them yet
    (it waits up to 100 ms, and the programs wake it once per batch): the span
    path drains the rings before each join. No record comes after its span,
    so the join's event coverage (metric #17, what=events) is 1.0."""
    proc, pid = child
    up, join = agent.upstream, agent.spans.join
    seen = 0
    for _ in range(10):
        expected = {sid: int(n) for _, sid, n, _, _ in run(proc, "work 8 4", "worked")}
        run(proc, "flush", "flushed")
        seen += len(expected)
        wait_for(lambda: len(up.spans) >= seen, 10, "the spans upstream")
        for sid, n in expected.items():
            span, _ = up.spans[sid]
            assert [e.name for e in span.events] == ["kernel.gpu.launch"] * min(SAMPLED, n) + \
                ["kernel.gpu.sync_wait"] * (n < SAMPLED), (sid, n)
    assert join.stats.events_evicted == 0
    assert join.coverage() == (1.0, 1.0)
