"""kernel_events rows from the ring buffer's records as they are: the
embedded store's insert of rows.KERNEL_RECORD_COLUMNS.

Python's part per event is one struct unpack of its payload (the layout
read from the one ctypes definition, agent/events.py), one pack into a
layout with every kind's payload columns side by side, and the names of its
enum values, its pod and its flow's addresses from caches, as RowBinary; the
engine takes the header's fields and ids as they are and writes every
column in one INSERT ... SELECT of plain columns (the engine's planning of
each function in that SELECT costs ~0.1 ms, so there are few; building each
row in Python cost ~30 µs an event). The stored values are those of
rows.kernel_event_row, exactly (the tests compare both ways on random
records of every kind).
"""

from __future__ import annotations

import ctypes as C
import struct
from collections.abc import Sequence
from operator import itemgetter

from spanlet import events
from spanlet.exporters.clickhouse import BackendError, schema
from spanlet.exporters.clickhouse.rows import KERNEL_EVENT_COLUMNS, _enum_name
from spanlet.exporters.otlp.common import varint

_HEADER = C.sizeof(events.Header)
_KIND_AT = events.Header.kind.offset
_MODALITY_AT = events.Header.modality.offset
_FLOW_KINDS = {int(k) for k, cls in events.RECORDS.items() if "flow" in dict(cls._fields_)}
_FLOW_AT = {events.RECORDS[k].flow.offset for k in _FLOW_KINDS}.pop()   # one offset for every kind with a flow
_EPOCH = struct.Struct("<q")
_ZEROS = bytes(256)

# The payload columns, in the input's order, with their RowBinary types
# (Grid and Block as three numbers each: arrays of three for launches).
_NUMBERS = (("Func", "Q"), ("Stream", "Q"), ("DurationNs", "Q"),
            ("Grid0", "I"), ("Grid1", "I"), ("Grid2", "I"), ("Block0", "I"), ("Block1", "I"), ("Block2", "I"),
            ("SharedMem", "I"), ("Addr", "Q"), ("Len", "Q"), ("PoolMaxBytes", "Q"), ("Prot", "I"),
            ("MapFlags", "I"), ("PoolId", "I"), ("Fd", "i"), ("SrcPort", "H"), ("DstPort", "H"),
            ("L4Proto", "B"), ("Ifindex", "I"), ("Method", "B"), ("PathHash", "I"), ("TraceFlags", "B"),
            ("RequestBytes", "Q"), ("ResponseBytes", "Q"))
_CH = {"Q": "UInt64", "I": "UInt32", "i": "Int32", "H": "UInt16", "B": "UInt8"}
_ENUMS = ("Api", "Entry", "Rule", "Action", "Direction", "ProtoClass")
_ENUM_CLASSES = {"Api": events.Api, "Entry": events.Entry, "Rule": events.Rule, "Action": events.Action,
                 "Direction": events.Direction, "ProtoClass": events.Proto}
_TEXTS = ("Kind", "Modality") + _ENUMS + ("K8sNamespace", "K8sPodName", "K8sContainerName", "Node",
                                          "SrcAddr", "DstAddr")

# The input's columns: the header (bpf/spanlet.h) as the record has it, the
# payload numbers, the epoch time, then the texts.
STRUCTURE = ("ts UInt64, pid UInt32, tid UInt32, cgroup UInt64, trace FixedString(16), span UInt64, "
             "kind UInt16, modality UInt8, flags UInt8, hpad UInt32, "
             + ", ".join(f"{name} {_CH[code]}" for name, code in _NUMBERS) + ", epoch Int64, "
             + ", ".join(f"{name} String" for name in _TEXTS))

