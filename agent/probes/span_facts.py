"""Reader of the kernel's span facts map (bpf/spanlet.h `span_facts`): takes one
span's row in one bpf(2) call when the span arrives, lists rows for the sweep."""

from __future__ import annotations

import ctypes as C
import errno
import os
import platform
import struct
import threading
from dataclasses import dataclass, field
from typing import Callable

from spanlet import events
from spanlet.probes.maps import read_batches

# bpf(2) commands (uapi/linux/bpf.h, enum bpf_cmd).
BPF_MAP_DELETE_ELEM = 3
BPF_MAP_LOOKUP_AND_DELETE_ELEM = 21   # hash and LRU maps: Linux 5.14
_SYS_BPF = {"x86_64": 321, "aarch64": 280}


class _ElemAttr(C.Structure):
    """The map-element member of union bpf_attr (map_fd, key, value, flags)."""
    _fields_ = [("map_fd", C.c_uint32), ("_pad", C.c_uint32), ("key", C.c_uint64),
                ("value", C.c_uint64), ("flags", C.c_uint64)]


_KEY = struct.Struct("<16sQ")      # struct span_facts_key
# first_ns of struct span_facts_val, with the bytes before and after it skipped
_FIRST = struct.Struct(f"<{events.SpanFactsVal.first_ns.offset}xQ"
                       f"{C.sizeof(events.SpanFactsVal) - events.SpanFactsVal.first_ns.offset - 8}x")
try:
    from spanlet._wire import join_resource as _join_resource
except ImportError:        # a source tree without its build: the join takes rows one by one
    _join_resource = None
_libc = C.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = C.c_long
_syscall.argtypes = [C.c_long, C.c_int, C.c_void_p, C.c_uint]


def _address(buf: bytearray) -> int:
    return C.addressof((C.c_char * len(buf)).from_buffer(buf))


@dataclass(slots=True)
class KernelFacts:
    """What the kernel did for one span (one span_facts row)."""

    trace_id: bytes
    span_id: int
    cgroup_id: int = 0                 # of the first event
    pid: int = 0                       # of the first event
    first_ns: int = 0                  # epoch ns of the first event
    launches: int = 0                  # outermost launch calls, every API
    launches_by_api: dict[str, int] = field(default_factory=dict)
    launch_ns: int = 0                 # with gpu.launch_timing only
    sync_wait_ns: int = 0
    syncs: int = 0
    violations: int = 0
    graph_launches: int = 0
    graph_kernels: int = 0
    sampled_events: int = 0            # GPU records sent in the sampled side stream


@dataclass
class SpanFactsStats:
    created: int = 0     # rows the kernel made
    taken: int = 0       # read and deleted by the join (on time or late)
    swept: int = 0       # deleted without being read (expired)
    evicted: int = 0     # pushed out by the LRU: created - taken - swept - present
    present: int = 0     # rows in the map at the last rows()


# struct span_facts_val, field by field (agent/events.py SpanFactsVal)
_VAL = struct.Struct("<10Q2I")
assert _VAL.size == C.sizeof(events.SpanFactsVal)


def decode(trace_id: bytes, span_id: int, val, clock: events.MonotonicClock,
           offset: int = 0) -> KernelFacts:
    """A row from the packed bytes of its value (at `offset` in `val`)."""
    (driver, runtime, launch_ns, sync_wait_ns, syncs, violations, graph_launches, graph_kernels,
     cgroup_id, first_ns, pid, sampled) = _VAL.unpack_from(val, offset)
    return KernelFacts(trace_id, span_id, cgroup_id, pid, clock.to_epoch(first_ns),
                       driver + runtime, {"driver": driver, "runtime": runtime}, launch_ns,
                       sync_wait_ns, syncs, violations, graph_launches, graph_kernels, sampled)


