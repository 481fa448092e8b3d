"""Security of the agent's local surfaces: the admin socket serves root only
(file mode and, should the mode be loosened, the peer's credentials);
`spanlet inspect` as non-root says so in one line; the OTLP receivers bind
exactly the configured address; no configured credential reaches a log line
or an inspect answer, whatever module writes it."""

from __future__ import annotations

import base64
import errno
import http.server
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import (
    TraceServiceStub,
)

from spanlet import cli, config
from spanlet import inspect as inspect_mod
from spanlet.daemon import Daemon

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534

# A child that starts as root, loads what it needs (the interpreter's own
# files may not be readable by others), then drops root for good:
# setresuid/setresgid, no supplementary groups.
DROP = r"""
import os
os.setgroups([])
os.setresgid(65534, 65534, 65534)
os.setresuid(65534, 65534, 65534)
assert os.getresuid() == (65534, 65534, 65534)
"""

# A non-root peer's view of the admin socket.
PEER = r"""
import json, socket, sys
""" + DROP + r"""
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print(json.dumps({"connect_errno": e.errno}))
    sys.exit(0)
s.sendall(b'{"op": "summary"}\n')
buf = b""
while chunk := s.recv(65536):
    buf += chunk
print(json.dumps({"answer": buf.decode()}))
"""


# `spanlet` (spanlet.cli.main) run by a non-root user.
CLI = r"""
import sys
from spanlet import cli, inspect
import rich.console, rich.live, rich.table, rich.text
cli._parser()          # its lazy imports, while the interpreter's files are readable
""" + DROP + r"""
sys.exit(cli.main(sys.argv[1:]))
"""


def as_nobody(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPANLET_")}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def open_dir():
    """A directory others may traverse (pytest's tmp_path is root-only)."""
    d = Path(tempfile.mkdtemp(prefix="spanlet-sec-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def agent_config(tmp: Path, *overrides: str) -> config.Config:
    return config.load(env={}, overrides=[
        f"data_dir={tmp}/data", "store.enabled=false", "tc.enabled=false", "sandbox.enabled=false",
        "gpu.enabled=false", "nvml.enabled=false", "http_port=0", "otlp.grpc_port=0",
        "otlp.http_port=0", f"admin_socket={tmp}/admin.sock", *overrides])


@pytest.fixture
def admin(open_dir):
    """A daemon's admin API (no probes) on a socket in `open_dir`."""
    d = Daemon(agent_config(open_dir))
    d.admin.start()
    try:
        yield d
    finally:
        d.admin.stop()


# ---------------------------------------------------------------------------
# admin socket

def test_admin_socket_is_root_only_by_mode_and_by_peer_credentials(admin, caplog):
    sock = Path(admin.cfg.admin_socket)
    st = sock.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600)
    # bound in a private directory and renamed: nothing else is left next to it
    assert sorted(os.listdir(sock.parent)) == ["admin.sock"]

    # mode 0600: a non-root process cannot even connect
    r = as_nobody(PEER, str(sock))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"connect_errno": errno.EACCES}

    # someone loosens the mode: the agent still refuses by the peer's uid, and says nothing else
    sock.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="spanlet.admin"):
        r = as_nobody(PEER, str(sock))
    assert r.returncode == 0, r.stderr
    assert json.loads(json.loads(r.stdout)["answer"]) == {"ok": False, "error": "permission denied"}
    assert any(f"refused a request from uid {NOBODY}" in m for m in caplog.messages)
    # root is served as before
    answer = inspect_mod.ask(str(sock), "summary")
    assert answer["ok"] is True and "exporters" in answer["data"]


@pytest.mark.parametrize("mode, message", [
    (0o600, "spanlet inspect: permission denied on {sock}: run as root"),
    (0o666, "spanlet inspect: permission denied by the agent on {sock}"),
])
def test_inspect_as_non_root_is_one_clear_line(admin, mode, message):
    sock = Path(admin.cfg.admin_socket)
    sock.chmod(mode)
    r = as_nobody(CLI, "inspect", "summary", "--socket", str(sock))
    assert r.returncode == inspect_mod.EXIT_PERMISSION == 4
    assert r.stdout == "" and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message.format(sock=sock)), r.stderr


