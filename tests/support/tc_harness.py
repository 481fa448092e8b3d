"""What the TC classifier's kernel tests share: the addresses of the test's
namespace pair, the probe with the events it received, a connected TCP pair
across the namespaces, and the capture's count of the same traffic by class."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

from netns import Capture, Namespace, socket_in
from spanlet import events
from spanlet.probes.tc.probe import TcProbe

CLIENT_IP, SERVER_IP = "169.254.77.1", "169.254.77.2"


@dataclass
class Env:
    cli: Namespace
    srv: Namespace
    probe: TcProbe
    events: list = field(default_factory=list)

    def http_events(self, port: int) -> list[events.HttpRequest]:
        self.probe.drain()
        return [e for e in self.events if isinstance(e, events.HttpRequest) and e.flow.dport == port]

    def flow_events(self) -> list[events.FlowSeen]:
        self.probe.drain()
        return [e for e in self.events if isinstance(e, events.FlowSeen)]


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


class TcpPair:
    """A connected client (client namespace) and server (server namespace) socket."""

    def __init__(self, env: Env, port: int):
        listener = socket_in(env.srv.name)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((SERVER_IP, port))
            listener.listen(1)
            self.client = socket_in(env.cli.name)
            self.client.settimeout(10)
            self.client.connect((SERVER_IP, port))
            self.server, _ = listener.accept()
            self.server.settimeout(10)
        finally:
            listener.close()

    def exchange(self, request: bytes, response: bytes) -> None:
        self.client.sendall(request)
        assert recv_exact(self.server, len(request)) == request
        if response:
            self.server.sendall(response)
            assert recv_exact(self.client, len(response)) == response

    def close(self) -> None:
        """Orderly close, both FINs seen by the other side before returning."""
        self.client.shutdown(socket.SHUT_WR)
        assert self.server.recv(1) == b""
        self.server.close()
        assert self.client.recv(1) == b""
        self.client.close()


# ---- the independent count: the capture's frames by server port --------------------

def server_port(frame) -> int:
    return frame.sport if frame.egress else frame.dport


def tally_by_port(frames, classes: dict[int, tuple[str, str]]) -> dict[tuple[str, str, str], tuple[int, int]]:
    """{(direction, protocol, modality): (frames, bytes)} of captured frames,
    by what the test knows each server port carries."""
    out: dict[tuple[str, str, str], list[int]] = {}
    for f in frames:
        proto, mod = classes.get(server_port(f), (f"unexpected port {server_port(f)}", "?"))
        t = out.setdefault((f.direction, proto, mod), [0, 0])
        t[0] += 1
        t[1] += f.length
    return {k: (v[0], v[1]) for k, v in out.items()}


def delta(now: dict, before: dict) -> dict:
    out = {}
    for k, (p, b) in now.items():
        p0, b0 = before.get(k, (0, 0))
        if (p - p0, b - b0) != (0, 0):
            out[k] = (p - p0, b - b0)
    return out


def converge_by_port(probe: TcProbe, cap: Capture, before: dict, classes: dict[int, tuple[str, str]],
                     timeout: float = 5.0):
    """The last ACKs of a close travel after the test's own handshake ends:
    read until the probe and the capture agree or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        cap.drain()
        expected = tally_by_port(cap.frames, classes)
        got = delta(probe.totals(), before)
        if got == expected or time.monotonic() > deadline:
            return got, expected
        time.sleep(0.02)
