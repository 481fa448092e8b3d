"""kernel_events rows made by the engine from the ring buffer's records as
they are: the embedded store's insert of rows.KERNEL_RECORD_COLUMNS.

Python's part per event is its struct's bytes and a few bytes of framing
here (RowBinary: each record padded to the largest struct, its epoch time,
its pod's names, and for records with a flow its addresses as text); the
engine reads the struct's fields at the offsets of the one ctypes definition
(agent/events.py) and writes every column in one INSERT ... SELECT, where
building each row in Python cost ~30 µs an event. The stored values are
those of rows.kernel_event_row, exactly (the tests compare both ways).
"""

from __future__ import annotations

import ctypes as C
import struct
from collections.abc import Sequence

from spanlet import events
from spanlet.exporters.clickhouse import BackendError, schema
from spanlet.exporters.clickhouse.rows import KERNEL_EVENT_COLUMNS, _KE_DEFAULTS, _KE_INDEX
from spanlet.exporters.clickhouse.span_protos import varint

_HEADER = C.sizeof(events.Header)
BODY = max(C.sizeof(cls) for cls in events.RECORDS.values()) - _HEADER
_SIZES = {int(kind): C.sizeof(cls) for kind, cls in events.RECORDS.items()}
_KIND_AT = events.Header.kind.offset
_FLOW_KINDS = {int(k) for k, cls in events.RECORDS.items() if "flow" in dict(cls._fields_)}
_FLOW_AT = {events.RECORDS[k].flow.offset for k in _FLOW_KINDS}.pop()   # one offset for every kind with a flow
_PADS = [bytes(n) for n in range(BODY + 1)]
_EPOCH = struct.Struct("<q")

_WORDS = (BODY + 7) // 8
# The input's columns: the header's fields (bpf/spanlet.h), the payload as
# 64-bit words (each field is read with shifts and masks: every field of
# the structs is aligned, so none crosses a word), then what user space
# adds to a record.
STRUCTURE = ("ts UInt64, pid UInt32, tid UInt32, cgroup UInt64, trace FixedString(16), span UInt64, "
             "kind UInt16, modality UInt8, flags UInt8, hpad UInt32, "
             + "".join(f"w{i} UInt64, " for i in range(_WORDS))
             + "epoch Int64, ns String, pod String, container String, node String, src String, dst String")

def _at(offset: int, ctype) -> str:
    """SQL of the integer of `ctype` at `offset` in the payload."""
    size = C.sizeof(ctype)
    word, shift = divmod(offset, 8)
    if shift + size > 8:
        raise ValueError(f"field at {offset} of {size} bytes crosses a word")
    sql = f"w{word}" if shift == 0 else f"bitShiftRight(w{word}, {shift * 8})"
    if size < 8:
        sql = f"toUInt{size * 8}(bitAnd({sql}, {(1 << size * 8) - 1}))"
    return f"reinterpretAsInt32({sql})" if ctype is C.c_int32 else sql


def _num(cls, name: str, at: int = 0, ctype=None) -> str:
    """SQL of the integer field `name` of record `cls` (of struct at `at` in it)."""
    ctype = ctype or dict(cls._fields_)[name]
    return _at(at + getattr(cls, name).offset - _HEADER, ctype)


def _array(cls, name: str) -> str:
    arr = dict(cls._fields_)[name]
    base = getattr(cls, name).offset - _HEADER
    width = C.sizeof(arr._type_)
    return "[" + ", ".join(_at(base + i * width, arr._type_) for i in range(arr._length_)) + "]"


def _flow_num(name: str) -> str:
    return _num(events.FlowKey, name, _FLOW_AT)


def _names(enum_cls) -> str:
    """The members' names as an array indexed by value + 1 ('' where no member has a value)."""
    by_value = {int(m): m.name for m in enum_cls}
    if min(by_value) < 0 or max(by_value) > 255:
        raise ValueError(f"{enum_cls.__name__}: values outside 0..255")
    return "[" + ", ".join(schema.quote_string(by_value.get(v, "")) for v in range(max(by_value) + 1)) + "]"


def _enum(enum_cls, sql: str, other: str | None = None) -> str:
    """rows._enum_name: the member's name, else the number as text (or `other`).
    An array element (cheaper for the engine to plan than transform); toString
    only for the rows outside the enum (if() evaluates a branch for its rows)."""
    name = f"arrayElement({_names(enum_cls)}, {sql} + 1)"
    fallback = schema.quote_string(other) if other is not None else f"toString({sql})"
    return f"if({name} = '', {fallback}, {name})"


