"""End to end, as a user runs it: `spanlet run --config agent/demo/agent.yaml`
and `spanlet demo`, side by side, with a real Prometheus server scraping the
agent. Every PromQL expression of every Grafana dashboard returns at least one
series from that Prometheus, every ClickHouse query of every dashboard returns
rows from the agent's embedded chdb store, and the demo leaves no namespace,
interface, TC filter, /dev/shm file or process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from spanlet.demo import run as demo
from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend
from processes import free_port, stop_process
from prometheus_server import Prometheus

import grafana_queries
from collector_ddl import plugin_trace_id_sql

pytestmark = pytest.mark.kernel
ROOT = Path(__file__).resolve().parents[2]
DEMO_S = 75          # the demo's traffic; the dashboards are queried in its second half
QUERY_FROM_S = 30


def _get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def promql(prom: Prometheus, expr: str) -> list:
    """The expression's result; a query Prometheus rejects fails the test."""
    url = f"http://127.0.0.1:{prom.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        body = json.loads(_get(url))
    except urllib.error.HTTPError as e:
        pytest.fail(f"Prometheus rejected {expr!r}: {e.read().decode(errors='replace')}")
    return body["data"]["result"]


def demo_processes() -> list[int]:
    """Processes running a demo worker, whoever's child they are now."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"spanlet.demo.worker" in cmd:
                pids.append(int(d.name))
    return pids


def tc_filters_on(ifname: str) -> str:
    r = subprocess.run(["tc", "filter", "show", "dev", ifname, "ingress"], capture_output=True,
                       text=True)
    return r.stdout


@pytest.fixture
def agent(tmp_path):
    """The agent as `make demo-agent` runs it, on free ports, its data in
    tmp_path, TC only on interfaces that appear after its start (the demo's veth)."""
    assert not demo.POOL_DIR.exists() and not os.path.exists(f"/run/netns/{demo.NETNS}"), \
        "a demo is running on this machine"
    port, grpc_port = free_port(), free_port()
    host_links = ",".join(sorted(os.listdir("/sys/class/net")))
    data = tmp_path / "data"
    argv = [sys.executable, "-m", "spanlet.cli", "run", "--config", str(ROOT / "agent/demo/agent.yaml"),
            "--set", f"data_dir={data}", "--set", f"admin_socket={tmp_path / 'admin.sock'}",
            "--set", "http_address=127.0.0.1", "--set", f"http_port={port}",
            "--set", f"otlp.grpc_port={grpc_port}", "--set", "otlp.http_port=0",
            "--set", f"tc.exclude_interfaces=[{host_links}]"]
    log = open(tmp_path / "agent.log", "wb")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                _get(f"http://127.0.0.1:{port}/readyz", 2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("agent did not become ready:\n"
                                + (tmp_path / "agent.log").read_text(errors="replace")[-4000:])
                time.sleep(0.5)
        yield proc, port, grpc_port, data
    finally:
        stop_process(proc, 60)
        log.close()


def test_demo_lights_every_dashboard_query(agent, tmp_path):
    proc, port, grpc_port, data = agent
    prom = Prometheus(tmp_path, f"127.0.0.1:{port}")
    parent_existed = demo.POOL_PARENT.exists()
    prom_queries = grafana_queries.prometheus_queries()
    assert len(prom_queries) >= 17
    started_ns = time.time_ns()
    out = open(tmp_path / "demo.log", "w+")
    run = subprocess.Popen([sys.executable, "-m", "spanlet.cli", "demo", "--duration", str(DEMO_S),
                            "--progress", "5", "--otlp-endpoint", f"http://127.0.0.1:{grpc_port}",
                            "--seed", "11"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        empty = {(d, p, e) for d, p, e in prom_queries}
        while run.poll() is None and time.monotonic() - t0 < DEMO_S + 60:
            if time.monotonic() - t0 >= QUERY_FROM_S:
                for q in sorted(empty):
                    if promql(prom, q[2]):
                        empty.discard(q)
            time.sleep(2)
        assert run.wait(120) == 0, open(tmp_path / "demo.log").read()
        for q in sorted(empty):   # a last look once the demo's final spans are in
            if promql(prom, q[2]):
                empty.discard(q)
        assert not empty, "dashboard PromQL with no series:\n" + "\n".join(
            f"  {d} / {p}: {e}" for d, p, e in sorted(empty))
        # the demo's own account
        text = open(tmp_path / "demo.log").read()
        assert "left behind: nothing" in text, text
        metrics = _get(f"http://127.0.0.1:{port}/metrics").decode()
        assert "spanlet_sandbox_violations_total{" in metrics
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGTERM)
            run.wait(60)
        out.close()
        prom.stop()
    # Nothing of the demo's is left: namespace, veth (and so its TC filters),
    # pool files, worker processes.
    assert not os.path.exists(f"/run/netns/{demo.NETNS}")
    assert not os.path.exists(f"/sys/class/net/{demo.HOST_IF}")
    assert not demo.POOL_DIR.exists()
    assert demo.POOL_PARENT.exists() == parent_existed
    assert demo_processes() == []
    for ifname in os.listdir("/sys/class/net"):   # the agent put no filter on a host interface
        assert "spanlet_tc_classify" not in tc_filters_on(ifname), ifname

    # The store: stop the agent (it flushes), then every ClickHouse query of
    # every dashboard over the demo's time range returns rows.
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    db = ChdbBackend(str(data / "chdb"))
    try:
        ch_queries = grafana_queries.clickhouse_queries(
            database="spanlet", since_ns=started_ns - 60 * 10**9, until_ns=time.time_ns())
        assert ch_queries
        no_rows = []
        for d, p, sql in ch_queries:
            if not db.query(sql):
                no_rows.append(f"  {d} / {p}: {sql}")
        assert not no_rows, "dashboard ClickHouse queries with no rows:\n" + "\n".join(no_rows)
        # The demo's spans with the Collector's spellings, and its trace view
        # as Grafana's plugin asks for it (through the trace-id lookup).
        kinds = dict(db.query("SELECT SpanKind, count() FROM spanlet.otel_traces GROUP BY SpanKind"))
        assert kinds and set(kinds) <= {"Server", "Client", "Internal", "Producer", "Consumer", "Unspecified"}
        assert set(dict(db.query("SELECT StatusCode, count() FROM spanlet.otel_traces GROUP BY StatusCode"))) \
            <= {"Unset", "Ok", "Error"}
        ((trace, spans),) = db.query("SELECT TraceId, count() FROM spanlet.otel_traces FINAL WHERE TraceId != '' "
                                     "GROUP BY TraceId ORDER BY count() DESC, TraceId LIMIT 1")
        assert len(db.query(plugin_trace_id_sql("spanlet", trace, lookup=True))) == spans
    finally:
        db.close()


def test_a_killed_demo_leaves_nothing_for_long(tmp_path):
    """SIGKILL the demo half-way: its workers end with it (parent-death
    signal), and the next demo removes its namespace and pools first, then
    runs and removes its own."""
    assert not demo.POOL_DIR.exists() and not os.path.exists(f"/run/netns/{demo.NETNS}"), \
        "a demo is running on this machine"
    argv = [sys.executable, "-m", "spanlet.cli", "demo", "--duration", "300", "--progress", "1",
            "--otlp-endpoint", f"http://127.0.0.1:{free_port()}"]
    parent_existed = demo.POOL_PARENT.exists()
    try:
        _kill_then_rerun(argv)
        assert demo.POOL_PARENT.exists() == parent_existed
    finally:  # whatever failed above, nothing of the demo's stays
        demo.Demo(1, "", 1).remove_leftovers()
        for pid in demo_processes():
            os.kill(pid, signal.SIGKILL)


def _kill_then_rerun(argv: list[str]) -> None:
    first = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        lines = []
        for line in first.stdout:
            lines.append(line)
            if "traffic for" in line:
                break
        assert "traffic for" in lines[-1], "".join(lines)
        assert len(demo_processes()) == 5
        assert demo.POOL_DIR.is_dir() and os.path.exists(f"/run/netns/{demo.NETNS}")
    finally:
        first.kill()
        first.wait(10)
        first.stdout.close()
    deadline = time.monotonic() + 30
    while demo_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert demo_processes() == []
    # what the killed one could not remove is still there, until the next demo
    assert demo.POOL_DIR.is_dir() and os.path.exists(f"/run/netns/{demo.NETNS}")
    second = subprocess.run([*argv[:5], "5", *argv[6:]], cwd=ROOT, capture_output=True, text=True,
                            timeout=180)
    assert second.returncode == 0, second.stdout + second.stderr
    out = second.stdout
    assert f"removed network namespace {demo.NETNS}, left by an earlier demo" in out
    assert f"removed {demo.POOL_DIR}, left by an earlier demo" in out
    assert "left behind: nothing" in out
    assert "no agent is receiving OTLP" in out
    assert not os.path.exists(f"/run/netns/{demo.NETNS}") and not demo.POOL_DIR.exists()
    assert demo_processes() == []
