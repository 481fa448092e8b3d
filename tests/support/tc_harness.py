"""What the TC classifier's kernel tests share: the addresses of the test's
namespace pair, the probe with the events it received, and a connected TCP
pair across the namespaces."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from netns import Namespace, socket_in
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
