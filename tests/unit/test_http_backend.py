# Tests of HttpBackend (and ClickHouseSink over it) against a real HTTP server on 127.0.0.1 that speaks the part
# of ClickHouse's HTTP interface clickhouse-connect uses: TabSeparated command answers, Native query results and
# Native INSERT bodies. Error mapping, retries spaced by the backoff, spool replay order, secret hygiene.
from __future__ import annotations

import base64
import logging
import random
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from spanlet.exporters.clickhouse import BackendError, BackendUnavailable, schema
from spanlet.exporters.clickhouse.http_backend import HttpBackend
from spanlet.exporters.batching import backoff_delay
from spanlet.exporters.clickhouse.sink import ClickHouseSink

PASSWORD = "s3cr3t-Pa55w0rd-do-not-log"
USER = "spanlet_writer"
TABLES = {"t": [("Seq", "UInt64"), ("Body", "String")]}


# -- a minimal ClickHouse HTTP server ------------------------------------------------------------

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _string(text: str) -> bytes:
    data = text.encode()
    return _varint(len(data)) + data


def native_block(columns: list[tuple[str, str]], rows: list[tuple]) -> bytes:
    out = _varint(len(columns)) + _varint(len(rows))
    for i, (name, ch_type) in enumerate(columns):
        out += _string(name) + _string(ch_type)
        for row in rows:
            out += _string(row[i]) if ch_type == "String" else struct.pack("<Q", row[i])
    return out


def decode_native(buf: bytes) -> list[tuple]:
    """Rows of the Native blocks of an INSERT body (UInt64 and String columns)."""
    rows: list[tuple] = []
    pos = 0
    while pos < len(buf):
        ncols, pos = _read_varint(buf, pos)
        nrows, pos = _read_varint(buf, pos)
        columns = []
        for _ in range(ncols):
            for _ in range(2):  # name, type
                size, pos = _read_varint(buf, pos)
                columns.append(buf[pos:pos + size].decode())
                pos += size
            ch_type = columns[-1]
            values = []
            for _ in range(nrows):
                if ch_type == "UInt64":
                    values.append(struct.unpack_from("<Q", buf, pos)[0])
                    pos += 8
                else:
                    size, pos = _read_varint(buf, pos)
                    values.append(buf[pos:pos + size].decode())
                    pos += size
            columns.append(values)
        value_lists = columns[2::3]
        rows.extend(zip(*value_lists))
    return rows


