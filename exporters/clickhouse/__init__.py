"""ClickHouse storage: the Backend interface that the embedded (chdb) and the
server (clickhouse-connect) backends implement, and the errors they raise."""

from __future__ import annotations

from typing import Any, Protocol, Sequence


class BackendUnavailable(Exception):
    """Retryable: the store cannot be reached now."""


class BackendError(Exception):
    """Not retryable: the store refused the data or the statement."""


class Backend(Protocol):
    name: str

    def ensure_schema(self) -> int: ...   # applies forward migrations, returns the schema version

    def insert(self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None: ...

    def query(self, sql: str) -> list[tuple]: ...

    def close(self) -> None: ...
