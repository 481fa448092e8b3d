"""The agent's HTTP servers sleep while idle (serve_forever's poll of IDLE_POLL_S)
and stop at once all the same: stop_serving() wakes the loop by shutting the
listening socket down."""

from __future__ import annotations

import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from spanlet.exporters.http import IDLE_POLL_S, serve_in_thread, stop_serving


class _Ok(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")


def test_an_idle_server_stops_long_before_its_poll_would_notice():
    assert IDLE_POLL_S >= 5
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    thread = serve_in_thread(server, "test-http")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        assert urllib.request.urlopen(url, timeout=5).read() == b"ok"
        time.sleep(0.2)                       # the loop back in its select()
        t0 = time.monotonic()
        stop_serving(server)
        thread.join(timeout=IDLE_POLL_S * 2)
        assert not thread.is_alive()
        assert time.monotonic() - t0 < IDLE_POLL_S / 2, "stop waited for the poll instead of waking the loop"
    finally:
        server.server_close()