# ---------------------------------------------------------------------------
# listening addresses

def listening(port: int) -> set[str]:
    """Local addresses of this process's TCP listeners on `port`, from
    /proc/net/tcp{,6} matched to our own socket inodes."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            addr, port_hex = f[1].split(":")
            if f[3] != "0A" or int(port_hex, 16) != port or f[9] not in inodes:   # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.add(socket.inet_ntop(family, raw))
    return found


def test_default_receiver_address_is_loopback_only(cfg):
    assert cfg.otlp.receiver_address == "127.0.0.1"


@pytest.mark.parametrize("address, expected, elsewhere", [
    ("127.0.0.1", {"127.0.0.1", "::ffff:127.0.0.1"}, "127.0.0.2"),
    ("127.0.0.2", {"127.0.0.2", "::ffff:127.0.0.2"}, "127.0.0.1"),
    ("::1", {"::1"}, "127.0.0.1"),
])
def test_otlp_receivers_bind_exactly_the_configured_address(tmp_path, address, expected, elsewhere):
    d = Daemon(agent_config(tmp_path, f"otlp.receiver_address={address}"))
    d.spans.start()
    try:
        rx = d.spans.receiver
        assert rx.running
        for port in (rx.grpc_port, rx.http_port):
            got = listening(port)
            assert got and got <= expected, (port, got)     # never 0.0.0.0 or ::
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((elsewhere, port), timeout=5).close()
            socket.create_connection((address, port), timeout=5).close()
    finally:
        d.spans.stop(time.monotonic() + 5)


# ---------------------------------------------------------------------------
# credentials

SECRET_PASSWORD = "pw-S3cr3t-1d8f"
SECRET_TOKEN = "tok-S3cr3t-77aa"
SECRET_API_KEY = "key-S3cr3t-90c1"
SECRET_ENV_KEY = "envkey-S3cr3t-5b"
SECRET_MALFORMED = "bad-S3cr3t-e3e3"
STORE_USER = "spanlet-writer"
BASIC = base64.b64encode(f"{STORE_USER}:{SECRET_PASSWORD}".encode()).decode()
SECRETS = [SECRET_PASSWORD, SECRET_TOKEN, SECRET_API_KEY, SECRET_ENV_KEY, SECRET_MALFORMED, BASIC]
OTEL_HEADERS = f"x-env-key={SECRET_ENV_KEY},authorization: Bearer {SECRET_MALFORMED}"


def assert_no_secret(text: str, where: str) -> None:
    for s in SECRETS:
        assert s not in text, f"{s!r} appears in {where}"


def secret_config(tmp: Path, store_url: str, upstream: str) -> config.Config:
    pw = tmp / "password"
    pw.write_text(SECRET_PASSWORD + "\n")
    return config.load(env={"OTEL_EXPORTER_OTLP_HEADERS": OTEL_HEADERS}, overrides=[
        "log_level=debug", f"admin_socket={tmp}/admin.sock", "store.backend=clickhouse",
        f"store.url={store_url}",
        f"store.user={STORE_USER}", f"store.password_file={pw}",
        f"otlp.upstream_endpoint={upstream}",
        f"otlp.upstream_headers={{authorization: Bearer {SECRET_TOKEN}, x-api-key: {SECRET_API_KEY}}}"])


def test_every_configured_credential_is_a_secret_and_redacted(tmp_path):
    cfg = secret_config(tmp_path, "http://ch:8123", "http://collector:4318")
    secrets = cfg.secrets(env={"OTEL_EXPORTER_OTLP_HEADERS": OTEL_HEADERS})
    for s in SECRETS:
        assert s in secrets
    line = (f"auth={BASIC} pw={SECRET_PASSWORD} h=Bearer {SECRET_TOKEN} k={SECRET_API_KEY} "
            f"e={SECRET_ENV_KEY} m={SECRET_MALFORMED} count=1234")
    assert config.redact(line, secrets) == "auth=*** pw=*** h=*** k=*** e=*** m=*** count=1234"
    # a password in store.url is refused at load, without echoing it
    with pytest.raises(config.ConfigError) as e:
        config.load(env={}, overrides=[f"store.url=http://u:{SECRET_PASSWORD}@ch:8123"])
    assert "store.url" in str(e.value) and SECRET_PASSWORD not in str(e.value)
    # nor does a mistyped --set key echo its value
    with pytest.raises(config.ConfigError) as e:
        config.load(env={}, overrides=[f"store.pasword={SECRET_PASSWORD}"])
    assert SECRET_PASSWORD not in str(e.value)


def test_the_cli_log_handler_and_the_admin_answers_redact(tmp_path, open_dir, capsys):
    cfg = secret_config(open_dir, "http://ch:8123", "http://collector:4318")
    root = logging.getLogger()
    saved = root.handlers[:], root.level, sys.excepthook, threading.excepthook
    root.handlers = []
    try:
        cli._setup_logging(cfg)
        logging.getLogger("spanlet.exporters.anything").error("sent Authorization: Bearer %s", SECRET_TOKEN)
        try:
            raise RuntimeError(f"server said: {BASIC}")
        except RuntimeError:
            logging.getLogger("spanlet").exception("store failed")
        t = threading.Thread(target=lambda: 1 / 0 if SECRET_API_KEY else None, name=SECRET_API_KEY)
        t.start()
        t.join()
    finally:
        for h in root.handlers:
            h.flush()
        root.handlers, level, sys.excepthook, threading.excepthook = saved
        root.setLevel(level)
        logging.captureWarnings(False)
    err = capsys.readouterr().err
    assert "sent Authorization: ***\n" in err and "server said: ***" in err
    assert "ZeroDivisionError" in err and "uncaught exception in thread ***" in err
    assert_no_secret(err, "the log")

    # an answer of the admin API that would carry a secret (a span named after one)
    d = Daemon(cfg)
    d.admin.start()
    try:
        req = ExportTraceServiceRequest()
        span = req.resource_spans.add().scope_spans.add().spans.add(
            name=f"login {SECRET_PASSWORD}", trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
        span.start_time_unix_nano, span.end_time_unix_nano = 1_234_000_000, 2_468_000_000
        d.admin.state.on_joined(req.resource_spans)
        out = inspect_mod.ask(cfg.admin_socket, "spans")
        assert out["data"]["spans"][0]["name"] == "login ***"
        assert out["data"]["spans"][0]["duration_s"] == 1.234       # numbers are left alone
    finally:
        d.admin.stop()


class Echo(http.server.ThreadingHTTPServer):
    """A server that echoes the request's credentials back in its error
    answers (some proxies and servers do): ClickHouse-style text for the
    store, google.rpc.Status for OTLP. Keeps the headers it saw."""

    daemon_threads = True

    def __init__(self):
        self.seen: list[dict] = []
        super().__init__(("127.0.0.1", 0), EchoHandler)


class EchoHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.server.seen.append({k.lower(): v for k, v in self.headers.items()})
        echoed = "; ".join(f"{k}={v}" for k, v in self.headers.items())
        if self.path.startswith("/v1/"):
            body = status_pb2.Status(code=3, message=f"bad request, you sent {echoed}").SerializeToString()
            self.send_response(400)
            self.send_header("Content-Type", "application/x-protobuf")
        else:
            body = (f"Code: 516. DB::Exception: {echoed}: Authentication failed "
                    "(AUTHENTICATION_FAILED)").encode()
            self.send_response(403)
            self.send_header("Content-Type", "text/plain")
            self.send_header("X-ClickHouse-Exception-Code", "516")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET = _answer


@pytest.mark.kernel
def test_no_credential_in_the_logs_or_inspect_output_of_a_running_agent(open_dir):
    """`spanlet run` at debug level against a store and a collector that both
    refuse, echoing the credentials they were sent: the credentials are used
    on the wire, and never appear in a log line or an inspect answer."""
    echo = Echo()
    threading.Thread(target=echo.serve_forever, daemon=True).start()
    port = echo.server_address[1]
    pw = open_dir / "password"
    pw.write_text(SECRET_PASSWORD + "\n")
    cfg_file = open_dir / "agent.yaml"
    cfg_file.write_text(f"""