# kind -> {input column: payload field}, as rows.kernel_event_row fills them
_K = events.Kind
_SOURCES = {
    _K.GPU_LAUNCH: {"Func": "func", "Stream": "stream", "DurationNs": "duration_ns",
                    **{f"{arr.title()}{i}": f"{arr}{i}" for arr in ("grid", "block") for i in range(3)},
                    "SharedMem": "shared_mem", "Api": "api", "Entry": "entry"},
    _K.GPU_SYNC: {"Stream": "stream", "DurationNs": "duration_ns", "Api": "api", "Entry": "entry"},
    _K.SANDBOX: {"Addr": "addr", "Len": "len", "PoolMaxBytes": "pool_max_bytes", "Prot": "prot",
                 "MapFlags": "flags", "PoolId": "pool_id", "Fd": "fd", "Rule": "rule", "Action": "action"},
    _K.HTTP: {"Ifindex": "ifindex", "Direction": "direction", "Method": "method", "PathHash": "path_hash",
              "TraceFlags": "trace_flags"},
    _K.FLOW: {"Ifindex": "ifindex", "Direction": "direction", "ProtoClass": "proto_class"},
    # the request's direction is req_dir & 1; its bytes and the other way's
    # are bytes[req_dir & 1] and bytes[1 - (req_dir & 1)] (swapped below)
    _K.HTTP_BYTES: {"Direction": "req_dir", "RequestBytes": "bytes0", "ResponseBytes": "bytes1"},
}
for _kind in _FLOW_KINDS:
    _SOURCES[_K(_kind)].update({"SrcPort": "flow.sport", "DstPort": "flow.dport", "L4Proto": "flow.l4proto"})


def _field(cls, name: str) -> tuple[int, int]:
    """(offset in the record, size) of a payload field: `flow.sport`, `grid1`."""
    outer, _, inner = name.partition(".")
    if inner:
        offset = getattr(cls, outer).offset
        cls, name = dict(cls._fields_)[outer], inner
    else:
        offset = 0
    fields = dict(cls._fields_)
    if name not in fields and name[-1].isdigit():    # an array's element
        arr = fields[name[:-1]]
        size = C.sizeof(arr._type_)
        return offset + getattr(cls, name[:-1]).offset + int(name[-1]) * size, size
    return offset + getattr(cls, name).offset, C.sizeof(fields[name])


def _runs(cls, sources: dict[str, str]) -> itemgetter:
    """The header and payload numbers of a record of `cls`, as slices of the
    record followed by zero bytes (the fields and the columns have the same
    widths; the columns its kind has not are zeros), adjacent ones merged."""
    size = C.sizeof(cls)
    runs = [(0, _HEADER)]
    for col, code in _NUMBERS:
        width = struct.calcsize(code)
        start = _field(cls, sources[col])[0] if col in sources else None
        if start is not None and _field(cls, sources[col])[1] != width:
            raise ValueError(f"{cls.__name__}.{sources[col]} is not as wide as {col}")
        if start is None:                    # zeros, from past the record's end
            last = runs[-1]
            start = last[1] if last[0] >= size else size
        if runs[-1][1] == start:
            runs[-1] = (runs[-1][0], start + width)
        else:
            runs.append((start, start + width))
    if max(end for _, end in runs) > size + len(_ZEROS):
        raise ValueError(f"{cls.__name__}: more zero columns than _ZEROS")
    return itemgetter(*[slice(a, b) for a, b in runs]) if len(runs) > 1 else (
        lambda data, cut=slice(*runs[0]): (data[cut],))


class _Kind:
    """How the records of one kind become their part of the input."""

    def __init__(self, kind: int):
        cls = events.RECORDS[kind]
        sources = dict(_SOURCES[_K(kind)])
        self.kind, self.name = kind, _K(kind).name
        self.size = C.sizeof(cls)
        self.runs = _runs(cls, sources)
        self.swapped = self.swap_at = None
        if kind == _K.HTTP_BYTES:
            self.swap_at = _field(cls, "req_dir")[0]
            sources["RequestBytes"], sources["ResponseBytes"] = "bytes1", "bytes0"
            self.swapped = _runs(cls, sources)
        self.enum_columns = [col for col in _ENUMS if col in sources]
        at = [_field(cls, sources[col]) for col in self.enum_columns]
        if any(size != 1 for _, size in at):
            raise ValueError(f"{cls.__name__}: an enum field wider than a byte")
        # the enum fields' bytes, one slice of the record (a key for their names)
        self.enum_from = min((o for o, _ in at), default=0)
        self.enum_to = max((o + 1 for o, _ in at), default=0)
        self.enum_at = [o - self.enum_from for o, _ in at]

    def fixed(self, raw: bytes) -> tuple:
        """The record's header and payload numbers, in pieces."""
        runs = self.swapped if self.swap_at is not None and raw[self.swap_at] & 1 else self.runs
        return runs(raw + _ZEROS)

    def texts(self, modality: int, enum_bytes: bytes) -> bytes:
        """Kind, Modality and the enums' names of a record."""
        given = {col: enum_bytes[i] for col, i in zip(self.enum_columns, self.enum_at)}
        if self.swap_at is not None:
            given["Direction"] &= 1
        texts = [self.name, events.modality_name(modality)]
        texts += [_enum_name(_ENUM_CLASSES[col], given[col]) if col in given else "" for col in _ENUMS]
        return b"".join(_text(t) for t in texts)


