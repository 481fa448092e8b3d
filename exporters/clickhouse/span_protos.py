"""otel_traces rows made by the engine from serialized spans: the embedded
store's insert of rows.SPAN_PROTO_COLUMNS.

Python's part per span is one SerializeToString (rows.span_proto_rows) and
a few bytes of framing here; ClickHouse parses the spans (format
ProtobufList, with a schema of the OTLP Span's fields) and builds every
column in one INSERT ... SELECT, where building them in Python and encoding
them as JSON cost ~5 times as much CPU per span.

The stored values are those of rows.span_rows, exactly: `complex_spans`
first names the few spans whose attribute text the engine could write
differently (arrays and maps, which the collector stores as JSON; doubles
that ClickHouse may print with an exponent; a key twice in one map), read
from their bytes in C (native/spanlet_wire.c); the INSERT leaves those out
and they go through rows.span_rows. `complex_rows_sql` is the engine's own
answer to the same question (what the C test must include, shown by the
tests). (The count of rows an INSERT wrote cannot tell: it includes what
the views on the table wrote.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from spanlet.exporters.clickhouse import schema

try:
    from spanlet._wire import complex_spans as _complex_spans
    from spanlet._wire import envelope as _wire_envelope
except ImportError:        # a source tree without its build: every span goes the Python way
    _complex_spans = _wire_envelope = None
from spanlet.exporters.clickhouse.rows import SPAN_KINDS, STATUS_CODES, TRACE_COLUMNS

# The OTLP trace proto's field numbers (opentelemetry/proto/trace/v1/trace.proto,
# common/v1/common.proto), only the fields otel_traces stores, plus the row's
# resource/scope group, appended to each span's bytes (a field the OTLP Span
# does not have: concatenated protobuf messages merge). The oneof is named
# `which` so that no column is named like its message.
GROUP_FIELD = 1000
SCHEMA = """syntax = "proto3";
message AnyValue {
  oneof which {
    string string_value = 1; bool bool_value = 2; int64 int_value = 3; double double_value = 4;
    bytes array_value = 5; bytes kvlist_value = 6; bytes bytes_value = 7;
  }
}
message KeyValue { string key = 1; AnyValue value = 2; }
message Event { fixed64 time_unix_nano = 1; string name = 2; repeated KeyValue attributes = 3; }
message Link { bytes trace_id = 1; bytes span_id = 2; string trace_state = 3; repeated KeyValue attributes = 4; }
message Status { string message = 2; int32 code = 3; }
message Span {
  bytes trace_id = 1; bytes span_id = 2; string trace_state = 3; bytes parent_span_id = 4;
  string name = 5; int32 kind = 6; fixed64 start_time_unix_nano = 7; fixed64 end_time_unix_nano = 8;
  repeated KeyValue attributes = 9; repeated Event events = 11; repeated Link links = 13;
  Status status = 15; uint32 spanlet_group = %d;
}
""" % GROUP_FIELD
MESSAGE = "Span"

# Nullable: an absent oneof member reads as NULL, so the member that is set is known.
_VALUE = ("Tuple(string_value Nullable(String), bool_value Nullable(Bool), int_value Nullable(Int64), "
          "double_value Nullable(Float64), array_value Nullable(String), kvlist_value Nullable(String), "
          "bytes_value Nullable(String))")
_KV = f"Nested(key String, value {_VALUE})"
STRUCTURE = (
    "trace_id String, span_id String, trace_state String, parent_span_id String, name String, "
    "kind Int32, start_time_unix_nano UInt64, end_time_unix_nano UInt64, "
    f"attributes {_KV}, events Nested(time_unix_nano UInt64, name String, attributes {_KV}), "
    f"links Nested(trace_id String, span_id String, trace_state String, attributes {_KV}), "
    "status Tuple(message String, code Int32), spanlet_group UInt32")


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_GROUP_TAGS = [varint(GROUP_FIELD << 3) + varint(i) for i in range(128)]


class Envelope(NamedTuple):
    data: bytes          # ProtobufList data: the spans, each tagged with its group
    groups: list         # (resource attributes, service, scope name, scope version), by index
    nested: bool         # a span has events or links


def envelope(proto_rows: Sequence[Sequence]) -> Envelope:
    """The rows' spans as the engine reads them (python_envelope's bytes and
    groups, made in C: native/spanlet_wire.c)."""
    if _wire_envelope is None:
        return python_envelope(proto_rows)
    return Envelope(*_wire_envelope(proto_rows))


def python_envelope(proto_rows: Sequence[Sequence]) -> Envelope:
    """The rows' spans as the engine reads them. Groups are told apart by the
    identity of the resource's dict (shared by its spans) and the scope's
    strings."""
    groups: dict[tuple, int] = {}
    order: list[tuple[dict, str, str, str]] = []
    parts = []
    append = parts.append
    nested = False
    for blob, has_nested, res_attrs, service, scope_name, scope_version in proto_rows:
        key = (id(res_attrs), service, scope_name, scope_version)
        g = groups.get(key)
        if g is None:
            g = groups[key] = len(order)
            order.append((res_attrs, service, scope_name, scope_version))
        tag = _GROUP_TAGS[g] if g < 128 else varint(GROUP_FIELD << 3) + varint(g)
        append(b"\x0a" + varint(len(blob) + len(tag)))
        append(blob)
        append(tag)
        nested = nested or has_nested
    body = b"".join(parts)
    return Envelope(varint(len(body)) + body, order, nested)


def _source(path: str, schema_path: str) -> str:
    """The file's spans as rows; the schema from the .proto file at
    `schema_path` (an absolute path: chdb reads it where it is; from text it
    would write a copy into the process's working directory)."""
    if ":" in schema_path:
        raise ValueError(f"a schema path with ':' cannot be named to the engine: {schema_path!r}")
    return (f"file({schema.quote_string(path)}, 'ProtobufList', {schema.quote_string(STRUCTURE)}) "
            f"SETTINGS format_schema = {schema.quote_string(f'{schema_path}:{MESSAGE}')}, max_threads = 1")
# One reading thread: rows come in file order, so rowNumberInAllBlocks() is
# the same row in complex_rows_sql and insert_sql.


def _text(v: str) -> str:
    """pcommon AsString of an AnyValue tuple `v` as SQL (what _complex finds excluded)."""
    return (f"multiIf(isNotNull({v}.string_value), assumeNotNull({v}.string_value), "
            f"isNotNull({v}.int_value), toString(assumeNotNull({v}.int_value)), "
            f"isNotNull({v}.bool_value), if(assumeNotNull({v}.bool_value), 'true', 'false'), "
            f"isNotNull({v}.double_value), toString(assumeNotNull({v}.double_value)), "
            f"isNotNull({v}.bytes_value), base64Encode(assumeNotNull({v}.bytes_value)), '')")


def _map(keys: str, values: str) -> str:
    return f"mapFromArrays({keys}, arrayMap(v -> {_text('v')}, {values}))"


def _hex(c: str) -> str:
    """rows._hex_or_empty: '' for an empty or all-zero id."""
    return f"if(replaceAll({c}, '\\0', '') = '', '', lower(hex({c})))"


def _complex_map(keys: str, values: str) -> str:
    """True where a Map's text would not be rows.attributes_map's."""
    return (f"(length(arrayDistinct({keys})) != length({keys}) OR arrayExists(v -> isNotNull(v.array_value) "
            f"OR isNotNull(v.kvlist_value) OR (isNotNull(v.double_value) "
            f"AND match(toString(assumeNotNull(v.double_value)), '[a-z]')), {values}))")


def _complex(nested: bool) -> str:
    """True for a span whose row the engine would not write as rows.span_rows does."""
    cond = [_complex_map("attributes.key", "attributes.value")]
    if nested:
        cond += [f"arrayExists((k, v) -> {_complex_map('k', 'v')}, {n}.attributes.key, {n}.attributes.value)"
                 for n in ("events", "links")]
    return " OR ".join(cond)


def _enum_text(values: dict[int, str], column: str) -> str:
    keys = ", ".join(str(k) for k in values)
    names = ", ".join(schema.quote_string(v) for v in values.values())
    return f"transform({column}, [{keys}], [{names}], '')"


def complex_spans(blobs: Sequence[bytes]) -> list[int]:
    """The indices of the serialized spans insert_sql must leave out: a
    superset of what complex_rows_sql finds (all of them without the C part)."""
    if _complex_spans is None:
        return list(range(len(blobs)))
    return _complex_spans(blobs)


def complex_rows_sql(path: str, schema_path: str, nested: bool) -> str:
    """The 0-based row numbers of the spans that insert_sql leaves out."""
    return (f"SELECT n FROM (SELECT rowNumberInAllBlocks() AS n, {_complex(nested)} AS c "
            f"FROM {_source(path, schema_path)}) WHERE c")


def insert_sql(database: str, table: str, path: str, schema_path: str, env: Envelope,
               skip: Sequence[int] = ()) -> str:
    """INSERT of the spans in the file at `path` (written from `env`) but the
    rows `skip` (what complex_rows_sql found: rows.span_rows makes those)."""
    q = schema.quote_string

    def pick(values: list[str]) -> str:
        return values[0] if len(values) == 1 else f"[{', '.join(values)}][spanlet_group + 1]"

    groups = env.groups
    resources = ["map(" + ", ".join(f"{q(k)}, {q(v)}" for k, v in g[0].items()) + ")" for g in groups]
    select = [
        "fromUnixTimestamp64Nano(toInt64(start_time_unix_nano))",
        _hex("trace_id"), _hex("span_id"), _hex("parent_span_id"), "trace_state", "name",
        _enum_text(SPAN_KINDS, "kind"),
        pick([q(g[1]) for g in groups]),
        pick(resources),
        pick([q(g[2]) for g in groups]),
        pick([q(g[3]) for g in groups]),
        _map("attributes.key", "attributes.value"),
        "if(end_time_unix_nano > start_time_unix_nano, end_time_unix_nano - start_time_unix_nano, 0)",
        _enum_text(STATUS_CODES, "status.code"),
        "status.message",
    ]
    if env.nested:
        attr_maps = "arrayMap((k, v) -> {m}, {n}.attributes.key, {n}.attributes.value)"
        select += [
            "arrayMap(t -> fromUnixTimestamp64Nano(toInt64(t)), events.time_unix_nano)",
            "events.name",
            attr_maps.format(m=_map("k", "v"), n="events"),
            f"arrayMap(x -> {_hex('x')}, links.trace_id)",
            f"arrayMap(x -> {_hex('x')}, links.span_id)",
            "links.trace_state",
            attr_maps.format(m=_map("k", "v"), n="links"),
        ]
    else:
        select += ["[]"] * 7
    cols = ", ".join(schema.quote_identifier(c) for c in TRACE_COLUMNS)
    return (f"INSERT INTO {database}.{table} ({cols}) SELECT {', '.join(select)} "
            f"FROM {_rows_but(path, schema_path, skip)}")


def _rows_but(path: str, schema_path: str, skip: Sequence[int]) -> str:
    if not skip:
        return _source(path, schema_path)
    return (f"(SELECT *, rowNumberInAllBlocks() AS spanlet_row FROM {_source(path, schema_path)}) "
            f"WHERE spanlet_row NOT IN ({', '.join(str(int(n)) for n in skip)})")