class FakeClickHouse:
    """Answers the statements clickhouse-connect issues; refuses INSERTs on demand; records what it got."""

    def __init__(self, port: int = 0):
        self.lock = threading.Lock()
        self.inserted: list[tuple] = []
        self.insert_attempts: list[float] = []  # monotonic receive time of every INSERT
        self.statements: list[str] = []
        self.auth_headers: set[str] = set()
        self.refuse_inserts = 0  # answer the next N INSERTs with 503
        self.refuse_all = threading.Event()  # answer every INSERT with 503 while set
        self.insert_error: tuple[int, int, str] | None = None  # (status, clickhouse code, text) for INSERTs
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                fake._handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    @staticmethod
    def _body(req: BaseHTTPRequestHandler) -> bytes:
        if req.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = b""
            while True:
                size = int(req.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    req.rfile.readline()
                    return body
                body += req.rfile.read(size)
                req.rfile.readline()
        length = int(req.headers.get("Content-Length") or 0)
        return req.rfile.read(length) if length else b""

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        body = self._body(req)
        sql, _, data = body.partition(b"\n")
        text = sql.decode(errors="replace")
        with self.lock:
            self.auth_headers.add(req.headers.get("Authorization", ""))
        if text.startswith("INSERT"):
            self._insert(req, text, data)
            return
        with self.lock:
            self.statements.append(text)
        if "version()" in text:
            self._answer(req, 200, b"24.8.1.1\tUTC\n")
        elif "system.settings" in text:
            self._answer(req, 200, native_block([("name", "String"), ("value", "String"), ("readonly", "String")], []))
        elif text.startswith("DESCRIBE"):
            name = text.split("`")[-2]
            cols = ["name", "type", "default_type", "default_expression", "comment", "codec_expression",
                    "ttl_expression"]
            rows = [(c, t, "", "", "", "", "") for c, t in TABLES[name]]
            self._answer(req, 200, native_block([(c, "String") for c in cols], rows))
        elif text.startswith("SELECT max(Version)"):
            self._answer(req, 200, native_block([("max(Version)", "UInt64")], []))
        elif text.startswith("SELECT count()"):
            self._answer(req, 200, native_block([("count()", "UInt64")], [(len(self.inserted),)]))
        elif text.startswith("SELECT 1 AS check"):
            self._answer(req, 200, b"")
        else:  # DDL and other commands
            self._answer(req, 200, b"")

    def _insert(self, req, text: str, data: bytes) -> None:
        with self.lock:
            self.insert_attempts.append(time.monotonic())
            refuse = self.refuse_all.is_set() or self.refuse_inserts > 0
            if self.refuse_inserts > 0:
                self.refuse_inserts -= 1
            error = self.insert_error
        if refuse:
            self._answer(req, 503, b"Service Unavailable")
            return
        if error is not None:
            status, code, message = error
            self._answer(req, status, f"Code: {code}. DB::Exception: {message}\n".encode(),
                         {"X-ClickHouse-Exception-Code": str(code)})
            return
        rows = decode_native(data)
        with self.lock:
            self.inserted.extend(rows)
        self._answer(req, 200, b"", {"X-ClickHouse-Summary": f'{{"written_rows":"{len(rows)}"}}'})

    @staticmethod
    def _answer(req, status: int, payload: bytes, headers: dict[str, str] | None = None) -> None:
        req.send_response(status)
        req.send_header("Content-Length", str(len(payload)))
        req.send_header("X-ClickHouse-Format", "Native")
        for key, value in (headers or {}).items():
            req.send_header(key, value)
        req.end_headers()
        req.wfile.write(payload)


@pytest.fixture
def server():
    fake = FakeClickHouse()
    try:
        yield fake
    finally:
        fake.close()


@pytest.fixture
def password_file(tmp_path):
    path = tmp_path / "password"
    path.write_text(PASSWORD + "\n")
    return path


def make_backend(server, password_file, **kw) -> HttpBackend:
    params = dict(user=USER, password_file=password_file, compress=False, database="spanlet",
                  ddl=lambda db, ttl, cluster: [f"CREATE DATABASE IF NOT EXISTS {db}",
                                                f"CREATE TABLE IF NOT EXISTS {db}.t (Seq UInt64, Body String) "
                                                f"ENGINE = MergeTree ORDER BY Seq TTL now() + INTERVAL {ttl} DAY"])
    params.update(kw)
    return HttpBackend(f"http://127.0.0.1:{server.port}", **params)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows(start: int, count: int) -> list[list]:
    return [[i, f"body-{i}"] for i in range(start, start + count)]


# -- backend ---------------------------------------------------------------------------------------

def test_insert_and_schema_reach_the_server_with_credentials_from_the_secret_file(server, password_file):
    backend = make_backend(server, password_file, ttl_days=3)
    try:
        assert backend.ensure_schema() == 2
        assert any("INTERVAL 3 DAY" in s for s in server.statements)
        backend.insert("t", ["Seq", "Body"], rows(0, 3))
        backend.insert("t", ["Seq", "Body"], rows(3, 2))
        assert server.inserted == [(i, f"body-{i}") for i in range(5)]
        assert sum(s.startswith("DESCRIBE") for s in server.statements) == 1  # insert context cached
        assert backend.query("SELECT count() FROM t") == [(5,)]
        expected = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        assert server.auth_headers == {expected}
    finally:
        backend.close()
        backend.close()


def test_ensure_schema_without_ddl_runs_the_migrations(server, password_file):
    backend = make_backend(server, password_file, ddl=None, cluster="prod")
    try:
        assert backend.ensure_schema() == schema.SCHEMA_VERSION
        creates = [s for s in server.statements if s.startswith("CREATE TABLE")]
        assert creates and all("ON CLUSTER" in s for s in creates)
        assert len(server.insert_attempts) == schema.SCHEMA_VERSION  # one version row per migration
    finally:
        backend.close()


def test_connection_refused_is_unavailable_and_connects_later(password_file):
    port = free_port()
    backend = HttpBackend(f"http://127.0.0.1:{port}", user=USER, password_file=password_file,
                          compress=False, connect_timeout_s=1.0)
    late = None
    try:
        with pytest.raises(BackendUnavailable):
            backend.insert("t", ["Seq", "Body"], rows(0, 1))
        with pytest.raises(BackendUnavailable):
            backend.query("SELECT count() FROM t")
        late = FakeClickHouse(port=port)  # the store comes up where the agent looks for it
        backend.insert("t", ["Seq", "Body"], rows(0, 2))
        assert late.inserted == [(0, "body-0"), (1, "body-1")]
    finally:
        backend.close()
        if late is not None:
            late.close()


@pytest.mark.parametrize("status, code, expected", [
    (503, None, BackendUnavailable),
    (500, 252, BackendUnavailable),   # TOO_MANY_PARTS: the server is fine but busy
    (500, 1001, BackendUnavailable),  # a 5xx with any code
    (400, 62, BackendError),          # SYNTAX_ERROR
    (404, 60, BackendError),          # UNKNOWN_TABLE
    (400, 241, BackendUnavailable),   # MEMORY_LIMIT_EXCEEDED is retryable whatever the status
    (403, 516, BackendError),         # AUTHENTICATION_FAILED
])
def test_error_mapping(server, password_file, status, code, expected):
    backend = make_backend(server, password_file)
    try:
        if code is None:
            server.refuse_inserts = 1
        else:
            server.insert_error = (status, code, f"failure for {PASSWORD[:3]}")
        with pytest.raises(expected) as info:
            backend.insert("t", ["Seq", "Body"], rows(0, 1))
        assert PASSWORD not in str(info.value)
    finally:
        backend.close()


def test_password_never_in_repr_logs_or_errors(server, password_file, caplog):
    secret_b64 = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    with caplog.at_level(logging.DEBUG):
        backend = make_backend(server, password_file)
        assert PASSWORD not in repr(backend) and PASSWORD not in str(backend)
        assert "***" in repr(backend) and USER in repr(backend)
        direct = HttpBackend("http://127.0.0.1:1", user=USER, password=PASSWORD)
        assert PASSWORD not in repr(direct) and PASSWORD not in repr(vars(direct))
        server.refuse_all.set()
        sink = ClickHouseSink(backend, batch_rows=5, batch_interval_s=0.01, queue_rows=10, spool_dir=None,
                              min_backoff_s=0.01, max_backoff_s=0.02)
        sink.write("t", ["Seq", "Body"], rows(0, 5))
        assert not sink.flush(0.3)
        server.refuse_all.clear()
        server.insert_error = (400, 62, "Syntax error")
        sink.write("t", ["Seq", "Body"], rows(5, 5))
        assert sink.flush(5.0)
        sink.shutdown(1.0)
        sink.shutdown(1.0)
        stats = sink.stats()
        assert stats["dropped_rows"] == {"rejected": 10} and stats["retries"] >= 1
    with pytest.raises(ValueError) as info:
        HttpBackend(f"http://{USER}:{PASSWORD}@127.0.0.1:1")
    assert PASSWORD not in str(info.value)
    assert caplog.records, "the run above logs (so the check below means something)"
    for record in caplog.records:
        text = record.getMessage() + (logging.Formatter().formatException(record.exc_info) if record.exc_info else "")
        assert PASSWORD not in text and secret_b64 not in text
    assert PASSWORD not in str(stats)


# -- sink over the HTTP backend --------------------------------------------------------------------

def test_retries_are_spaced_by_the_backoff_and_nothing_is_lost(server, password_file, tmp_path):
    server.refuse_inserts = 4
    backend = make_backend(server, password_file)
    sink = ClickHouseSink(backend, batch_rows=10, batch_interval_s=0.01, queue_rows=100,
                          spool_dir=tmp_path / "spool", min_backoff_s=0.04, max_backoff_s=0.2,
                          rng=random.Random(11))
    try:
        sink.write("t", ["Seq", "Body"], rows(0, 10))
        assert sink.flush(10.0)
    finally:
        sink.shutdown(1.0)
    assert server.inserted == [(i, f"body-{i}") for i in range(10)]
    # The same seeded jitter gives the delays the sink waited between attempts 1..5.
    rng = random.Random(11)
    delays = [backoff_delay(n, 0.04, 0.2, rng) for n in range(1, 5)]
    gaps = [b - a for a, b in zip(server.insert_attempts, server.insert_attempts[1:])]
    assert len(server.insert_attempts) == 5
    for gap, delay in zip(gaps, delays):
        assert gap >= delay
    assert 0.02 <= delays[0] <= 0.04 and 0.1 <= delays[3] <= 0.2  # doubling steps, half of each jittered
    assert sink.stats()["retries"] == 4


def test_spool_is_replayed_in_order_when_the_server_returns(server, password_file, tmp_path):
    server.refuse_all.set()
    backend = make_backend(server, password_file)
    sink = ClickHouseSink(backend, batch_rows=10, batch_interval_s=0.01, queue_rows=20,
                          spool_dir=tmp_path / "spool", min_backoff_s=0.01, max_backoff_s=0.05)
    try:
        for b in range(10):
            sink.write("t", ["Seq", "Body"], rows(b * 10, 10))
        assert sink.stats()["spooled_files"] >= 8
        assert sink.stats()["queued_rows_max"] <= 20
        server.refuse_all.clear()
        assert sink.flush(10.0)
    finally:
        sink.shutdown(1.0)
    assert server.inserted == [(i, f"body-{i}") for i in range(100)]
    assert sink.stats()["dropped_rows_total"] == 0
    assert list((tmp_path / "spool").iterdir()) == []