_KINDS = {int(kind): _Kind(int(kind)) for kind in events.RECORDS}
_NO_ADDRESSES = b"\x00\x00"


def _text(value: str) -> bytes:
    """A RowBinary String."""
    data = value.encode("utf-8")
    return varint(len(data)) + data


def _addresses(raw: bytes) -> bytes:
    flow = events.FlowKey.from_buffer_copy(raw, _FLOW_AT)
    src, dst = flow.addresses()
    return _text(src) + _text(dst)


def encode(record_rows: Sequence[Sequence]) -> bytes:
    """rows.KERNEL_RECORD_COLUMNS rows → the RowBinary data of STRUCTURE."""
    try:
        return _encode(record_rows)
    except (IndexError, KeyError) as e:    # a record shorter than a header, or of no kind
        raise BackendError(f"kernel record not of a known kind and size: {e}") from e


def _encode(record_rows: Sequence[Sequence]) -> bytes:
    pods: dict[tuple, bytes] = {}
    names: dict[tuple, bytes] = {}
    addresses: dict[bytes, bytes] = {}
    parts = []
    append, extend = parts.append, parts.extend
    kinds, epoch, flow_kinds = _KINDS, _EPOCH.pack, _FLOW_KINDS
    kind_at, modality_at, flow_at, flow_end = _KIND_AT, _MODALITY_AT, _FLOW_AT, _FLOW_AT + C.sizeof(events.FlowKey)
    for raw, epoch_ns, ns, pod, container, node in record_rows:
        spec = kinds[raw[kind_at] | raw[kind_at + 1] << 8]
        if len(raw) != spec.size:
            raise BackendError(f"{spec.name} record of {len(raw)} bytes, not {spec.size}")
        key = (spec, raw[modality_at], raw[spec.enum_from:spec.enum_to])
        texts = names.get(key)
        if texts is None:
            texts = names[key] = spec.texts(key[1], key[2])
        where = (ns, pod, container, node)
        tail = pods.get(where)
        if tail is None:
            tail = pods[where] = b"".join(_text(t) for t in where)
        extend(spec.fixed(raw))
        append(epoch(epoch_ns))
        append(texts)
        append(tail)
        if spec.kind in flow_kinds:
            flow = raw[flow_at:flow_end]
            text = addresses.get(flow)
            if text is None:
                text = addresses[flow] = _addresses(raw)
            append(text)
        else:
            append(_NO_ADDRESSES)
    return b"".join(parts)


def _select() -> list[str]:
    launch = int(_K.GPU_LAUNCH)
    computed = {
        "Timestamp": "fromUnixTimestamp64Nano(epoch)",
        "Pid": "pid", "Tid": "tid", "CgroupId": "cgroup", "HeaderFlags": "flags",
        "TraceId": "if(reinterpretAsUInt128(trace) = 0, '', lower(hex(trace)))",
        "SpanId": "if(span = 0, '', leftPad(lower(hex(span)), 16, '0'))",
        "Grid": f"if(kind = {launch}, [Grid0, Grid1, Grid2], [])",
        "Block": f"if(kind = {launch}, [Block0, Block1, Block2], [])",
    }
    return [computed.get(col, col) for col in KERNEL_EVENT_COLUMNS]


_SELECT = ", ".join(_select())


def insert_sql(database: str, table: str, path: str) -> str:
    """INSERT of the RowBinary records in the file at `path` (written by encode)."""
    cols = ", ".join(schema.quote_identifier(c) for c in KERNEL_EVENT_COLUMNS)
    return (f"INSERT INTO {database}.{table} ({cols}) SELECT {_SELECT} "
            f"FROM file({schema.quote_string(path)}, 'RowBinary', {schema.quote_string(STRUCTURE)})")
