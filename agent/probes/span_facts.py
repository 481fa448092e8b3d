"""Reader of the kernel's span facts map (bpf/spanlet.h `span_facts`, one row
per span and writing cgroup, and its index `span_facts_index` of the cgroups
that made rows for a span): takes one span's rows when the span arrives (one
bpf(2) call for the index, one per row), lists rows for the sweep, and keeps
the kernel's per-cgroup count of live rows true (rows gone written back)."""

from __future__ import annotations

import ctypes as C
import errno
import os
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from spanlet import events
from spanlet.probes import bpf_sys
from spanlet.probes.maps import percpu_sum, read_batches

_KEY = struct.Struct("<16sQQ")     # struct span_facts_key
_IKEY = struct.Struct("<16sQ")     # struct span_facts_index_key
_IVAL = struct.Struct("<4QII")     # struct span_facts_index_val
INDEX_CGROUPS = 4
ORIGIN_MAX = 64      # origin cgroups the C join reads (native/spanlet_wire.c); more: Python's
_U64 = struct.Struct("<Q")
# Rows gone for one cgroup that are written back to the kernel's count at once
# (the sweep writes the exact figure every join.sweep_interval_s).
RELEASE_BATCH = 64
# first_ns of struct span_facts_val, with the bytes before and after it skipped
_FIRST = struct.Struct(f"<{events.SpanFactsVal.first_ns.offset}xQ"
                       f"{C.sizeof(events.SpanFactsVal) - events.SpanFactsVal.first_ns.offset - 8}x")
try:
    from spanlet._wire import join_resource as _join_resource
except ImportError:        # a source tree without its build: the join takes rows one by one
    _join_resource = None


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
    # where the span's threads' time went (ns), and their switches out
    cpu_ns: int = 0
    runqueue_ns: int = 0
    blocked_ns: int = 0
    iowait_ns: int = 0
    switches: int = 0
    preemptions: int = 0
    # GPU memory traffic: bytes copied per direction, copy calls, time in
    # synchronous copies, device memory asked for
    memcpy_h2d_bytes: int = 0
    memcpy_d2h_bytes: int = 0
    memcpy_d2d_bytes: int = 0
    memcpy_other_bytes: int = 0
    memcpy_calls: int = 0
    memcpy_ns: int = 0
    alloc_bytes: int = 0


@dataclass
class SpanFactsStats:
    created: int = 0     # rows the kernel made
    taken: int = 0       # read and deleted by the join (on time or late)
    swept: int = 0       # deleted without being read (expired)
    evicted: int = 0     # pushed out by the LRU: created - taken - swept - present
    present: int = 0     # rows in the map at the last rows()
    refused: int = 0     # events that got no row: their cgroup was at its bound
    cgroups_full: int = 0  # rows of cgroups past the kernel's per-cgroup table (total bound only)
    refused_by_cgroup: dict = field(default_factory=dict)   # cgroup id → events refused
    live_by_cgroup: dict = field(default_factory=dict)      # cgroup id → rows at the last sweep


# struct span_facts_val, field by field (agent/events.py SpanFactsVal)
_VAL = struct.Struct("<23Q2I")
assert _VAL.size == C.sizeof(events.SpanFactsVal)


def decode(trace_id: bytes, span_id: int, val, clock: events.MonotonicClock,
           offset: int = 0) -> KernelFacts:
    """A row from the packed bytes of its value (at `offset` in `val`)."""
    (driver, runtime, launch_ns, sync_wait_ns, syncs, violations, graph_launches, graph_kernels,
     cpu_ns, runqueue_ns, blocked_ns, iowait_ns, switches, preemptions, *memory,
     cgroup_id, first_ns, pid, sampled) = _VAL.unpack_from(val, offset)
    return KernelFacts(trace_id, span_id, cgroup_id, pid, clock.to_epoch(first_ns),
                       driver + runtime, {"driver": driver, "runtime": runtime}, launch_ns,
                       sync_wait_ns, syncs, violations, graph_launches, graph_kernels, sampled,
                       cpu_ns, runqueue_ns, blocked_ns, iowait_ns, switches, preemptions, *memory)


