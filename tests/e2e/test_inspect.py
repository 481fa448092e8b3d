"""`spanlet inspect` against a running agent (a Daemon in this process, tc in a
test namespace, the GPU stand-in, a sandbox violation under /dev/shm): every
subcommand's --json holds the exact values the test caused, the human views
fit 80 columns in a real pty, and each error path has its own exit code."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pty
import re
import secrets
import select
import shutil
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1 import trace_pb2

import cuda_standin
from spanlet import config, events
from spanlet import inspect as inspect_mod
from spanlet.daemon import Daemon
from netns import Namespace, socket_in, veth_pair
from otlp_upstream import wait_for

pytestmark = pytest.mark.kernel
ROOT = Path(__file__).resolve().parents[2]
PAYLOAD, PACKETS = 100, 7
FRAME = 14 + 20 + 8 + PAYLOAD          # what tc counts: the whole Ethernet frame
LAUNCHES = 3
TRACE, SPAN = bytes.fromhex("5a" * 16), 0x1122334455667788
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def cli(*args: str, user: int | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    pre = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user is not None else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPANLET_")}
    return subprocess.run([*pre, sys.executable, "-m", "spanlet.cli", "inspect", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def in_pty(*args: str, columns: int = 80) -> str:
    """The command's output as a terminal of `columns` columns shows it."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPANLET_")}
    env.update(COLUMNS=str(columns), LINES="50", TERM="xterm-256color")
    proc = subprocess.Popen([sys.executable, "-m", "spanlet.cli", "inspect", *args], cwd=ROOT,
                            env=env, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out = b""
    try:
        while True:
            r, _, _ = select.select([master], [], [], 30)
            if not r:
                raise AssertionError("no output from inspect in 30 s")
            try:
                chunk = os.read(master, 65536)
            except OSError as e:        # EIO: the child closed the terminal
                if e.errno == errno.EIO:
                    break
                raise
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        rc = proc.wait(30)
    assert rc == 0, out.decode(errors="replace")
    return ANSI.sub("", out.decode()).replace("\r", "")


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    """The agent with every kind of fact the subcommands show, caused once."""
    tmp = tmp_path_factory.mktemp("inspect")
    # a folder user nobody may enter: the socket's own mode must refuse it
    sock_dir = Path(f"/run/spanlet-test-{secrets.token_hex(4)}")
    sock_dir.mkdir(mode=0o755)
    sock = sock_dir / "admin.sock"
    pool_dir = Path(f"/dev/shm/tensor_pool_insp_{secrets.token_hex(4)}")
    pool_dir.mkdir()
    a, b = Namespace("spanlet-ina"), Namespace("spanlet-inb")
    agent = None
    try:
        veth_pair(a, "ina0", "169.254.93.1", b, "inb0", "169.254.93.2")
        standin = cuda_standin.build(tmp / "cuda")
        cfg = config.load(env={}, overrides=[
            f"tc.netns={b.name}", "tc.interfaces=inb0", "tc.port_modality={5004: audio}",
            f"sandbox.prefixes=[{pool_dir}/]", f"sandbox.pools=[{{path: {pool_dir}/kv0}}]",
            "gpu.launch_events=all", "nvml.enabled=false", "window_s=1",
            "discovery.interval_s=0.2", "http_address=127.0.0.1", "http_port=0",
            "store.enabled=false", "otlp.grpc_port=0", "otlp.http_port=0",
            f"admin_socket={sock}"])
        with cuda_standin.Workload(standin.workload) as w:
            w.load(standin.lib_dir)
            agent = Daemon(cfg)
            agent.check_node()
            agent.start()
            gpu = next(p for p in agent.probes if p.name == "gpu_launch")
            wait_for(lambda: sum(lib.pid == w.pid for lib in gpu.libraries()) == 1, 10, "GPU probe")
            # launches inside a span the test plants, then that span over OTLP
            agent.probes[0].set(w.tid, TRACE, SPAN, events.Modality.audio)
            w.run(f"cu {LAUNCHES} 1 1 1 1 1 1 0 0")
            wait_for(lambda: agent.admin.state.launches_by_pid[w.pid] == LAUNCHES, 10,
                     "the launch events")
            req = ExportTraceServiceRequest()
            rs = req.resource_spans.add()
            kv = rs.resource.attributes.add(key="service.name")
            kv.value.string_value = "insp-svc"
            now = time.time_ns()
            rs.scope_spans.add().spans.add(
                name="infer", trace_id=TRACE, span_id=SPAN.to_bytes(8, "big"),
                kind=trace_pb2.Span.SPAN_KIND_SERVER, start_time_unix_nano=now - 250_000_000,
                end_time_unix_nano=now)
            channel = grpc.insecure_channel(f"127.0.0.1:{agent.spans.receiver.grpc_port}")
            trace_service_pb2_grpc.TraceServiceStub(channel).Export(req, timeout=10)
            channel.close()
            # UDP audio into the namespace tc watches
            tx = socket_in(a.name, socket.AF_INET, socket.SOCK_DGRAM)
            for _ in range(PACKETS):
                tx.sendto(b"a" * PAYLOAD, ("169.254.93.2", 5004))
            tx.close()
            tc = next(p for p in agent.probes if p.name == "tc_classify")
            wait_for(lambda: any(f["dport"] == 5004 and f["packets"]["ingress"] == PACKETS
                                 for f in tc.flows()), 10, "the UDP flow")
            # a mapping of a pool without a grant
            (pool_dir / "kv0").write_bytes(b"\0" * 4096)
            mapper = subprocess.Popen(
                [sys.executable, "-c", "import mmap, os; fd = os.open(%r, os.O_RDONLY);"
                 " mmap.mmap(fd, 4096, prot=mmap.PROT_READ)" % str(pool_dir / "kv0")])
            assert mapper.wait(30) == 0
            wait_for(lambda: len(agent.admin.state.violations) == 1, 10, "the violation event")
            # a process whose requests run on gevent: followed per thread only
            gevent = subprocess.Popen([sys.executable, str(ROOT / "tests" / "support" / "thread_only_child.py"),
                                       "gevent"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      env=dict(os.environ, PYTHONPATH=str(ROOT)))
            try:
                assert gevent.stdout.readline().startswith("ready")

                def one_span() -> bool:
                    gevent.stdin.write("span\n")
                    gevent.stdin.flush()
                    assert gevent.stdout.readline().strip() == "done"
                    return gevent.pid in agent.probes[0].thread_only_processes()
                wait_for(one_span, 10, "the gevent process's marks")
                yield {"agent": agent, "sock": sock, "workload_pid": w.pid, "mapper_pid": mapper.pid,
                       "pool": f"{pool_dir}/kv0", "tmp": tmp, "gevent_pid": gevent.pid}
            finally:
                gevent.kill()
                gevent.wait(10)
    finally:
        if agent is not None:
            agent.stop()
        a.close()
        b.close()
        shutil.rmtree(pool_dir, ignore_errors=True)
        leftover = list(sock_dir.iterdir())
        shutil.rmtree(sock_dir, ignore_errors=True)
    assert not leftover, f"the agent left {leftover} behind"


def ask_json(running, *args: str) -> dict:
    r = cli(*args, "--json", "--socket", str(running["sock"]))
    assert r.returncode == 0, r.stderr
    answer = json.loads(r.stdout)
    assert answer["ok"] is True and answer["protocol"] == 1
    return answer["data"]


def test_socket_is_root_only(running):
    st = os.stat(running["sock"])
    assert st.st_uid == 0 and (st.st_mode & 0o777) == 0o600


def test_summary_json(running):
    d = ask_json(running)
    probes = {p["name"]: p for p in d["probes"]}
    assert set(probes) == {"span_ctx", "tc_classify", "mmap_sandbox", "gpu_launch"}
    assert all(p["attached"] for p in probes.values()), probes
    assert probes["gpu_launch"]["events_read"] >= LAUNCHES
    assert probes["mmap_sandbox"]["events_read"] == 1
    assert d["nvml"]["available"] is False
    assert d["join"]["spans_in"] == 1 and d["join"]["spans_joined"] == 1
    assert d["join"]["span_coverage"] == 1.0
    rows = {r["metric"]: r for r in d["metrics"]}
    assert len(rows) == 17
    assert rows["spanlet_sandbox_violations_total"]["value"] == 1.0
    assert rows["spanlet_sandbox_violations_total"]["breach"] is True
    assert rows["spanlet_span_kernel_coverage_ratio"]["value"] == 1.0
    assert rows["spanlet_span_kernel_coverage_ratio"]["breach"] is False
    assert rows["spanlet_gpu_kernel_launches_total"]["value"] >= LAUNCHES
    assert {x["name"] for x in d["exporters"]} == {"otlp_receiver", "otlp_span_export"}
    comm = Path(f"/proc/{running['gevent_pid']}/comm").read_text().strip()
    assert d["thread_only"] == [{"pid": running["gevent_pid"], "comm": comm, "runtimes": ["gevent"]}]


def test_spans_json(running):
    d = ask_json(running, "spans")
    assert d["source"] == "ring"
    [s] = [s for s in d["spans"] if s["span_id"] == f"{SPAN:016x}"]
    assert s["trace_id"] == TRACE.hex() and s["service"] == "insp-svc" and s["name"] == "infer"
    assert s["gpu_launches"] == LAUNCHES and s["violations"] == 0
    assert abs(s["duration_s"] - 0.25) < 1e-9
    assert ask_json(running, "spans", "--slowest", "1")["spans"] == [s]
    assert ask_json(running, "spans", "--pod", "no-such-pod")["spans"] == []


def test_flows_json(running):
    d = ask_json(running, "flows")
    [f] = [f for f in d["flows"] if f["dport"] == 5004]
    assert f["src"] == "169.254.93.1" and f["dst"] == "169.254.93.2"
    assert f["packets"]["ingress"] == PACKETS and f["bytes"]["ingress"] == PACKETS * FRAME
    assert f["modality"] == "audio" and f["jss"] is not None
    assert {"direction": "ingress", "protocol": f["protocol"], "modality": "audio",
            "packets": PACKETS, "bytes": PACKETS * FRAME} in d["totals"]


def test_sandbox_json(running):
    d = ask_json(running, "sandbox")
    assert d["mode"] == "audit"
    [v] = d["violations"]
    assert v["pid"] == running["mapper_pid"] and v["pool"] == running["pool"]
    assert v["rule"] == "unauthorized" and v["action"] == "audit" and v["len"] == 4096
    assert [(t["rule"], t["action"], t["count"]) for t in d["totals"]] == [("unauthorized", "audit", 1)]


def test_gpu_json(running):
    d = ask_json(running, "gpu")
    assert d["devices"] == [] and d["nvml"]["available"] is False
    assert d["launch_events"] == "all"
    top = {p["pid"]: p for p in d["processes"]}
    assert top[running["workload_pid"]]["launches"] == LAUNCHES
    assert sum(x["launches"] for x in d["by_cgroup"] if x["api"] == "driver") >= LAUNCHES
    assert sum(lib["pid"] == running["workload_pid"] for lib in d["libraries"]) == 1   # the driver (no runtime hooks)


def test_hints_json(running):
    d = ask_json(running, "hints")
    assert set(d["hints"]) == {"text", "image", "audio", "video"}
    assert all(isinstance(h["rule"], str) and h["rule"] for h in d["hints"].values())
    assert d["window_s"] == 1.0
    served = running["agent"].scheduler.hints()
    assert {m: h["rule"] for m, h in d["hints"].items()} == \
        {m: h["rule"] for m, h in served["hints"].items()}


def test_memory_json(running):
    first = ask_json(running, "memory", "--mark")
    assert first["since_mark"] is None          # nothing marked before this ask
    assert first["rss"]["rss"] == first["rss"]["anon"] + first["rss"]["file"] + first["rss"]["shmem"]
    assert first["malloc"]["in_use"] > 0 and first["python"]["gc_objects"] > 0
    d = ask_json(running, "memory")
    mark = d["since_mark"]
    assert mark is not None and mark["seconds"] >= 0
    assert mark["python"]["gc_objects"] == first["python"]["gc_objects"]
    assert all(isinstance(t["change"], int) for t in d["python"]["types"])
    assert d["tracemalloc"] is None                # the agent runs without PYTHONTRACEMALLOC


@pytest.mark.parametrize("what", ["summary", "spans", "flows", "sandbox", "gpu", "hints", "memory"])
def test_human_view_fits_80_columns(running, what):
    text = in_pty(what, "--socket", str(running["sock"]))
    if os.environ.get("INSPECT_SHOW"):
        print(text)
    assert "Traceback" not in text and text.strip()
    wide = [line for line in text.splitlines() if len(line) > 80]
    assert not wide, "\n".join(wide)
    expect = {"summary": "gpu_launch", "spans": "insp-svc", "flows": "169.254.93.1",
              "sandbox": "unauthorized", "gpu": str(running["workload_pid"]), "hints": "audio",
              "memory": "malloc"}
    assert expect[what] in text, text
    if what == "summary":
        assert f"pid {running['gevent_pid']} " in text and "followed per thread only" in text, text


def test_watch_refreshes_until_interrupted(running):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPANLET_")}
    proc = subprocess.Popen([sys.executable, "-m", "spanlet.cli", "inspect", "gpu", "--json",
                             "--watch", "--interval", "0.2", "--socket", str(running["sock"])],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        answers = [json.loads(proc.stdout.readline()) for _ in range(3)]
        assert len({a["time_unix_ns"] for a in answers}) == 3
        proc.send_signal(2)
        # Keep reading: answers are written while the signal travels, and a
        # full pipe would hold the exit's flush of stdout.
        proc.communicate(timeout=10)
        assert proc.returncode == inspect_mod.EXIT_OK
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_socket_missing(tmp_path):
    r = cli("--socket", str(tmp_path / "none.sock"))
    assert r.returncode == inspect_mod.EXIT_NOT_RUNNING == 3
    assert r.stderr.strip() == f"spanlet inspect: agent not running: no admin socket at {tmp_path / 'none.sock'}"
    assert r.stdout == ""


def test_stale_socket_nothing_listening(tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(tmp_path / "stale.sock"))
    s.close()                                        # a file left by a dead agent
    r = cli("summary", "--json", "--socket", str(tmp_path / "stale.sock"))
    assert r.returncode == inspect_mod.EXIT_NOT_RUNNING and "nothing listens" in r.stderr


def test_permission_denied_for_non_root(running):
    r = cli("--socket", str(running["sock"]), user=65534)
    assert r.returncode == inspect_mod.EXIT_PERMISSION == 4, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "permission denied" in r.stderr
    assert "Traceback" not in r.stderr


class Garbage:
    """A socket that answers every connection with `reply`."""

    def __init__(self, path: Path, reply: bytes):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.reply = reply
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(self.reply)

    def close(self):
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)


@pytest.mark.parametrize("reply", [b"HTTP/1.1 200 OK\r\n\r\nhello", b'{"ok": true, "op": "x"}',
                                   b'{"ok": false, "error": "boom"}', b"[1, 2]"])
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_garbage_answer(tmp_path, reply, json_flag):
    g = Garbage(tmp_path / "g.sock", reply)
    try:
        r = cli(*json_flag, "--socket", str(tmp_path / "g.sock"))
    finally:
        g.close()
    assert r.returncode == inspect_mod.EXIT_BAD_ANSWER == 5, r.stderr
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("spanlet inspect: bad answer: ")
