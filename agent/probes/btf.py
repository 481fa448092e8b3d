"""BTF, read in Python: the types a CO-RE object (or the kernel) describes, and
ctypes types made from them, so that a map's keys and values, an event record
or a span-facts row is declared once, in C, and read here by the layout the
compiler gave it (no hand mirror kept in step by tests).

The format is the kernel's (Documentation/bpf/btf.rst): a header, the type
section (struct btf_type, each followed by its kind's data) and the string
section. Type ids count from 1 (0 is void)."""

from __future__ import annotations

import ctypes as C
import struct
from dataclasses import dataclass, field

MAGIC = 0xEB9F

# enum of BTF kinds (uapi/linux/btf.h)
INT, PTR, ARRAY, STRUCT, UNION, ENUM, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT = range(1, 12)
FUNC, FUNC_PROTO, VAR, DATASEC, FLOAT, DECL_TAG, TYPE_TAG, ENUM64 = range(12, 20)
INT_SIGNED = 1 << 0          # BTF_INT_ENCODING
_MODIFIERS = (TYPEDEF, VOLATILE, CONST, RESTRICT, TYPE_TAG)


class BTFError(ValueError):
    """Bytes that are not BTF, or a type that has no ctypes form."""


@dataclass
class Member:
    name: str
    type: int
    bit_offset: int
    bit_size: int = 0            # a bitfield's width (0: not a bitfield)


@dataclass
class Type:
    id: int
    kind: int
    name: str
    size: int = 0                # INT, STRUCT, UNION, ENUM, DATASEC, FLOAT: bytes
    ref: int = 0                 # PTR, TYPEDEF and the modifiers, VAR, FUNC: the type referred to
    members: list[Member] = field(default_factory=list)   # STRUCT, UNION
    elem: int = 0                # ARRAY: element type and count
    nelems: int = 0
    signed: bool = False         # INT
    vars: list[tuple[int, int, int]] = field(default_factory=list)   # DATASEC: (var type, offset, size)


