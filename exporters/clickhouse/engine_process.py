"""The embedded engine (a chdb session) in a process of its own, so that its
memory (the library's code pages, its caches, its merges' buffers) is not the
agent's, and its crash costs the agent nothing but a restart.

EngineProcess is what ChdbBackend runs its statements on in place of an
in-process chdb session: `query(sql, fmt)` answers an object with `.bytes()`
as a session's result does, and a statement the engine refuses raises with the
engine's own text (ChdbBackend classifies it as it does an in-process
error). The rows are encoded in the agent (RowBinary, Native) and written to
the data directory's incoming file by it, as before: what crosses the pipe is
the statement and its answer. A process that ended (killed, out of memory, a
crash in the engine) is noticed by the statement that finds it gone:
BackendUnavailable, so that the sink keeps the rows and retries; the process is
started again at the next statement, at most once per back-off (1 s, doubling
to 60 s while starts fail or the process keeps ending within a minute). A
statement with no answer within `timeout_s` (a hung engine) has the process
killed and is BackendUnavailable as well: the sink's worker is not held. The
child ends when the agent closes the pipe, as its end closes when the agent
dies: its pipe's ends are passed to it alone (never inherited by the agent's
other children), so it ends at the EOF that follows.

Frames: a request is <u32 len(fmt)> <u32 len(sql)> fmt sql (an empty fmt: a
request of the agent's own, RELEASE); an answer is <u8 status> <u64 len>
payload, status 0 with the result's bytes, 1 with the engine's error text.
The process gives its freed heap back every TRIM_EVERY_S, as the agent does.

    python -m spanlet.exporters.clickhouse.engine_process URI READ_FD WRITE_FD
"""

from __future__ import annotations

import logging
import os
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

from spanlet.exporters.clickhouse import BackendError, BackendUnavailable
from spanlet.memory import release_startup_memory, trim_heap

log = logging.getLogger("spanlet")

_REQUEST = struct.Struct("<II")
_ANSWER = struct.Struct("<BQ")
_OK, _FAILED = 0, 1
BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 60.0
STABLE_S = 60.0          # a process that lived this long restarts the back-off
START_TIMEOUT_S = 120.0
STATEMENT_TIMEOUT_S = 600.0  # the default wait for a statement's answer (then the process is killed)
TRIM_EVERY_S = 60.0       # the engine's freed heap given back (as the agent's own, daemon.py)
RELEASE = "release"


class EngineFailed(Exception):
    """The engine refused a statement: its own text (ChdbBackend classifies it)."""


class _Result:
    __slots__ = ("_data",)

    def __init__(self, data: bytes):
        self._data = data

    def bytes(self) -> bytes:
        return self._data


