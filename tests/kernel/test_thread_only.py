"""Processes whose requests run on something spanlet cannot follow per
coroutine (gevent, trio) are found by the client at their first span, and
every mark then carries why: the agent keeps them per process (the uprobe's
map), counts them in spanlet_client_thread_only_processes by reason, logs
each once, shows them in `spanlet inspect`'s summary, and forgets a process
when it exits. A plain asyncio process is not among them."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import anatomy
from spanlet.metrics import kernel as kernel_metrics
from spanlet.metrics.catalogue import BY_NAME
from otlp_upstream import wait_for

pytestmark = pytest.mark.kernel
ROOT = Path(__file__).resolve().parents[2]
CHILD = ROOT / "tests" / "support" / "thread_only_child.py"
METRIC = BY_NAME["spanlet_client_thread_only_processes"].name


@pytest.fixture(scope="module")
def probe():
    with anatomy.span_ctx_probe() as p:     # the defaults
        yield p


class Child:
    def __init__(self, what: str):
        self.proc = subprocess.Popen([sys.executable, str(CHILD), what], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert self.proc.stdout.readline().startswith("ready")
        self.pid = self.proc.pid

    def span(self) -> None:
        self.proc.stdin.write("span\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "done"

    def exit(self) -> None:
        self.proc.stdin.write("exit\n")
        self.proc.stdin.flush()
        assert self.proc.wait(10) == 0


def counts(probe) -> dict[str, float]:
    fam = kernel_metrics.spanlet_client_thread_only_processes(probe)
    assert fam.name == METRIC
    return {dict(s.labels)["runtime"]: s.value for s in fam.samples}


@pytest.mark.parametrize("run", range(3))
def test_gevent_and_trio_processes_are_counted_shown_and_forgotten_at_exit(probe, caplog, run):
    before = counts(probe)
    children = {what: Child(what) for what in ("gevent", "trio", "asyncio")}
    try:
        probe.refresh()                     # the marker of the new processes attached
        for c in children.values():
            c.span()
        mine = lambda: {pid: f for pid, f in probe.thread_only_processes().items()  # noqa: E731
                        if pid in {c.pid for c in children.values()}}
        wait_for(lambda: len(mine()) == 2, 5, "both processes' flags")
        assert mine() == {children["gevent"].pid: 2, children["trio"].pid: 1}
        now = counts(probe)
        assert now["gevent"] - before["gevent"] == 1 and now["trio"] - before["trio"] == 1
        assert now["eventlet"] == before["eventlet"] and now["loop"] == before["loop"]
        with caplog.at_level(logging.WARNING, logger="spanlet.probes.span_ctx"):
            probe.refresh()
            probe.refresh()                 # said once
        said = [r.getMessage() for r in caplog.records if "followed per thread only" in r.getMessage()]
        assert sorted(m.split(" runs its requests on ")[1].split(":")[0] for m in said
                      if any(f"pid {c.pid} " in m for c in children.values())) == ["gevent", "trio"]
    finally:
        for c in children.values():
            c.exit()
    wait_for(lambda: not any(c.pid in probe.thread_only_processes() for c in children.values()), 5,
             "the exited processes forgotten")
    assert counts(probe) == before


def test_with_sched_off_by_default_spans_get_no_scheduler_facts(probe, tmp_path):
    """This module's agent runs the defaults, where sched.enabled is off: a
    span that only ran, slept and switched makes no facts row at all."""
    spans = anatomy.run_child(probe, anatomy.build(tmp_path), "threads", "0", "2", "1", "5", "2", "2")
    assert len(spans) == 2
    assert all(probe.facts.take_rows(trace, span) == [] for trace, span in spans)