class SpanFacts:
    """The span facts map of one agent (owned by SpanCtxProbe). take() is on
    the span path: one syscall on preallocated buffers, no allocation
    besides the result. Thread-safe."""

    def __init__(self, table, created: Callable[[], int],
                 clock: events.MonotonicClock | None = None):
        self.table = table                 # the BCC table (rows() reads it in batches)
        self._created = created
        self.clock = clock or events.MonotonicClock()
        self._sys_bpf = _SYS_BPF[platform.machine()]
        # key and value buffers the syscall reads and writes in place
        self._key = bytearray(_KEY.size)
        self._val = bytearray(_VAL.size)
        self._attr = _ElemAttr(map_fd=table.map_fd, key=_address(self._key),
                               value=_address(self._val))
        self._attr_p = C.addressof(self._attr)
        self._attr_size = C.sizeof(self._attr)
        # BPF_MAP_DELETE_ELEM refuses (EINVAL) any attribute after the key that is not zero
        self._del_attr = _ElemAttr(map_fd=table.map_fd, key=_address(self._key))
        self._del_attr_p = C.addressof(self._del_attr)
        self._lock = threading.Lock()
        self._stats = SpanFactsStats()
        self._closed = False

    def close(self) -> None:
        """The map is about to go (probe stop): every later call finds nothing,
        never a reused fd."""
        with self._lock:
            self._closed = True

    def _set_key(self, trace_id: bytes, span_id: int) -> None:
        _KEY.pack_into(self._key, 0, trace_id, span_id)   # "16s" pads a short id with NULs

    def _call(self, cmd: int, attr_p: int | None = None) -> bool:
        if self._closed:
            return False
        if _syscall(self._sys_bpf, cmd, attr_p or self._attr_p, self._attr_size) == 0:
            return True
        err = C.get_errno()
        if err == errno.ENOENT:
            return False
        raise OSError(err, f"bpf({cmd}) on span_facts: {os.strerror(err)}")

    def take(self, trace_id: bytes, span_id: int) -> KernelFacts | None:
        """The span's row, deleted in the same call (BPF_MAP_LOOKUP_AND_DELETE_ELEM);
        None when the kernel has no facts for it."""
        with self._lock:
            self._set_key(trace_id, span_id)
            if not self._call(BPF_MAP_LOOKUP_AND_DELETE_ELEM):
                return None
            self._stats.taken += 1
            return decode(trace_id, span_id, self._val, self.clock)

    def join_resource(self, blob: bytes):
        """The join's common case done in C (native/spanlet_wire.c) on one
        serialized ResourceSpans: each span's row taken and its facts appended
        as attributes. None when it is not that case (or the C part is not
        built): nothing was taken, the caller joins span by span; else
        (new blob or None if nothing joined, keys of all its spans, rows
        taken, cgroup)."""
        if _join_resource is None:
            return None
        with self._lock:
            if self._closed:
                return None
            got = _join_resource(blob, self.table.map_fd)
            if got is not None:
                self._stats.taken += got[2]
            return got

    def delete(self, trace_id: bytes, span_id: int) -> bool:
        """Drop a row unread (the sweep's expired rows); counted as swept."""
        with self._lock:
            self._set_key(trace_id, span_id)
            gone = self._call(BPF_MAP_DELETE_ELEM, self._del_attr_p)
            self._stats.swept += gone
            return gone

    def rows(self) -> list[KernelFacts]:
        """Every row present, not deleted (BPF_MAP_LOOKUP_BATCH where the
        kernel has it); also refreshes the present/evicted figures."""
        keys, vals = self._read_all()
        return [decode(trace_id, span_id, vals, self.clock, i * _VAL.size)
                for i, (trace_id, span_id) in enumerate(_KEY.iter_unpack(keys))]

    def ages(self) -> list[tuple[bytes, int, int]]:
        """(trace id, span id, first event in epoch ns) of every row present:
        what the sweep needs, without decoding whole rows (a full map of
        65,536 rows in tens of ms rather than half a second)."""
        keys, vals = self._read_all()
        offset = self.clock.to_epoch(0)
        return [(trace_id, span_id, first + offset) for (trace_id, span_id), (first,) in
                zip(_KEY.iter_unpack(keys), _FIRST.iter_unpack(vals))]

    def _read_all(self) -> tuple[bytes, bytes]:
        """Every key and value, packed (BPF_MAP_LOOKUP_BATCH, chunk by chunk)."""
        with self._lock:
            if self._closed:
                return b"", b""
            created = self._created()
            keys, vals = read_batches(self.table)
            st = self._stats
            st.created, st.present = created, len(keys) // _KEY.size
            # Rows made or taken while we read make this an underestimate,
            # never an overestimate: keep the counter monotonic.
            st.evicted = max(st.evicted, created - st.taken - st.swept - st.present)
        return keys, vals

    def stats(self) -> SpanFactsStats:
        with self._lock:
            st = SpanFactsStats(**self._stats.__dict__)
            if not self._closed:
                st.created = max(st.created, self._created())
        return st
