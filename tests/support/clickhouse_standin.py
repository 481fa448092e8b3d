"""A ClickHouse server stand-in for tests: ClickHouse's HTTP interface on 127.0.0.1
in front of a real embedded ClickHouse engine (chdb)."""
# clickhouse-connect talks HTTP to real SQL, real Native data and real tables. The server can go away
# in the ways a server does (503 from a proxy in front, connection refused, a hung server) and come
# back on the same port with its data.
from __future__ import annotations

import os
import re
import socket
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from spanlet.exporters.otlp.receiver import shut_down

UP, UNAVAILABLE_503, REFUSED, HUNG = "up", "503", "refused", "hung"

_FORMAT_AT_END = re.compile(r"\bFORMAT\s+(\w+)\s*$", re.IGNORECASE)
_CODE = re.compile(r"Code: (\d+)\.")
# The HTTP status ClickHouse answers for a few exception codes (everything else: 500).
_STATUS_OF_CODE = {60: 404, 81: 404, 62: 400, 47: 400, 16: 400, 27: 400, 516: 403, 497: 403}
# Query parameters that are protocol, not settings.
_NOT_SETTINGS = {"query", "database", "default_format", "query_id", "session_id", "session_timeout",
                 "session_check", "user", "password", "compress", "decompress", "enable_http_compression",
                 "wait_end_of_query", "send_progress_in_http_headers", "http_headers_progress_interval_ms"}


