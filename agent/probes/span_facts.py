"""Reader of the kernel's span facts map (bpf/spanlet.h `span_facts`): takes one
span's row in one bpf(2) call when the span arrives, lists rows for the sweep."""

from __future__ import annotations

import ctypes as C
import errno
import os
import platform
import threading
from dataclasses import dataclass, field
from typing import Callable

from spanlet import events
from spanlet.probes.maps import dump_table

# bpf(2) commands (uapi/linux/bpf.h, enum bpf_cmd).
BPF_MAP_DELETE_ELEM = 3
BPF_MAP_LOOKUP_AND_DELETE_ELEM = 21   # hash and LRU maps: Linux 5.14
_SYS_BPF = {"x86_64": 321, "aarch64": 280}


class _ElemAttr(C.Structure):
    """The map-element member of union bpf_attr (map_fd, key, value, flags)."""
    _fields_ = [("map_fd", C.c_uint32), ("_pad", C.c_uint32), ("key", C.c_uint64),
                ("value", C.c_uint64), ("flags", C.c_uint64)]


_libc = C.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = C.c_long
_syscall.argtypes = [C.c_long, C.c_int, C.c_void_p, C.c_uint]


@dataclass
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


def decode(key: events.SpanFactsKey, val: events.SpanFactsVal,
           clock: events.MonotonicClock) -> KernelFacts:
    return KernelFacts(
        trace_id=bytes(key.trace_id), span_id=key.span_id, cgroup_id=val.cgroup_id, pid=val.pid,
        first_ns=clock.to_epoch(val.first_ns),
        launches=val.launches_driver + val.launches_runtime,
        launches_by_api={"driver": val.launches_driver, "runtime": val.launches_runtime},
        launch_ns=val.launch_ns, sync_wait_ns=val.sync_wait_ns, syncs=val.syncs,
        violations=val.violations, graph_launches=val.graph_launches,
        graph_kernels=val.graph_kernels, sampled_events=val.sampled_events)


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
        self._key = events.SpanFactsKey()
        self._val = events.SpanFactsVal()
        self._attr = _ElemAttr(map_fd=table.map_fd, key=C.addressof(self._key),
                               value=C.addressof(self._val))
        self._attr_p = C.addressof(self._attr)
        self._attr_size = C.sizeof(self._attr)
        self._lock = threading.Lock()
        self._stats = SpanFactsStats()
        self._closed = False

    def close(self) -> None:
        """The map is about to go (probe stop): every later call finds nothing,
        never a reused fd."""
        with self._lock:
            self._closed = True

    def _set_key(self, trace_id: bytes, span_id: int) -> None:
        C.memmove(self._key.trace_id, trace_id.ljust(16, b"\0"), 16)
        self._key.span_id = span_id

    def _call(self, cmd: int) -> bool:
        if self._closed:
            return False
        if _syscall(self._sys_bpf, cmd, self._attr_p, self._attr_size) == 0:
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
            return decode(self._key, self._val, self.clock)

    def delete(self, trace_id: bytes, span_id: int) -> bool:
        """Drop a row unread (the sweep's expired rows); counted as swept."""
        with self._lock:
            self._set_key(trace_id, span_id)
            gone = self._call(BPF_MAP_DELETE_ELEM)
            self._stats.swept += gone
            return gone

    def rows(self) -> list[KernelFacts]:
        """Every row present, not deleted (BPF_MAP_LOOKUP_BATCH where the
        kernel has it); also refreshes the present/evicted figures."""
        with self._lock:
            if self._closed:
                return []
            created = self._created()
            got = dump_table(self.table)
        out = [decode(events.SpanFactsKey.from_buffer_copy(k), v, self.clock)
               for k, v in got.items()]
        with self._lock:
            st = self._stats
            st.created, st.present = created, len(out)
            # Rows made or taken while we read make this an underestimate,
            # never an overestimate: keep the counter monotonic.
            st.evicted = max(st.evicted, created - st.taken - st.swept - st.present)
        return out

    def stats(self) -> SpanFactsStats:
        with self._lock:
            st = SpanFactsStats(**self._stats.__dict__)
            if not self._closed:
                st.created = max(st.created, self._created())
        return st