class BTF:
    """The types of one BTF blob, by id and by name."""

    def __init__(self, raw: bytes):
        if len(raw) < 24:
            raise BTFError("BTF: shorter than its header")
        magic, _version, _flags, hdr_len = struct.unpack_from("<HBBI", raw, 0)
        if magic != MAGIC:
            raise BTFError(f"BTF: bad magic {magic:#x} (a big-endian object is not read here)")
        type_off, type_len, str_off, str_len = struct.unpack_from("<IIII", raw, 8)
        base = hdr_len
        if base + max(type_off + type_len, str_off + str_len) > len(raw):
            raise BTFError("BTF: sections run past its end")
        self._strings = raw[base + str_off: base + str_off + str_len]
        self.types: list[Type | None] = [None]
        self._parse(raw[base + type_off: base + type_off + type_len])
        self._by_name: dict[tuple[int, str], int] = {}
        for t in self.types[1:]:
            if t.name:
                self._by_name.setdefault((t.kind, t.name), t.id)
        self._ctypes: dict[int, type] = {}

    def _str(self, off: int) -> str:
        end = self._strings.find(b"\0", off)
        if end < 0:
            raise BTFError(f"BTF: string at {off} has no end")
        return self._strings[off:end].decode()

    def _parse(self, data: bytes) -> None:
        pos, n = 0, len(data)
        while pos < n:
            if pos + 12 > n:
                raise BTFError("BTF: a type runs past the type section")
            name_off, info, size_type = struct.unpack_from("<III", data, pos)
            pos += 12
            vlen, kind, kind_flag = info & 0xFFFF, (info >> 24) & 0x1F, info >> 31
            t = Type(id=len(self.types), kind=kind, name=self._str(name_off))
            if kind == INT:
                (enc,) = struct.unpack_from("<I", data, pos)
                pos += 4
                t.size, t.signed = size_type, bool((enc >> 24) & INT_SIGNED)
            elif kind in (PTR, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, TYPE_TAG):
                t.ref = size_type
            elif kind == ARRAY:
                t.elem, _index, t.nelems = struct.unpack_from("<III", data, pos)
                pos += 12
            elif kind in (STRUCT, UNION):
                t.size = size_type
                for i in range(vlen):
                    m_name, m_type, m_off = struct.unpack_from("<III", data, pos + 12 * i)
                    bits, off = (m_off >> 24, m_off & 0xFFFFFF) if kind_flag else (0, m_off)
                    t.members.append(Member(self._str(m_name), m_type, off, bits))
                pos += 12 * vlen
            elif kind == ENUM:
                t.size = size_type
                pos += 8 * vlen
            elif kind == ENUM64:
                t.size = size_type
                pos += 12 * vlen
            elif kind == FWD:
                pass
            elif kind == FUNC_PROTO:
                t.ref = size_type
                pos += 8 * vlen
            elif kind == VAR:
                t.ref = size_type
                pos += 4
            elif kind == DATASEC:
                t.size = size_type
                t.vars = [struct.unpack_from("<III", data, pos + 12 * i) for i in range(vlen)]
                pos += 12 * vlen
            elif kind == FLOAT:
                t.size = size_type
            elif kind == DECL_TAG:
                t.ref = size_type
                pos += 4
            else:
                raise BTFError(f"BTF: unknown kind {kind} (type {t.id})")
            self.types.append(t)
        if pos != n:
            raise BTFError("BTF: the type section does not end on a type")

    def get(self, type_id: int) -> Type:
        if not 0 < type_id < len(self.types):
            raise BTFError(f"BTF: no type {type_id}")
        return self.types[type_id]

    def find(self, name: str, kind: int = STRUCT) -> Type:
        """The type of this kind and name (a struct by default)."""
        try:
            return self.types[self._by_name[(kind, name)]]
        except KeyError:
            raise BTFError(f"BTF: no {_KIND_NAMES.get(kind, kind)} {name}") from None

    def resolve(self, type_id: int) -> Type:
        """The type under its typedefs, const, volatile and the like."""
        t = self.get(type_id)
        for _ in range(32):
            if t.kind not in _MODIFIERS:
                return t
            t = self.get(t.ref)
        raise BTFError(f"BTF: type {type_id} refers round in a loop")

    def size_of(self, type_id: int) -> int:
        t = self.resolve(type_id)
        if t.kind == ARRAY:
            return self.size_of(t.elem) * t.nelems
        if t.kind == PTR:
            return 8
        if t.kind in (FWD, FUNC, FUNC_PROTO):
            raise BTFError(f"BTF: {t.name or t.id} has no size")
        return t.size

    def datasec_vars(self, name: str) -> dict[str, tuple[int, int]]:
        """A data section's variables (.rodata's `const volatile` settings):
        name → (offset, size)."""
        sec = self.find(name, DATASEC)
        return {self.get(var).name: (off, size) for var, off, size in sec.vars}

    def ctype(self, type_id: int) -> type:
        """The ctypes type of this type, with the compiler's layout: every member
        at its BTF offset, padding where there is a gap, the BTF size in all."""
        if type_id in self._ctypes:
            return self._ctypes[type_id]
        t = self.resolve(type_id)
        if t.kind == INT:
            if t.size not in _INTS:
                raise BTFError(f"BTF: {t.size}-byte integer {t.name}")
            out = _INTS[t.size][t.signed]
        elif t.kind in (ENUM, ENUM64):
            out = _INTS[t.size][False]
        elif t.kind == PTR:
            out = C.c_uint64           # an address: 8 bytes in a BPF program
        elif t.kind == FLOAT:
            out = {4: C.c_float, 8: C.c_double}[t.size]
        elif t.kind == ARRAY:
            out = self.ctype(t.elem) * t.nelems
        elif t.kind in (STRUCT, UNION):
            out = self._record(t)
        else:
            raise BTFError(f"BTF: {_KIND_NAMES.get(t.kind, t.kind)} {t.name} has no ctypes form")
        self._ctypes[type_id] = out
        return out

    def _record(self, t: Type) -> type:
        name = t.name or f"anon_{t.id}"
        fields, at = [], 0
        for i, m in enumerate(t.members):
            if m.bit_size or m.bit_offset % 8:
                raise BTFError(f"BTF: {name}.{m.name} is a bitfield (not read here)")
            off = m.bit_offset // 8
            if t.kind == STRUCT and off > at:
                fields.append((f"_pad{i}", C.c_uint8 * (off - at)))
            fields.append((m.name or f"_anon{i}", self.ctype(m.type)))
            end = off + self.size_of(m.type)
            at = max(at, end) if t.kind == STRUCT else at
        if t.kind == STRUCT and t.size > at:
            fields.append(("_pad_end", C.c_uint8 * (t.size - at)))
        base = C.Structure if t.kind == STRUCT else C.Union
        cls = type(name, (base,), {"_pack_": 1, "_fields_": fields})
        if C.sizeof(cls) != t.size:
            raise BTFError(f"BTF: {name} comes to {C.sizeof(cls)} bytes in ctypes, {t.size} in BTF")
        for m in t.members:
            if m.name and getattr(cls, m.name).offset != m.bit_offset // 8:
                raise BTFError(f"BTF: {name}.{m.name} at {getattr(cls, m.name).offset}, not {m.bit_offset // 8}")
        return cls


_INTS = {1: {False: C.c_uint8, True: C.c_int8}, 2: {False: C.c_uint16, True: C.c_int16},
         4: {False: C.c_uint32, True: C.c_int32}, 8: {False: C.c_uint64, True: C.c_int64},
         16: {False: C.c_uint8 * 16, True: C.c_uint8 * 16}}
_KIND_NAMES = {INT: "int", PTR: "pointer", ARRAY: "array", STRUCT: "struct", UNION: "union", ENUM: "enum",
               FWD: "forward declaration", TYPEDEF: "typedef", FUNC: "function", FUNC_PROTO: "function type",
               VAR: "variable", DATASEC: "data section", FLOAT: "float", ENUM64: "enum"}