log_level: debug
data_dir: {open_dir}/data
admin_socket: {open_dir}/admin.sock
http_address: 127.0.0.1
http_port: 0
tc: {{enabled: false}}
sandbox: {{enabled: false}}
gpu: {{enabled: false}}
nvml: {{enabled: false}}
otlp:
  grpc_port: 0
  http_port: 0
  upstream_endpoint: http://127.0.0.1:{port}/v1/traces
  upstream_headers: {{authorization: "Bearer {SECRET_TOKEN}", x-api-key: "{SECRET_API_KEY}"}}
  batch_interval_s: 0.1
store:
  backend: clickhouse
  url: http://{STORE_USER}@127.0.0.1:{port}
  password_file: {pw}
  batch_interval_s: 0.1
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPANLET_", "OTEL_"))}
    env["OTEL_EXPORTER_OTLP_HEADERS"] = OTEL_HEADERS
    err_path = open_dir / "stderr"
    with open(err_path, "w") as err_file:
        agent = subprocess.Popen([sys.executable, "-m", "spanlet.cli", "run", "--config", str(cfg_file)],
                                 cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err_file, text=True)
    outputs = []
    try:
        def log_text() -> str:
            return err_path.read_text(errors="replace")

        deadline = time.monotonic() + 120
        while "spanlet: running" not in log_text():
            assert agent.poll() is None, log_text()[-3000:]
            assert time.monotonic() < deadline, "agent did not start"
            time.sleep(0.2)
        grpc_port = int(re.search(r"OTLP receiver on 127\.0\.0\.1: gRPC port (\d+)", log_text()).group(1))
        # one span in, so that the exporter and the store both have something to send
        req = ExportTraceServiceRequest()
        req.resource_spans.add().scope_spans.add().spans.add(
            name="s", trace_id=b"\x01" * 16, span_id=b"\x02" * 8,
            start_time_unix_nano=time.time_ns() - 1000, end_time_unix_nano=time.time_ns())
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}",
                                   options=[("grpc.enable_http_proxy", 0)]) as ch:
            TraceServiceStub(ch).Export(req, timeout=30)

        def refused_by_both() -> bool:
            text = log_text()
            return "refused" in text and "clickhouse sink" in text
        deadline = time.monotonic() + 60
        while not refused_by_both():
            assert agent.poll() is None and time.monotonic() < deadline, log_text()[-3000:]
            time.sleep(0.2)
        for args in (["summary", "--json"], ["spans", "--json"], ["summary"], ["hints", "--json"]):
            r = subprocess.run([sys.executable, "-m", "spanlet.cli", "inspect", *args, "--socket",
                                f"{open_dir}/admin.sock"], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=60, check=False)
            assert r.returncode == 0, r.stderr
            outputs.append(r.stdout + r.stderr)
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            out, _ = agent.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            agent.kill()
            out, _ = agent.communicate()
        echo.shutdown()
        echo.server_close()
    log = err_path.read_text(errors="replace")
    assert agent.returncode == 0, log[-3000:]
    # the credentials did go out: to the store (basic auth) and the collector (headers)
    auth = {h.get("authorization") for h in echo.seen}
    assert f"Basic {BASIC}" in auth and f"Bearer {SECRET_TOKEN}" in auth
    assert any(h.get("x-env-key") == SECRET_ENV_KEY and h.get("x-api-key") == SECRET_API_KEY
               for h in echo.seen)
    # and came back in the refusals, which were logged and shown: hidden there
    assert " DEBUG " in log and "***" in log
    summary = json.loads(outputs[0])
    store = next(x for x in summary["data"]["exporters"] if x["name"] == "store")
    assert "***" in store["stats"]["last_error"]
    assert_no_secret(log + out, "the agent's log")
    for text in outputs:
        assert_no_secret(text, "inspect output")
