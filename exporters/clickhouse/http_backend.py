# ClickHouse server/cluster backend over the HTTP interface (clickhouse-connect).
# Maps transport failures to BackendUnavailable and refusals to BackendError; never reveals the password.
from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from spanlet.exporters.clickhouse import BackendError, BackendUnavailable
from spanlet.exporters.clickhouse import rows as rows_mod

log = logging.getLogger(__name__)

DdlFactory = Callable[[str, int, "str | None"], "list[str]"]

DEFAULT_HTTP_PORT = 8123
DEFAULT_HTTPS_PORT = 8443

# ClickHouse error codes that mean "try again later" even when the server answers (overload, replica or
# Keeper trouble, timeouts, a full or failing disk). Everything else the server answers with is a refusal of
# this data/statement. The embedded backend reads its engine's errors with the same set.
RETRYABLE_CLICKHOUSE_CODES = frozenset({
    3,    # UNEXPECTED_END_OF_FILE
    24,   # CANNOT_WRITE_TO_OSTREAM
    74,   # CANNOT_READ_FROM_FILE_DESCRIPTOR
    75,   # CANNOT_WRITE_TO_FILE_DESCRIPTOR (ENOSPC, EIO while writing a part)
    76,   # CANNOT_OPEN_FILE (EROFS, EMFILE)
    77,   # CANNOT_CLOSE_FILE
    88,   # CANNOT_TRUNCATE_FILE
    159,  # TIMEOUT_EXCEEDED
    160,  # TOO_SLOW
    164,  # READONLY (replica in read-only mode while Keeper is away)
    172,  # CANNOT_CREATE_DIRECTORY
    173,  # CANNOT_ALLOCATE_MEMORY
    202,  # TOO_MANY_SIMULTANEOUS_QUERIES
    203,  # NO_FREE_CONNECTION
    204,  # CANNOT_FSYNC
    209,  # SOCKET_TIMEOUT
    210,  # NETWORK_ERROR
    241,  # MEMORY_LIMIT_EXCEEDED
    242,  # TABLE_IS_READ_ONLY
    243,  # NOT_ENOUGH_SPACE (the store's disk is full)
    252,  # TOO_MANY_PARTS
    279,  # ALL_CONNECTION_TRIES_FAILED
    319,  # UNKNOWN_STATUS_OF_INSERT
    425,  # SYSTEM_ERROR
    439,  # CANNOT_SCHEDULE_TASK
    458,  # CANNOT_UNLINK
    586,  # CANNOT_CREATE_FILE
    999,  # KEEPER_EXCEPTION
})
_ROW_STATEMENTS = frozenset({"SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXISTS", "EXPLAIN"})
_STATUS_IN_MESSAGE = re.compile(r"HTTP status (\d{3})")


class _Secret:
    """Holds a credential; every text form of it is masked."""

    __slots__ = ("_value",)

    def __init__(self, value: str | None):
        self._value = value

    def reveal(self) -> str | None:
        return self._value

    def __repr__(self) -> str:
        return "'***'" if self._value else "None"

    __str__ = __repr__


def read_password_file(path: str | Path) -> str:
    """A mounted Kubernetes secret: the whole file is the password, less one trailing newline."""
    text = Path(path).read_text(encoding="utf-8")
    return text[:-1] if text.endswith("\n") else text