class _Elem:
    """A key and value buffer and the bpf_attr that names them, for one map."""

    def __init__(self, map_fd: int, key_size: int, val_size: int):
        self.key = bytearray(key_size)
        self.val = bytearray(val_size)
        self.attr = bpf_sys.ElemAttr(map_fd=map_fd, key=_address(self.key), value=_address(self.val))
        self.attr_p = C.addressof(self.attr)
        # BPF_MAP_DELETE_ELEM refuses (EINVAL) any attribute after the key that is not zero
        self.del_attr = bpf_sys.ElemAttr(map_fd=map_fd, key=_address(self.key))
        self.del_attr_p = C.addressof(self.del_attr)


class SpanFacts:
    """The span facts map of one agent (owned by SpanCtxProbe). take_rows() is
    on the span path: one syscall for the span's index entry (all a span
    without facts costs), one per row, on preallocated buffers. Thread-safe.

    `index`, `cg_created`, `cg_released`, `cg_refused`, `refused`: the BCC
    tables span_facts_index, span_facts_cg_created/_released/_refused and
    span_facts_refused (bpf/spanlet.h)."""

    def __init__(self, table, created: Callable[[], int],
                 clock: events.MonotonicClock | None = None, *, index, cg_created=None,
                 cg_released=None, cg_refused=None, refused=None):
        self.table = table                 # the BCC table (rows() reads it in batches)
        self.index = index
        self._cg_created, self._cg_released = cg_created, cg_released
        self._cg_refused, self._refused = cg_refused, refused
        self._created = created
        self.clock = clock or events.MonotonicClock()
        if bpf_sys.NR is None:
            raise OSError(errno.ENOSYS, "no bpf(2) number known for this architecture")
        self._sys_bpf = bpf_sys.NR
        self._row = _Elem(table.map_fd, _KEY.size, _VAL.size)
        self._idx = _Elem(index.map_fd, _IKEY.size, _IVAL.size)
        self._rel = _Elem(cg_released.map_fd, 8, 8) if cg_released is not None else None
        self._attr_size = C.sizeof(bpf_sys.ElemAttr)
        self._lock = threading.Lock()
        self._stats = SpanFactsStats()
        self._closed = False
        # the per-cgroup figure of rows gone this agent wrote to the kernel, and
        # rows gone since (written when RELEASE_BATCH, and by every sweep)
        self._released: dict[int, int] = {}
        self._gone: dict[int, int] = {}
        # the kernel's count of rows made when a scan last found the map and
        # the per-cgroup tables empty: until it moves, a scan reads nothing
        # (the kernel walks every bucket of an empty map, each second)
        self._empty_at: int | None = None

    def close(self) -> None:
        """The map is about to go (probe stop): every later call finds nothing,
        never a reused fd."""
        with self._lock:
            self._closed = True

    def _call(self, cmd: int, attr_p: int) -> bool:
        if self._closed:
            return False
        if bpf_sys.syscall(self._sys_bpf, cmd, attr_p, self._attr_size) == 0:
            return True
        err = C.get_errno()
        if err == errno.ENOENT:
            return False
        raise OSError(err, f"bpf({cmd}) on span_facts: {os.strerror(err)}")

    def _take_index(self, trace_id: bytes, span_id: int, origin) -> list[int]:
        """The cgroups that made rows for the span (index entry taken), in the
        order they made them; where the entry is incomplete (past its four, or
        a slot lost to a race in the kernel) the origin's too (so that four
        impostor cgroups cannot hide the sender's own row)."""
        _IKEY.pack_into(self._idx.key, 0, trace_id, span_id)   # "16s" pads a short id with NULs
        if not self._call(bpf_sys.MAP_LOOKUP_AND_DELETE_ELEM, self._idx.attr_p):
            return []
        *listed, n, _ = _IVAL.unpack_from(self._idx.val)
        cgroups: list[int] = []
        for cg in listed[:min(n, INDEX_CGROUPS)]:
            if cg not in cgroups:
                cgroups.append(cg)
        # complete: every row made is listed (no overflow, no slot lost to a race)
        if origin and (n > INDEX_CGROUPS or n != len(cgroups) - (0 in cgroups)):
            cgroups += [cg for cg in sorted(origin) if cg not in cgroups]
        return cgroups

    def _take_row(self, trace_id: bytes, span_id: int, cgroup_id: int) -> KernelFacts | None:
        _KEY.pack_into(self._row.key, 0, trace_id, span_id, cgroup_id)
        if not self._call(bpf_sys.MAP_LOOKUP_AND_DELETE_ELEM, self._row.attr_p):
            return None
        self._stats.taken += 1
        self._release(cgroup_id, 1)
        return decode(trace_id, span_id, self._row.val, self.clock)

    def take_rows(self, trace_id: bytes, span_id: int, origin=None, pick=None):
        """Without `pick`: every row of the span, one per cgroup that made one,
        each deleted as it is read (BPF_MAP_LOOKUP_AND_DELETE_ELEM), in the
        order the kernel made them; [] when the kernel has no facts for it.
        With `pick` (join.pick_rows): (the rows the span gets, (cgroup,
        reason) of those it does not); only the rows it gets are deleted:
        the others stay, listed again in the index, for their own sender's
        span or the sweep. `origin`: the sender's cgroups (None: unknown)."""
        with self._lock:
            cgroups = self._take_index(trace_id, span_id, origin)
            if pick is None:
                return [r for cg in cgroups if (r := self._take_row(trace_id, span_id, cg))]
            # the rows the span gets for sure are taken at once, the rest read
            sure = (lambda cg: cg in origin) if origin is not None else \
                (lambda cg: len(cgroups) == 1)
            seen = []
            for cg in cgroups:
                r = self._take_row(trace_id, span_id, cg) if sure(cg) else \
                    self._peek_row(trace_id, span_id, cg)
                if r is not None:
                    seen.append((r, sure(cg)))
            if not seen:
                return [], []
            kept, foreign = pick([r for r, _ in seen], origin)
            kept_ids = {id(r) for r in kept}
            got, left = [], []
            for r, taken in seen:
                if id(r) in kept_ids:
                    got.append(r if taken else self._take_row(trace_id, span_id, r.cgroup_id) or r)
                elif not taken:
                    left.append(r.cgroup_id)
            if left:
                self._put_index(trace_id, span_id, left)
            return got, foreign

    def _peek_row(self, trace_id: bytes, span_id: int, cgroup_id: int) -> KernelFacts | None:
        _KEY.pack_into(self._row.key, 0, trace_id, span_id, cgroup_id)
        if not self._call(bpf_sys.MAP_LOOKUP_ELEM, self._row.attr_p):
            return None
        return decode(trace_id, span_id, self._row.val, self.clock)

    def _put_index(self, trace_id: bytes, span_id: int, cgroups: list[int]) -> None:
        """List these cgroups' rows of the span in its index again (the rows
        another sender's span may still take)."""
        _IKEY.pack_into(self._idx.key, 0, trace_id, span_id)
        listed = (cgroups + [0] * INDEX_CGROUPS)[:INDEX_CGROUPS]
        _IVAL.pack_into(self._idx.val, 0, *listed, min(len(cgroups), INDEX_CGROUPS), 0)
        if not self._closed:
            bpf_sys.syscall(self._sys_bpf, bpf_sys.MAP_UPDATE_ELEM, self._idx.attr_p, self._attr_size)

    def take(self, trace_id: bytes, span_id: int) -> KernelFacts | None:
        """The span's rows summed into one (every cgroup's: tools and tests;
        the join picks rows by origin with take_rows()); None without facts."""
        rows = self.take_rows(trace_id, span_id)
        if not rows:
            return None
        first = rows[0]
        for r in rows[1:]:
            for name in ("launches", "launch_ns", "sync_wait_ns", "syncs", "violations",
                         "graph_launches", "graph_kernels", "sampled_events"):
                setattr(first, name, getattr(first, name) + getattr(r, name))
            for api, n in r.launches_by_api.items():
                first.launches_by_api[api] = first.launches_by_api.get(api, 0) + n
        return first

    def take_row(self, trace_id: bytes, span_id: int, cgroup_id: int) -> KernelFacts | None:
        """One cgroup's row of the span (the sweep's late rows), deleted, with
        the span's index entry (made again by a row made later)."""
        with self._lock:
            row = self._take_row(trace_id, span_id, cgroup_id)
            self._drop_index(trace_id, span_id)
            return row

    def _drop_index(self, trace_id: bytes, span_id: int) -> None:
        _IKEY.pack_into(self._idx.key, 0, trace_id, span_id)
        self._call(bpf_sys.MAP_DELETE_ELEM, self._idx.del_attr_p)

    def join_resource(self, blob: bytes, origin=None):
        """The join's common case done in C (native/spanlet_wire.c) on one
        serialized ResourceSpans: each span's rows taken (index, then rows),
        picked by `origin` as join.pick_rows does, and the kept facts appended
        as attributes. None when it is not that case (or the C part is not
        built): nothing was taken, the caller joins span by span; else
        (new blob or None if nothing joined, keys of all its spans, spans
        that got rows, cgroup, rows taken as (cgroup, reason) with reason 0
        kept, 1 other_pod, 2 conflict)."""
        if _join_resource is None or (origin is not None and len(origin) > ORIGIN_MAX):
            return None
        with self._lock:
            if self._closed:
                return None
            got = _join_resource(blob, self.table.map_fd, self.index.map_fd,
                                 None if origin is None else tuple(origin))
            if got is not None and got[4]:
                # taken (reason 0); the others were left in the map
                kept = Counter(cg for cg, reason in got[4] if reason == 0)
                for cg, n in kept.items():
                    self._stats.taken += n
                    self._release(cg, n)
            return got

    def delete(self, trace_id: bytes, span_id: int, cgroup_id: int) -> bool:
        """Drop a row unread (the sweep's expired rows), with the span's index
        entry; counted as swept."""
        with self._lock:
            _KEY.pack_into(self._row.key, 0, trace_id, span_id, cgroup_id)
            gone = self._call(bpf_sys.MAP_DELETE_ELEM, self._row.del_attr_p)
            self._drop_index(trace_id, span_id)
            self._stats.swept += gone
            if gone:
                self._release(cgroup_id, 1)
            return gone

    def put_row(self, trace_id: bytes, span_id: int, cgroup_id: int = 0, **fields: int) -> None:
        """Write a row as the kernel makes one (tools, tests, benches): the row
        for (span, cgroup) with `fields` (struct span_facts_val's), the cgroup
        appended to the span's index entry. Not counted as created."""
        self._empty_at = None
        k, v = self.table.Key(), self.table.Leaf()
        k.trace_id[:] = list(trace_id.ljust(16, b"\0"))
        k.span_id, k.cgroup_id = span_id, cgroup_id
        v.cgroup_id = cgroup_id
        for name, x in fields.items():
            setattr(v, name, x)
        self.table[k] = v
        ik = self.index.Key()
        ik.trace_id[:] = list(trace_id.ljust(16, b"\0"))
        ik.span_id = span_id
        try:
            iv = self.index[ik]
        except KeyError:
            iv = self.index.Leaf()
        if iv.n < INDEX_CGROUPS:
            iv.cgroups[iv.n] = cgroup_id
        iv.n += 1
        self.index[ik] = iv

    # -- the kernel's per-cgroup count of live rows ---------------------------------
    def _release(self, cgroup_id: int, n: int) -> None:
        """`n` rows of the cgroup gone: the kernel's figure of rows gone
        (span_facts_cg_released) raised every RELEASE_BATCH of them."""
        if self._rel is None:
            return
        gone = self._gone.get(cgroup_id, 0) + n
        if gone < RELEASE_BATCH:
            self._gone[cgroup_id] = gone
            return
        self._gone.pop(cgroup_id, None)
        self._write_released(cgroup_id, self._released.get(cgroup_id, 0) + gone)

    def _write_released(self, cgroup_id: int, value: int) -> None:
        self._released[cgroup_id] = value
        _U64.pack_into(self._rel.key, 0, cgroup_id)
        _U64.pack_into(self._rel.val, 0, value)
        if not self._closed and bpf_sys.syscall(self._sys_bpf, bpf_sys.MAP_UPDATE_ELEM, self._rel.attr_p,
                                         self._attr_size) != 0:
            err = C.get_errno()
            if err != errno.E2BIG:     # the table full: that cgroup is bounded by the total only
                raise OSError(err, f"bpf(update) on span_facts_cg_released: {os.strerror(err)}")

    def _reconcile(self, created: dict[int, int], keys: bytes) -> int:
        """After a scan: every cgroup's rows gone = rows made (read before the
        scan) - rows present (a row made in between only makes the live figure
        look bigger until the next scan). Also counts LRU evictions as gone.
        A cgroup with nothing live and nothing new since the last scan leaves
        the kernel's tables (they are bounded). Returns the cgroups left there."""
        live: dict[int, int] = {}
        for _, _, cg in _KEY.iter_unpack(keys):
            live[cg] = live.get(cg, 0) + 1
        for cg, made in created.items():
            released = max(0, made - live.get(cg, 0))
            self._gone.pop(cg, None)
            if not live.get(cg) and self._released.get(cg) == made == released:
                for t in (self._cg_created, self._cg_released):
                    try:
                        del t[t.Key(cg)]
                    except KeyError:
                        pass
                self._released.pop(cg, None)
                continue
            if self._released.get(cg) != released:
                self._write_released(cg, released)
        for cg in list(self._released):
            if cg not in created:
                del self._released[cg]
        self._stats.live_by_cgroup = live
        return len(self._released)

    def _read_created(self) -> dict[int, int]:
        if self._cg_created is None:
            return {}
        return {k.value: v.value for k, v in self._cg_created.items()}

    def rows(self) -> list[KernelFacts]:
        """Every row present, not deleted (BPF_MAP_LOOKUP_BATCH where the
        kernel has it); also refreshes the present/evicted figures."""
        keys, vals = self._read_all()
        return [decode(trace_id, span_id, vals, self.clock, i * _VAL.size)
                for i, (trace_id, span_id, _) in enumerate(_KEY.iter_unpack(keys))]

    def ages(self) -> list[tuple[bytes, int, int, int]]:
        """(trace id, span id, cgroup id, first event in epoch ns) of every row
        present: what the sweep needs, without decoding whole rows (a full map
        of 65,536 rows in tens of ms rather than half a second)."""
        keys, vals = self._read_all()
        offset = self.clock.to_epoch(0)
        return [(trace_id, span_id, cg, first + offset) for (trace_id, span_id, cg), (first,) in
                zip(_KEY.iter_unpack(keys), _FIRST.iter_unpack(vals))]

    def _read_all(self) -> tuple[bytes, bytes]:
        """Every key and value, packed (BPF_MAP_LOOKUP_BATCH, chunk by chunk);
        the kernel's per-cgroup live counts set right from them."""
        with self._lock:
            if self._closed:
                return b"", b""
            created = self._created()
            if created == self._empty_at:
                return b"", b""
            by_cgroup = self._read_created()
            keys, vals = read_batches(self.table)
            left = self._reconcile(by_cgroup, keys)
            self._empty_at = created if not keys and not left and not self._gone else None
            st = self._stats
            st.created, st.present = created, len(keys) // _KEY.size
            # Rows made or taken while we read make this an underestimate,
            # never an overestimate: keep the counter monotonic.
            st.evicted = max(st.evicted, created - st.taken - st.swept - st.present)
        return keys, vals

    def _read_refused(self, st: SpanFactsStats) -> None:
        if self._refused is not None:
            st.refused = percpu_sum(self._refused, 0)
            st.cgroups_full = percpu_sum(self._refused, 1)
        if self._cg_refused is not None:
            st.refused_by_cgroup = {k.value: v.value for k, v in self._cg_refused.items()}

    def stats(self) -> SpanFactsStats:
        with self._lock:
            st = SpanFactsStats(**self._stats.__dict__)
            st.live_by_cgroup = dict(st.live_by_cgroup)
            if not self._closed:
                st.created = max(st.created, self._created())
                self._read_refused(st)
        return st
