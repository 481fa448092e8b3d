"""A BPF ring buffer's memory layout in a plain file (consumer page, producer
page, the data area twice), written the way the kernel's producer writes it,
for the ring-buffer readers' unit tests; and records of every kind with
their fields drawn from a seeded random source."""

from __future__ import annotations

import ctypes as C
import mmap
import os
import random
import struct

from spanlet import events

BUSY, DISCARD = 1 << 31, 1 << 30
PAGE = mmap.PAGESIZE
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


class FakeRing:
    """The producer side: reserve, commit or discard, space checked against
    the consumer position that the reader stores."""

    def __init__(self, path, size: int):
        self.size = size
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self.fd, 2 * PAGE + 2 * size)
        self.map = mmap.mmap(self.fd, 2 * PAGE + 2 * size)
        self.prod = 0
        self.ring = bytearray(size)
        self.wake_fd = os.eventfd(0)       # epoll refuses plain files

    @property
    def consumer(self) -> int:
        return _U64.unpack_from(self.map, 0)[0]

    def _write(self, pos: int, data: bytes) -> None:
        for i, b in enumerate(data):
            self.ring[(pos + i) % self.size] = b

    def _flush(self) -> None:
        self.map[2 * PAGE:2 * PAGE + self.size] = self.ring
        self.map[2 * PAGE + self.size:2 * PAGE + 2 * self.size] = self.ring
        _U64.pack_into(self.map, PAGE, self.prod)

    def put(self, record: bytes, discard: bool = False, busy: bool = False) -> int | None:
        """Reserve and write one record (committed, discarded, or left busy);
        None if the ring has no room for it (the kernel drops it). Returns its
        position."""
        total = (len(record) + 8 + 7) & ~7
        if self.prod + total - self.consumer > self.size:
            return None
        pos = self.prod
        length = len(record) | (BUSY if busy else 0) | (DISCARD if discard else 0)
        self._write(pos, _U32.pack(length) + _U32.pack(0) + record)
        self.prod += total
        self._flush()
        return pos

    def commit(self, pos: int) -> None:
        """Clear the BUSY bit of the record reserved at pos."""
        length = _U32.unpack_from(bytes(self.ring[(pos + i) % self.size] for i in range(4)))[0]
        self._write(pos, _U32.pack(length & ~BUSY))
        self._flush()

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)
        os.close(self.wake_fd)


def random_record(rng: random.Random, ts_ns: int, kind: int | None = None) -> bytes:
    """A record of a known kind (random unless given), every byte of its
    struct random but its kind and ts_ns."""
    kind = kind or rng.choice(list(events.RECORDS))
    cls = events.RECORDS[kind]
    raw = bytearray(rng.randbytes(C.sizeof(cls)))
    _U64.pack_into(raw, 0, ts_ns)
    struct.pack_into("<H", raw, events.Header.kind.offset, kind)
    return bytes(raw)
