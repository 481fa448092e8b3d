"""Network bytes joined to the server span of an HTTP/1.1 request through the
traceparent the TC program parsed on the wire: in a pair of test namespaces,
an instrumented server gets two requests on one keep-alive connection; each
server span carries exactly its request's wire bytes."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spanlet import config
from spanlet.daemon import Daemon
from netns import Capture, http_request_bytes, linked, socket_in
from otlp_upstream import Upstream, kernel_attrs, wait_for

pytestmark = pytest.mark.kernel
ROOT = Path(__file__).resolve().parents[2]
SERVER, CLIENT, PORT = "169.254.93.2", "169.254.93.1", 8081
RESPONSE = [5000, 5000]


def request(tp: str, body: bytes) -> bytes:
    return (f"POST /v1/infer HTTP/1.1\r\nHost: model\r\ntraceparent: {tp}\r\n"
            f"Content-Type: image/png\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def read_response(sock, size: int) -> None:
    got = b""
    while not got.endswith(b"x" * size) or b"\r\n\r\n" not in got:
        chunk = sock.recv(65536)
        assert chunk, "server closed early"
        got += chunk


@pytest.fixture
def nets():
    with linked("spanlet-hj", "hjc0", CLIENT, "hjs0", SERVER) as pair:
        yield pair


def test_server_span_carries_its_requests_bytes(nets):
    client, server = nets
    up = Upstream()
    up.rx.start()
    cfg = config.load(env={}, overrides=[
        "sandbox.enabled=false", "gpu.enabled=false", f"tc.netns={server.name}",
        "tc.interfaces=hjs0", "store.enabled=false", "otlp.grpc_port=0", "otlp.http_port=0",
        "otlp.upstream_protocol=grpc", f"otlp.upstream_endpoint={up.endpoint()}",
        "otlp.batch_interval_s=0.1"])
    agent = Daemon(cfg)
    agent.check_node()
    agent.start()
    cap = Capture(server, "hjs0")
    child = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "support" / "http_server_child.py"), server.name,
         SERVER, str(PORT), f"127.0.0.1:{agent.spans.receiver.grpc_port}",
         str(RESPONSE[0]), "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        tc = next(p for p in agent.probes if p.name == "tc_classify")
        assert tc.status.attached, tc.status.reason
        assert child.stdout.readline().strip() == "listening"
        trace = secrets.token_hex(16)
        parents = [secrets.token_hex(8) for _ in RESPONSE]
        bodies = [b"p" * 1000, b"q" * 300]
        sock = socket_in(client.name)
        sock.connect((SERVER, PORT))
        sock.sendall(request(f"00-{trace}-{parents[0]}-01", bodies[0]))
        read_response(sock, RESPONSE[0])
        served = [child.stdout.readline().split()[1]]
        sock.sendall(request(f"00-{trace}-{parents[1]}-01", bodies[1]))
        read_response(sock, RESPONSE[0])
        served.append(child.stdout.readline().split()[1])
        time.sleep(0.3)  # let the last frames reach the capture and the reader
        cap.drain()
        expected = http_request_bytes(cap.frames, PORT)
        assert len(expected) == 2
        # the first request is finished (a second one started), the second still open
        wait_for(lambda: agent.spans.join._http_done, 5, "the first request's bytes")
        child.stdin.write("flush\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "flushed"
        wait_for(lambda: all(s in up.spans for s in served), 10, "the server spans upstream")
        for sid, parent, (rx, tx) in zip(served, parents, expected):
            span, _ = up.spans[sid]
            assert span.parent_span_id.hex() == parent
            a = kernel_attrs(span)
            assert (a["kernel.net.rx_bytes"], a["kernel.net.tx_bytes"]) == (rx, tx), span
        sock.close()
    finally:
        child.kill()
        child.wait(5)
        cap.close()
        agent.stop()
        up.rx.stop()
