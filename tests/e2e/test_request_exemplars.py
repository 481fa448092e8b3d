"""Request anatomy end to end: a real OTel-instrumented process sends its
requests (a SERVER span over two children, each spinning a known CPU time)
to a whole agent with the scheduler program on; each server span reaches the
upstream with kernel.request.* = exactly its own and its children's
kernel.sched.* as they arrive there, and a real Prometheus server (Debian's,
exemplar storage on, scraping in OpenMetrics as it asks to) returns the
trace id and CPU time of a request sent from the CPU histogram's exemplars."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

import anatomy
from otlp_upstream import exporting_agent, kernel_attrs, wait_for
from processes import stop_process
from prometheus_server import Prometheus
from spanlet.join import LATE_SPAN_NAME

pytestmark = pytest.mark.kernel
CHILD = Path(__file__).resolve().parents[1] / "support" / "request_tree_child.py"
CHILD_MS, SERVER_MS, MS = 20, 5, 1_000_000
TOTALS = (("kernel.request.cpu_ns", "kernel.sched.cpu_ns"),
          ("kernel.request.runqueue_ns", "kernel.sched.runqueue_ns"),
          ("kernel.request.blocked_ns", "kernel.sched.blocked_ns"))


@pytest.fixture(scope="module")
def spin(tmp_path_factory) -> Path:
    return anatomy.build(tmp_path_factory.mktemp("spin"))


@pytest.fixture
def prometheus_with_exemplars(tmp_path, monkeypatch):
    """Prometheus(tmp_path, target) with exemplar storage, a feature flag the
    helper does not pass: a `prometheus` first on PATH adds it."""
    real = shutil.which("prometheus")
    assert real, "Debian's prometheus is not installed"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "prometheus"
    wrapper.write_text(f'#!/bin/sh\nexec {real} --enable-feature=exemplar-storage "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return lambda target: Prometheus(tmp_path, target)


class Child:
    """request_tree_child.py sending to the agent's OTLP gRPC port."""

    def __init__(self, spin: Path, port: int):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OTEL_", "SPANLET_")) and k != "PYTHONPATH"}
        self.proc = subprocess.Popen([sys.executable, str(CHILD), str(spin), f"http://127.0.0.1:{port}",
                                      str(CHILD_MS), str(SERVER_MS)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout.readline().strip() == "ready"

    def say(self, what: str) -> list[str]:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().split()

    def requests(self, n: int) -> list[tuple[str, str]]:
        """n requests, flushed: their (trace hex, server span hex)."""
        sent = [tuple(self.say("request")[1:]) for _ in range(n)]
        assert self.say("flush") == ["flushed"]
        return sent

    def close(self) -> None:
        stop_process(self.proc, 10)


def tree_upstream(up, trace: str, span: str) -> tuple[dict, list[dict]]:
    """The kernel.* of a server span as it reached the upstream, and of its children there."""
    with up.lock:
        server = kernel_attrs(up.by_ids[(trace, span)][-1])
        children = [kernel_attrs(s) for (t, _), spans in up.by_ids.items() if t == trace
                    for s in spans[-1:] if s.parent_span_id.hex() == span and s.name != LATE_SPAN_NAME]
    return server, children


def exemplars(prom: Prometheus, expr: str) -> list[dict]:
    """Every exemplar Prometheus stored for the series of `expr` in the last ten minutes."""
    now = time.time()
    url = (f"http://127.0.0.1:{prom.port}/api/v1/query_exemplars?"
           + urllib.parse.urlencode({"query": expr, "start": now - 600, "end": now + 60}))
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
    except OSError:
        return []
    assert body["status"] == "success", body
    return [e for series in body["data"] for e in series["exemplars"]]


def test_request_totals_reach_upstream_and_their_trace_ids_reach_prometheus(spin, prometheus_with_exemplars):
    with exporting_agent("sched.enabled=true") as (agent, up):
        child = Child(spin, agent.spans.receiver.grpc_port)
        prom = prometheus_with_exemplars(f"127.0.0.1:{agent.http.server_port}")
        try:
            def summed() -> bool:       # once the agent follows the child's marker
                (trace, span), = child.requests(1)
                wait_for(lambda: (trace, span) in up.by_ids, 10, "the server span upstream")
                return "kernel.request.cpu_ns" in tree_upstream(up, trace, span)[0]
            wait_for(summed, 60, "a request with its totals")
            sent = child.requests(5)
            wait_for(lambda: all(k in up.by_ids for k in sent), 10, "the requests upstream")
            cpu_s = {}
            for trace, span in sent:
                server, children = tree_upstream(up, trace, span)
                assert len(children) == 2, (trace, children)
                for total, fact in TOTALS:
                    assert server.get(total) == server.get(fact, 0) + sum(c.get(fact, 0) for c in children), \
                        (total, server, children)
                # the spun CPU time is all there (a scheduler slice can land in the run
                # queue's or blocked time: tests/kernel/test_sched_facts.py's known gap)
                assert sum(server[total] for total, _ in TOTALS) >= (2 * CHILD_MS + SERVER_MS) * MS, server
                cpu_s[trace] = server["kernel.request.cpu_ns"] / 1e9

            prom.wait_scraped()
            found: dict[str, float] = {}

            def exemplar_of_a_request() -> bool:
                for e in exemplars(prom, "spanlet_request_cpu_seconds_bucket"):
                    if e["labels"].get("trace_id") in cpu_s:
                        found[e["labels"]["trace_id"]] = float(e["value"])
                return bool(found)
            wait_for(exemplar_of_a_request, 30, "an exemplar with a request's trace id in Prometheus")
            assert all(cpu_s[trace] == value for trace, value in found.items()), (found, cpu_s)
            assert prom.value("sum(spanlet_request_cpu_seconds_count)") >= len(sent)
            assert prom.value("sum(spanlet_request_runqueue_seconds_count)") >= len(sent)
        finally:
            prom.stop()
            child.close()
