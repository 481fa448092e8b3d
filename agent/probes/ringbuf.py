"""Batch reader of a BPF ring buffer: maps it into the agent (as libbpf does)
and walks the records in place, so one wake-up drains thousands of records
without a Python callback per record. Layout: include/uapi/linux/bpf.h and
kernel/bpf/ringbuf.c (consumer page, producer page, data area mapped twice)."""

from __future__ import annotations

import mmap
import select
import struct

BUSY_BIT = 1 << 31
DISCARD_BIT = 1 << 30
HDR_SIZE = 8
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


class RingBufferReader:
    """Reads records of one BPF_MAP_TYPE_RINGBUF. `consume(handle)` calls
    `handle(buffer, offset, size)` per record; the buffer is valid only
    during the call (copy what you keep: ctypes from_buffer_copy does).

    Ordering relies on x86-64's total store order (loads are acquires); an
    arm64 port needs explicit barriers around the position reads."""

    def __init__(self, map_fd: int, size: int):
        if size <= 0 or size & (size - 1) or size % mmap.PAGESIZE:
            raise ValueError(f"ring buffer size {size} is not a power-of-two number of pages")
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
        self._epoll = select.epoll()
        self._epoll.register(map_fd, select.EPOLLIN)

    def wait(self, timeout_ms: int) -> bool:
        """Block until the kernel signals new data or the timeout passes."""
        return bool(self._epoll.poll(timeout_ms / 1000.0))

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
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None
            self._data.release()
            self._producer.close()
            self._consumer.close()
