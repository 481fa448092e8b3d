"""otel_traces rows made from serialized spans: the embedded store's insert
of rows.SPAN_PROTO_COLUMNS.

The rows (each span's bytes, its resource and scope beside it) are laid out
in C (native/spanlet_wire.c, trace_native) as one block of ClickHouse's
Native format: the table's columns as the engine holds them, so that the
engine's part of an insert is reading plain columns and writing the part.
(The engine parsing the spans itself, format ProtobufList with an
INSERT ... SELECT of expressions over the OTLP fields, cost it ~4 µs a span
more than this whole path.)

The stored values are those of rows.span_rows, exactly: the few spans whose
attribute text pcommon writes in ways not worth doing in C (arrays and maps,
which the collector stores as JSON; doubles it prints with many digits or as
NaN/Inf; a key twice in one map), spans not of the OTLP proto's shape, and
rows whose resource or scope is not str texts are named in `skip` and go
through rows.span_rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from spanlet.exporters.clickhouse import schema
from spanlet.exporters.clickhouse.rows import TRACE_COLUMNS

try:
    from spanlet._wire import trace_native as _trace_native
except ImportError:        # a source tree without its build: every span goes the Python way
    _trace_native = None


def native(proto_rows: Sequence[Sequence]) -> tuple[bytes | None, list[int]]:
    """(the Native block of the rows but those in skip, or None where there
    are none; skip: the indices of the rows rows.span_rows must make)."""
    if _trace_native is None:
        return None, list(range(len(proto_rows)))
    return _trace_native(proto_rows)


def insert_sql(database: str, table: str, path: str) -> str:
    """INSERT of the Native block in the file at `path` (made by native)."""
    cols = ", ".join(schema.quote_identifier(c) for c in TRACE_COLUMNS)
    return (f"INSERT INTO {database}.{table} ({cols}) SELECT * "
            f"FROM file({schema.quote_string(path)}, 'Native')")