def _payload_sources() -> dict[str, list[tuple[int, str]]]:
    """column -> [(kind, SQL of its value for records of that kind)], as
    rows.kernel_event_row fills the payload columns."""
    K = events.Kind
    out: dict[str, list[tuple[int, str]]] = {}

    def put(col: str, kind: int, sql: str) -> None:
        out.setdefault(col, []).append((int(kind), sql))

    launch, sync, sandbox = events.GpuLaunch, events.GpuSync, events.SandboxViolation
    for kind, cls in ((K.GPU_LAUNCH, launch), (K.GPU_SYNC, sync)):
        put("Api", kind, _enum(events.Api, _num(cls, "api")))
        put("Entry", kind, _enum(events.Entry, _num(cls, "entry")))
        put("Stream", kind, _num(cls, "stream"))
        put("DurationNs", kind, _num(cls, "duration_ns"))
    put("Func", K.GPU_LAUNCH, _num(launch, "func"))
    put("Grid", K.GPU_LAUNCH, _array(launch, "grid"))
    put("Block", K.GPU_LAUNCH, _array(launch, "block"))
    put("SharedMem", K.GPU_LAUNCH, _num(launch, "shared_mem"))
    put("Rule", K.SANDBOX, _enum(events.Rule, _num(sandbox, "rule")))
    put("Action", K.SANDBOX, _enum(events.Action, _num(sandbox, "action")))
    for col, name in (("Addr", "addr"), ("Len", "len"), ("PoolMaxBytes", "pool_max_bytes"), ("Prot", "prot"),
                      ("MapFlags", "flags"), ("PoolId", "pool_id"), ("Fd", "fd")):
        put(col, K.SANDBOX, _num(sandbox, name))
    for kind in sorted(_FLOW_KINDS):
        put("SrcAddr", kind, "src")
        put("DstAddr", kind, "dst")
        put("SrcPort", kind, _flow_num("sport"))
        put("DstPort", kind, _flow_num("dport"))
        put("L4Proto", kind, _flow_num("l4proto"))
    for kind, cls in ((K.HTTP, events.HttpRequest), (K.FLOW, events.FlowSeen)):
        put("Ifindex", kind, _num(cls, "ifindex"))
        put("Direction", kind, _enum(events.Direction, _num(cls, "direction")))
    http, http_bytes = events.HttpRequest, events.HttpBytes
    put("Method", K.HTTP, _num(http, "method"))
    put("PathHash", K.HTTP, _num(http, "path_hash"))
    put("TraceFlags", K.HTTP, _num(http, "trace_flags"))
    put("ProtoClass", K.FLOW, _enum(events.Proto, _num(events.FlowSeen, "proto_class")))
    req = f"bitAnd({_num(http_bytes, 'req_dir')}, 1)"
    sent = [_num(http_bytes, "bytes", 8 * i, C.c_uint64) for i in range(2)]
    put("Direction", K.HTTP_BYTES, _enum(events.Direction, req))
    put("RequestBytes", K.HTTP_BYTES, f"if({req} = 0, {sent[0]}, {sent[1]})")
    put("ResponseBytes", K.HTTP_BYTES, f"if({req} = 0, {sent[1]}, {sent[0]})")
    return out


def _default(col: str) -> str:
    value = _KE_DEFAULTS[_KE_INDEX[col]]
    return "''" if value == "" else "[]" if value == [] else "0"


def _select() -> list[str]:
    header = {
        "Timestamp": "fromUnixTimestamp64Nano(epoch)",
        "Kind": _enum(events.Kind, "kind"),
        "Pid": "pid", "Tid": "tid", "CgroupId": "cgroup",
        "TraceId": "if(reinterpretAsUInt128(trace) = 0, '', lower(hex(trace)))",
        "SpanId": "if(span = 0, '', leftPad(lower(hex(span)), 16, '0'))",
        "Modality": _enum(events.Modality, "modality", other=events.Modality.other.name),
        "HeaderFlags": "flags",
        "K8sNamespace": "ns", "K8sPodName": "pod", "K8sContainerName": "container", "Node": "node",
    }
    payload = _payload_sources()
    out = []
    for col in KERNEL_EVENT_COLUMNS:
        if col in header:
            out.append(header[col])
            continue
        arms = "".join(f"kind = {kind}, {sql}, " for kind, sql in payload[col])
        out.append(f"multiIf({arms}{_default(col)})")
    return out


_SELECT = ", ".join(_select())


def insert_sql(database: str, table: str, path: str) -> str:
    """INSERT of the RowBinary records in the file at `path` (written by encode)."""
    cols = ", ".join(schema.quote_identifier(c) for c in KERNEL_EVENT_COLUMNS)
    return (f"INSERT INTO {database}.{table} ({cols}) SELECT {_SELECT} "
            f"FROM file({schema.quote_string(path)}, 'RowBinary', {schema.quote_string(STRUCTURE)})")


def _text(value: str) -> bytes:
    """A RowBinary String."""
    data = value.encode("utf-8")
    return varint(len(data)) + data


def _addresses(raw: bytes) -> bytes:
    flow = events.FlowKey.from_buffer_copy(raw, _FLOW_AT)
    src, dst = flow.addresses()
    return _text(src) + _text(dst)


_NO_ADDRESSES = _text("") + _text("")


def encode(record_rows: Sequence[Sequence]) -> bytes:
    """rows.KERNEL_RECORD_COLUMNS rows → the RowBinary data of STRUCTURE."""
    names: dict[tuple, bytes] = {}
    addresses: dict[bytes, bytes] = {}
    parts = []
    append = parts.append
    pads, epoch, sizes, flow_kinds = _PADS, _EPOCH.pack, _SIZES, _FLOW_KINDS
    limit = _HEADER + BODY
    for raw, epoch_ns, ns, pod, container, node in record_rows:
        key = (ns, pod, container, node)
        tail = names.get(key)
        if tail is None:
            tail = names[key] = b"".join(_text(s) for s in key)
        n = len(raw)
        kind = raw[_KIND_AT] | raw[_KIND_AT + 1] << 8 if n >= _HEADER else 0
        if n < sizes.get(kind, limit + 1) or n > limit:
            raise BackendError(f"kernel record of {n} bytes for kind {kind}")
        append(raw)
        append(pads[limit - n])
        append(epoch(epoch_ns))
        append(tail)
        if kind in flow_kinds:
            flow = raw[_FLOW_AT:_FLOW_AT + C.sizeof(events.FlowKey)]
            text = addresses.get(flow)
            if text is None:
                text = addresses[flow] = _addresses(raw)
            append(text)
        else:
            append(_NO_ADDRESSES)
    return b"".join(parts)