class HttpBackend:
    """Backend protocol implementation for a ClickHouse server reached over HTTP(S)."""

    name = "clickhouse-http"

    def __init__(
        self,
        url: str,
        database: str = "spanlet",
        user: str | None = None,
        password: str | None = None,
        password_file: str | Path | None = None,
        secure: bool = False,
        ca_file: str | Path | None = None,
        ttl_days: int = 7,
        cluster: str | None = None,
        ddl: DdlFactory | None = None,
        *,
        compress: bool | str = True,
        connect_timeout_s: float = 5.0,
        send_receive_timeout_s: float = 30.0,
    ):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.password:
            raise ValueError("clickhouse url must not carry a password; use password or password_file")
        self.secure = bool(secure) or parts.scheme == "https"
        self.host = parts.hostname or "localhost"
        self.port = parts.port or (DEFAULT_HTTPS_PORT if self.secure else DEFAULT_HTTP_PORT)
        self.url = f"{'https' if self.secure else 'http'}://{self.host}:{self.port}"
        self.database = database
        self.user = user or parts.username
        if password is None and password_file is not None:
            password = read_password_file(password_file)
        self._password = _Secret(password)
        self.ca_file = str(ca_file) if ca_file else None
        self.ttl_days = ttl_days
        self.cluster = cluster
        self._ddl = ddl
        self._compress = compress
        self._connect_timeout_s = connect_timeout_s
        self._send_receive_timeout_s = send_receive_timeout_s
        self._client: Any = None
        self._last_status: int | None = None
        self._insert_contexts: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"HttpBackend(url={self.url!r}, database={self.database!r}, user={self.user!r}, "
                f"password={self._password!r}, cluster={self.cluster!r})")

    __str__ = __repr__

    # -- Backend protocol -------------------------------------------------------------------------

    def ensure_schema(self) -> int:
        """Bring the store's schema up to date; returns the schema version.

        With `ddl` given, runs its statements and returns how many ran (a stand-in version); otherwise runs
        schema.migrate, the same forward migrations the chdb backend applies."""
        with self._lock:
            self._insert_contexts.clear()
            if self._ddl is not None:
                statements = list(self._ddl(self.database, self.ttl_days, self.cluster))
                for statement in statements:
                    self._statement(statement)
                version = len(statements)
            else:
                from spanlet.exporters.clickhouse import schema

                target = schema.Target(database=self.database, ttl_days=self.ttl_days, cluster=self.cluster)
                version = schema.migrate(self._statement, target)
        log.info("clickhouse schema at version %d on %s", version, self.url)
        return version

    def insert(self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        if not rows:
            return
        if tuple(columns) == rows_mod.SPAN_PROTO_COLUMNS:
            # serialized spans: their columns built here (any server version reads these)
            columns, rows = rows_mod.TRACE_COLUMNS, rows_mod.rows_from_span_protos(rows)
        elif tuple(columns) == rows_mod.KERNEL_RECORD_COLUMNS:
            columns, rows = rows_mod.KERNEL_EVENT_COLUMNS, rows_mod.rows_from_kernel_records(rows)
        elif tuple(columns) == rows_mod.METRIC_SERIES_COLUMNS:
            columns, rows = rows_mod.METRIC_COLUMNS, rows_mod.rows_from_metric_series(rows)
        width = len(columns)
        if any(len(row) != width for row in rows):
            raise BackendError(f"a row without {width} values for {width} columns")
        # column-oriented: the driver writes each column's values in one pass
        data = [list(values) for values in zip(*rows)]
        key = (table, tuple(columns))
        with self._lock:
            client = self._connected()
            context = self._insert_contexts.get(key)
            if context is None:
                context = self._call(client.create_insert_context, table=table, column_names=list(columns),
                                     database=self.database, column_oriented=True)
                self._insert_contexts[key] = context
            context.data = data
            try:
                self._call(client.insert, context=context)
            except BackendError:
                # The table may have changed under us; look its columns up again next time.
                self._insert_contexts.pop(key, None)
                raise

    def query(self, sql: str) -> list[tuple]:
        """Run one statement; rows for a SELECT-like statement, [] for any other."""
        with self._lock:
            return self._statement(sql)

    def close(self) -> None:
        # Without the lock: an insert stuck on a dead server must not hold shutdown for its whole timeout.
        # Closing the pool under it makes that insert fail as BackendUnavailable, so its batch is spooled.
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a pool that lost its server is not worth a traceback
                log.debug("clickhouse client close failed", exc_info=True)

    # -- internals --------------------------------------------------------------------------------

    def _statement(self, sql: str) -> list[tuple]:
        client = self._connected()
        text = sql.strip().rstrip(";")
        head = text.split(None, 1)[0].upper() if text else ""
        if head in _ROW_STATEMENTS:
            result = self._call(client.query, text, settings={"database": self.database})
            return [tuple(row) for row in result.result_rows]
        self._call(client.command, text)
        return []

    def _connected(self) -> Any:
        """The client, connected on first use so that an agent starts while the store is away."""
        if self._client is None:
            self._insert_contexts.clear()
            self._client = self._call(self._make_client)
        return self._client

    def _make_client(self) -> Any:
        import clickhouse_connect

        kwargs: dict[str, Any] = dict(
            host=self.host,
            port=self.port,
            username=self.user or "default",
            password=self._password.reveal() or "",
            secure=self.secure,
            compress=self._compress,
            # The HTTP client keeps whole seconds (0.5 would become 0, which it refuses): round up here, and
            # give the connection pool the exact values below once the client exists.
            connect_timeout=max(1, math.ceil(self._connect_timeout_s)),
            send_receive_timeout=max(1, math.ceil(self._send_receive_timeout_s)),
            query_retries=0,  # the sink owns retries and backoff
            autogenerate_session_id=False,
        )
        if self.ca_file:
            kwargs["ca_cert"] = self.ca_file
        client = clickhouse_connect.get_client(**kwargs)
        if hasattr(type(client), "timeout"):
            from urllib3 import Timeout

            client.timeout = Timeout(connect=self._connect_timeout_s, read=self._send_receive_timeout_s)
        self._record_http_status(client)
        return client

    def _record_http_status(self, client: Any) -> None:
        """Keep the HTTP status of a failed answer: clickhouse-connect's exceptions drop it when the server
        also sent an exception code, and 4xx/5xx is what tells a refusal from an outage."""
        transport = getattr(client, "_backend", None)
        inner = getattr(transport, "error_handler", None)
        if not callable(inner):
            return

        def recording(response: Any, retried: bool = False) -> None:
            self._last_status = getattr(response, "status", None)
            inner(response, retried)

        transport.error_handler = recording

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._last_status = None
        try:
            return fn(*args, **kwargs)
        except (BackendError, BackendUnavailable):
            raise
        except Exception as exc:  # noqa: BLE001 - every driver failure is classified below
            raise self._classify(exc) from None

    def _classify(self, exc: Exception) -> Exception:
        from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError

        message = self._scrub(f"{type(exc).__name__}: {exc}")
        if isinstance(exc, OperationalError) or isinstance(exc, (ConnectionError, TimeoutError, OSError)):
            return BackendUnavailable(message)
        if isinstance(exc, DatabaseError):
            code = getattr(exc, "code", None)
            status = self._last_status
            if status is None:
                found = _STATUS_IN_MESSAGE.search(str(exc))
                status = int(found.group(1)) if found else None
            if code in RETRYABLE_CLICKHOUSE_CODES or (status is not None and status >= 500):
                return BackendUnavailable(message)
            if status is None and code is None:
                # Neither a status nor a server code: the request never got a proper answer.
                return BackendUnavailable(message)
            return BackendError(message)
        return BackendError(message)

    def _scrub(self, text: str) -> str:
        secret = self._password.reveal()
        return text.replace(secret, "***") if secret else text
