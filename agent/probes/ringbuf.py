"""Batch reader of a BPF ring buffer: maps it into the agent (as libbpf does)
and walks the records in place, so one wake-up drains thousands of records
without a Python callback per record. Layout: include/uapi/linux/bpf.h and
kernel/bpf/ringbuf.c (consumer page, producer page, data area mapped twice).

Two readers of the same ring: NativeRingBufferReader walks it in C
(native/spanlet_ring.c, the module spanlet._ring built with the package) and
hands over the records of a wake-up as one list; RingBufferReader walks it
in Python, a callback per record (the way where the module is not built).
open_reader() gives the first where it can."""

from __future__ import annotations

import mmap
import select
import struct

try:
    from spanlet import _ring
except ImportError:        # a source tree without its build: the walk in Python
    _ring = None

NATIVE = _ring is not None
BUSY_BIT = 1 << 31
DISCARD_BIT = 1 << 30
HDR_SIZE = 8
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


class _Waiting:
    """The wake-ups of one ring: epoll on its map's descriptor (or on
    wake_fd: the tests' rings in plain files, which epoll refuses)."""

    def __init__(self, map_fd: int, wake_fd: int | None = None):
        self._epoll = select.epoll()
        self._epoll.register(map_fd if wake_fd is None else wake_fd, select.EPOLLIN)

    def wait(self, timeout_ms: int) -> bool:
        """Block until the kernel signals new data or the timeout passes."""
        return bool(self._epoll.poll(timeout_ms / 1000.0))

    def _close_wait(self) -> bool:
        """Close the epoll; False if it was closed already."""
        if self._epoll is None:
            return False
        self._epoll.close()
        self._epoll = None
        return True


def _check_size(size: int) -> None:
    if size <= 0 or size & (size - 1) or size % mmap.PAGESIZE:
        raise ValueError(f"ring buffer size {size} is not a power-of-two number of pages")


class RingBufferReader(_Waiting):
    """Reads records of one BPF_MAP_TYPE_RINGBUF. `consume(handle)` calls
    `handle(buffer, offset, size)` per record; the buffer is valid only
    during the call (copy what you keep: ctypes from_buffer_copy does).

    Ordering relies on x86-64's total store order (loads are acquires); an
    arm64 port needs explicit barriers around the position reads."""

    native = False

    def __init__(self, map_fd: int, size: int, wake_fd: int | None = None):
        _check_size(size)
        page = mmap.PAGESIZE
        self.size = size
        self._mask = size - 1
        self._consumer = mmap.mmap(map_fd, page, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        # producer page, then the data area twice so a record that wraps is contiguous
        self._producer = mmap.mmap(map_fd, page + 2 * size, mmap.MAP_SHARED,
                                   mmap.PROT_READ, offset=page)
        self._data = memoryview(self._producer)
        self._page = page
        super().__init__(map_fd, wake_fd)

    def pending(self) -> bool:
        return _U64.unpack_from(self._producer, 0)[0] != _U64.unpack_from(self._consumer, 0)[0]

    def consume(self, handle, limit: int | None = None) -> int:
        """Hand the committed records to `handle`, at most `limit` (default:
        as many as the ring can hold at once, so that a producer that keeps
        it full cannot hold the caller here for ever); returns how many."""
        if limit is None:
            limit = self.size // HDR_SIZE
        cons = _U64.unpack_from(self._consumer, 0)[0]
        prod = _U64.unpack_from(self._producer, 0)[0]
        mask, base, data = self._mask, self._page, self._data
        n = 0
        while cons < prod and n < limit:
            off = base + (cons & mask)
            length = _U32.unpack_from(data, off)[0]
            if length & BUSY_BIT:
                break  # reserved, not yet committed: records after it wait too
            size = length & ~(BUSY_BIT | DISCARD_BIT)
            if size + HDR_SIZE > self.size or prod - cons > self.size:
                cons = prod     # no ring the kernel writes (native/spanlet_ring.c): given back
                break
            if not length & DISCARD_BIT:
                handle(data, off + HDR_SIZE, size)
                n += 1
            cons += (size + HDR_SIZE + 7) & ~7
            if n & 0xFF == 0:
                _U64.pack_into(self._consumer, 0, cons)  # give space back on long drains
                prod = _U64.unpack_from(self._producer, 0)[0]
        _U64.pack_into(self._consumer, 0, cons)
        return n

    def close(self) -> None:
        if self._close_wait():
            self._data.release()
            self._producer.close()
            self._consumer.close()


class NativeRingBufferReader(_Waiting):
    """The same reader with the walk in C (spanlet._ring.Ring: the same
    layout, BUSY and DISCARD bits, space given back every 256 records of a
    long drain, acquire loads and a release store of the position).
    `read(layout, clock)` returns a wake-up's records as one batch of
    spanlet._ring.Record (agent/events.py RECORD_LAYOUT); `consume(handle)`
    hands each record's bytes to handle(bytes, 0, size)."""

    native = True

    def __init__(self, map_fd: int, size: int, wake_fd: int | None = None):
        _check_size(size)
        self.size = size
        self._ring = _ring.Ring(map_fd, size)
        super().__init__(map_fd, wake_fd)

    def pending(self) -> bool:
        return self._ring.pending()

    def positions(self) -> tuple[int, int]:
        """(consumer, producer) positions."""
        return self._ring.positions()

    def read(self, layout: tuple, clock, limit: int | None = None) -> tuple:
        """(records, errors): at most `limit` records (default as consume's),
        each decoded by `layout` when a field of it is read, its epoch time
        clock.to_epoch(ts_ns); errors: records not of the layout (counted in
        limit, not returned). records: a spanlet._ring.Batch, len() of them,
        iterated once (each let go as it is handed out)."""
        offset, nxt = clock.state() if hasattr(clock, "state") else (0, -1)
        return self._ring.read(self.size // HDR_SIZE if limit is None else limit,
                               layout, clock, offset, nxt)

    def consume(self, handle, limit: int | None = None) -> int:
        records = self._ring.read_raw(self.size // HDR_SIZE if limit is None else limit)
        for raw in records:
            handle(raw, 0, len(raw))
        return len(records)

    def close(self) -> None:
        if self._close_wait():
            self._ring.close()


def open_reader(map_fd: int, size: int, native: bool = NATIVE, wake_fd: int | None = None):
    """The C reader where the module is built (and `native`), else the Python one."""
    cls = NativeRingBufferReader if native and NATIVE else RingBufferReader
    return cls(map_fd, size, wake_fd)