class ChdbHttpStandin:
    """ClickHouse over HTTP on 127.0.0.1:`port` (0: a free one), data under `data_dir` (kept across
    set_mode(REFUSED) and back). Counts the INSERT statements it executed in `inserts`."""

    def __init__(self, data_dir: str, port: int = 0):
        from chdb import session as chdb_session

        self.data_dir = data_dir
        self._session = chdb_session.Session(data_dir)
        self._session.query("SET session_timezone = 'UTC'")
        self._db_lock = threading.Lock()
        self._mode_lock = threading.Condition()
        self.mode = UP
        self.inserts = 0
        self.requests_refused = 0  # answered 503 or held hung
        self._hung: list[socket.socket] = []
        self._open: set[socket.socket] = set()  # connections being served (keep-alive included)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = port
        self._listen()

    # -- control ------------------------------------------------------------------------------------

    def set_mode(self, mode: str) -> None:
        with self._mode_lock:
            old, self.mode = self.mode, mode
            self._mode_lock.notify_all()
        if mode == REFUSED and old != REFUSED:
            self._stop_listening()
        if old == REFUSED and mode != REFUSED:
            self._listen()
        if mode != HUNG:
            self._release_hung()

    def query(self, sql: str) -> str:
        """A statement straight on the engine (not through HTTP), its answer as TabSeparated text."""
        with self._db_lock:
            return self._session.query(sql, "TabSeparated").bytes().decode()

    def close(self) -> None:
        with self._mode_lock:
            self.mode = REFUSED
            self._mode_lock.notify_all()
        self._stop_listening()
        self._release_hung()
        with self._db_lock:
            self._session.close()

    # -- listening ----------------------------------------------------------------------------------

    def _listen(self) -> None:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *args) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with standin._mode_lock:
                    standin._open.add(self.connection)

            def finish(self) -> None:
                with standin._mode_lock:
                    standin._open.discard(self.connection)
                super().finish()

            def do_POST(self) -> None:
                standin._handle(self)

            def do_GET(self) -> None:
                standin._handle(self)

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def _stop_listening(self) -> None:
        """The server is gone: no listener, and every open connection (kept-alive ones too) is cut."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join(5)
        with self._mode_lock:
            open_now = list(self._open)
        shut_down(open_now)

    def _release_hung(self) -> None:
        with self._mode_lock:
            hung, self._hung = self._hung, []
        shut_down(hung)

    # -- requests -----------------------------------------------------------------------------------

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        with self._mode_lock:
            mode = self.mode
            if mode == REFUSED:  # a request that raced the shutdown of its connection
                req.close_connection = True
                return
            if mode in (UNAVAILABLE_503, HUNG):
                self.requests_refused += 1
            if mode == HUNG:
                self._hung.append(req.connection)
        if mode == UNAVAILABLE_503:
            self._body(req)
            self._answer(req, 503, b"no healthy upstream", "text/plain")
            return
        if mode == HUNG:
            # A hung server: the request is never read nor answered; the connection is cut when it recovers.
            with self._mode_lock:
                self._mode_lock.wait_for(lambda: self.mode != HUNG)
            req.close_connection = True
            return
        params = {k: v[-1] for k, v in parse_qs(urlsplit(req.path).query).items()}
        body = self._body(req)
        if "query" in params:
            sql, data = params["query"], body
        elif body.lstrip()[:6].upper() == b"INSERT":  # the statement's line, then the data
            head, _, data = body.partition(b"\n")
            sql = head.decode("utf-8", errors="replace")
        else:
            sql, data = body.decode("utf-8", errors="replace"), b""
        try:
            payload = self._execute(sql, data, params)
        except Exception as exc:  # chdb's errors carry ClickHouse's text and code
            text = str(exc).strip()
            found = _CODE.search(text)
            code = int(found.group(1)) if found else 1001
            status, payload = _STATUS_OF_CODE.get(code, 500), (text + "\n").encode()
            self._answer(req, status, payload, "text/plain", {"X-ClickHouse-Exception-Code": str(code)})
            return
        self._answer(req, 200, payload, "application/octet-stream")

    def _execute(self, sql: str, data: bytes, params: dict[str, str]) -> bytes:
        text = sql.strip().rstrip(";")
        head = text.split(None, 1)[0].upper() if text else ""
        settings = [f"{k} = '{v}'" for k, v in params.items() if k not in _NOT_SETTINGS]
        with self._db_lock:
            self._use(params.get("database"))
            for setting in settings:
                self._session.query(f"SET {setting}")
            if head == "INSERT":
                return self._insert(text, data)
            found = _FORMAT_AT_END.search(text)
            fmt = params.get("default_format", "TabSeparated")
            if found:
                fmt, text = found.group(1), text[:found.start()].rstrip()
            result = self._session.query(text, fmt)
            return result.bytes() if result is not None else b""

    def _insert(self, text: str, data: bytes) -> bytes:
        found = _FORMAT_AT_END.search(text)
        if not found:  # INSERT ... VALUES / SELECT: all in the statement
            self._session.query(text, "TabSeparated")
        else:
            fd, path = tempfile.mkstemp(dir=self.data_dir, prefix=".insert-", suffix=".bin")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                statement = text[:found.start()].rstrip()
                self._session.query(f"{statement} FROM INFILE '{path}' FORMAT {found.group(1)}", "TabSeparated")
            finally:
                os.unlink(path)
        self.inserts += 1
        return b""

    def _use(self, database: str | None) -> None:
        target = database or "default"
        exists = self._session.query(f"SELECT count() FROM system.databases WHERE name = '{target}'",
                                     "TabSeparated").bytes().strip() == b"1"
        self._session.query(f"USE {target if exists else 'default'}")

    @staticmethod
    def _body(req: BaseHTTPRequestHandler) -> bytes:
        if req.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = bytearray()
            while True:
                size = int(req.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    req.rfile.readline()
                    return bytes(body)
                body += req.rfile.read(size)
                req.rfile.readline()
        length = int(req.headers.get("Content-Length") or 0)
        return req.rfile.read(length) if length else b""

    @staticmethod
    def _answer(req: BaseHTTPRequestHandler, status: int, payload: bytes, content_type: str,
                headers: dict[str, str] | None = None) -> None:
        req.send_response(status)
        req.send_header("Content-Type", content_type)
        req.send_header("Content-Length", str(len(payload)))
        req.send_header("X-ClickHouse-Format", "Native")
        req.send_header("X-ClickHouse-Timezone", "UTC")
        for key, value in (headers or {}).items():
            req.send_header(key, value)
        req.end_headers()
        req.wfile.write(payload)
