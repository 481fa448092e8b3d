"""The agent's one HTTP port for people and scrapers: /metrics (Prometheus),
/v1/hints (scheduler feed), /healthz and /readyz."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CollectorRegistry

from spanlet.exporters.prometheus import exposition


class _Handler(BaseHTTPRequestHandler):
    server: "AgentHttpServer"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, ctype = exposition(self.server.registry, self.headers.get("Accept", ""))
            status = 200
        elif path == "/v1/hints" and self.server.hints is not None:
            body = (json.dumps(self.server.hints(), indent=1) + "\n").encode()
            status, ctype = 200, "application/json"
        elif path == "/healthz":
            body, status, ctype = b"ok\n", 200, "text/plain"
        elif path == "/readyz":
            ready = self.server.ready()
            body, status = (b"ready\n", 200) if ready else (b"starting\n", 503)
            ctype = "text/plain"
        else:
            body, status, ctype = b"not found\n", 404, "text/plain"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


# How often an idle server's loop would wake to look for a stop: it does not
# need to, stop_serving() wakes it at once (each wake-up of an idle agent's
# thread costs CPU on every node).
IDLE_POLL_S = 5.0


def serve_in_thread(server: ThreadingHTTPServer, name: str) -> threading.Thread:
    """server.serve_forever() on a daemon thread, started; stop it with stop_serving()."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": IDLE_POLL_S},
                              name=name, daemon=True)
    thread.start()
    return thread


def stop_serving(server: ThreadingHTTPServer) -> None:
    """End server.serve_forever() now: shutting the listening socket down makes
    its select() return, and no new connection is taken (requests in flight
    go on in their threads)."""
    try:
        server.socket.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    server.shutdown()


class AgentHttpServer(ThreadingHTTPServer):
    """The agent's one HTTP port for people and scrapers."""

    daemon_threads = True

    def __init__(self, address: str, port: int, registry: CollectorRegistry,
                 ready: Callable[[], bool], hints: Callable[[], dict] | None = None):
        super().__init__((address, port), _Handler)
        self.registry = registry
        self.ready = ready
        self.hints = hints
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = serve_in_thread(self, "http")

    def stop(self) -> None:
        if self._thread is not None:
            stop_serving(self)
            self.server_close()
            self._thread = None