def _read_exact(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("pipe closed")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class EngineProcess:
    """A chdb session at `uri` in a child process; `setup` statements (SET ...)
    run at each start. Not thread-safe: its caller (ChdbBackend) holds a lock."""

    def __init__(self, uri: str, setup: tuple[str, ...] = (), timeout_s: float = STATEMENT_TIMEOUT_S):
        self.uri, self.setup, self.timeout_s = uri, tuple(setup), timeout_s
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._rfd = self._wfd = -1
        self._started_at = 0.0
        self._backoff = BACKOFF_FIRST_S
        self._next_start = 0.0
        self._closed = False
        self._start()          # the first start's failure is the backend's: BackendError

    # -- the session's interface -------------------------------------------------------------------

    def query(self, sql: str, fmt: str = "CSV") -> _Result:
        if self._closed:
            raise BackendError("the store engine's process is closed")
        if self._proc is None:
            wait = self._next_start - time.monotonic()
            if wait > 0:
                raise BackendUnavailable(f"the store engine's process is restarting (in {wait:.0f} s)")
            try:
                self._start()
            except BackendError as e:
                if self._next_start <= time.monotonic():   # not planned yet (_ended plans its own)
                    self._schedule_start()
                raise BackendUnavailable(str(e)) from e
            self.restarts += 1
        status, payload = self._ask(sql, fmt)
        if status != _OK:
            raise EngineFailed(payload.decode("utf-8", "replace"))
        return _Result(payload)

    def release_memory(self) -> int:
        """Ask the process to give back what its start left resident (bytes paged out)."""
        return int(self.query(RELEASE, "").bytes() or 0)

    def close(self, timeout_s: float = 30.0) -> None:
        self._closed = True
        self._stop(timeout_s)

    # -- what the agent reports ---------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def rss_bytes(self) -> int:
        """The process's resident memory (0 while there is none)."""
        pid = self.pid
        if pid is None:
            return 0
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return 0

    # -- the child ----------------------------------------------------------------------------------

    def _start(self) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        cmd = [sys.executable, "-m", "spanlet.exporters.clickhouse.engine_process", self.uri,
               str(to_child_r), str(from_child_w)]
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, pass_fds=(to_child_r, from_child_w),
                                    close_fds=True)
        except OSError as e:
            for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
                os.close(fd)
            raise BackendError(f"cannot start the store engine's process: {e}") from e
        os.close(to_child_r)
        os.close(from_child_w)
        self._proc, self._rfd, self._wfd = proc, from_child_r, to_child_w
        self._started_at = time.monotonic()
        try:
            status, payload = self._ask(None, None, START_TIMEOUT_S)   # its first answer: the session is open
            if status != _OK:
                raise BackendError(f"the store engine's process could not open its store: "
                                   f"{payload.decode('utf-8', 'replace')}")
            for stmt in self.setup:
                status, payload = self._ask(stmt, "CSV")
                if status != _OK:
                    raise BackendError(f"{stmt}: {payload.decode('utf-8', 'replace')}")
        except (BackendError, BackendUnavailable) as e:
            self._stop(5.0)
            raise BackendError(str(e)) from e
        log.info("store engine: process %d", proc.pid)

    def _ask(self, sql: str | None, fmt: str | None, timeout_s: float | None = None) -> tuple[int, bytes]:
        """One exchange (sql None: read the start's answer only); no answer
        within timeout_s (default: the statement timeout) has the process killed."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            if sql is not None:
                f, s = fmt.encode(), sql.encode()
                _write_all(self._wfd, _REQUEST.pack(len(f), len(s)) + f + s)
            poller = select.poll()           # not select(): the agent's fds pass 1,024 (BPF maps, sockets)
            poller.register(self._rfd, select.POLLIN)
            if not poller.poll(timeout_s * 1000):
                self._proc.kill()
                raise TimeoutError(f"no answer within {timeout_s:g} s, the process killed")
            status, size = _ANSWER.unpack(_read_exact(self._rfd, _ANSWER.size))
            return status, _read_exact(self._rfd, size)
        except (OSError, EOFError, struct.error) as e:
            code = self._ended()
            raise BackendUnavailable(f"the store engine's process ended ({code}): {e}") from e

    def _ended(self) -> str:
        """The child is gone or its pipe broke: reap it and plan the next start."""
        proc = self._proc
        self._stop(5.0)
        code = proc.returncode if proc is not None else None
        what = (f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}")
        self._schedule_start()
        log.error("store engine: process %s ended (%s); next start in %.0f s",
                  proc.pid if proc is not None else "?", what, self._next_start - time.monotonic())
        return what

    def _schedule_start(self) -> None:
        if self._started_at and time.monotonic() - self._started_at >= STABLE_S:
            self._backoff = BACKOFF_FIRST_S
        self._next_start = time.monotonic() + self._backoff
        self._backoff = min(BACKOFF_MAX_S, self._backoff * 2)

    def _stop(self, timeout_s: float) -> None:
        proc, self._proc = self._proc, None
        for fd in (self._wfd, self._rfd):          # EOF on its pipe: the child closes its session and ends
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._rfd = self._wfd = -1
        if proc is None:
            return
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the child's side --------------------------------------------------------------------------------

def _answer(fd: int, status: int, payload: bytes) -> None:
    _write_all(fd, _ANSWER.pack(status, len(payload)) + payload)


def _control(what: str) -> bytes:
    """RELEASE: what the engine's start left resident given back (the agent
    asks once its store is ready); the bytes of mappings paged out."""
    if what == RELEASE:
        return str(release_startup_memory()).encode()
    return b""


def serve(uri: str, rfd: int, wfd: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the agent's Ctrl-C is the agent's: it closes the pipe
    # chdb imports pyarrow where it can (numpy and OpenBLAS with it: 0.07 s
    # of a start's CPU, ~40 MB resident) for Arrow results, which the store
    # never asks for; None in sys.modules makes that import fail, as chdb expects
    sys.modules.setdefault("pyarrow", None)
    try:
        from chdb import session as chdb_session
        sess = chdb_session.Session(uri)
    except Exception as e:    # chdb raises RuntimeError/ChdbError
        _answer(wfd, _FAILED, str(e).encode())
        return 1
    _answer(wfd, _OK, b"")
    trimmed = time.monotonic()
    try:
        while True:
            try:
                flen, slen = _REQUEST.unpack(_read_exact(rfd, _REQUEST.size))
                fmt = _read_exact(rfd, flen).decode()
                sql = _read_exact(rfd, slen).decode()
            except EOFError:
                return 0
            if not fmt:                              # a request of the agent's own
                data, status = _control(sql), _OK
            else:
                try:
                    res = sess.query(sql, fmt)
                    data = res.bytes() if res is not None else b""
                    status = _OK
                except Exception as e:
                    data, status = (str(e) or repr(e)).encode(), _FAILED
            _answer(wfd, status, data or b"")
            if time.monotonic() - trimmed >= TRIM_EVERY_S:
                trimmed = time.monotonic()
                trim_heap()
    finally:
        try:
            sess.close()
        except Exception:
            pass


def main(argv: list[str]) -> int:
    return serve(argv[0], int(argv[1]), int(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
