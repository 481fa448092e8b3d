"""Readers of BPF maps shared by the probes: a batch dump of a hash map (a
BCC table or a CO-RE object's map: both give map_fd, Key, Leaf,
max_entries and name) as ctypes entries, or packed bytes, and the sum of a
per-CPU counter."""

from __future__ import annotations

import ctypes as C
import errno
import os

from spanlet.probes import libbpf


def _batches(table, chunk: int):
    """(keys array, values array, count) per BPF_MAP_LOOKUP_BATCH call over the
    whole table (the arrays are reused: copy before the next); None where
    the kernel refuses batches for this map."""
    lib = libbpf.lib()
    n = max(1, min(chunk, table.max_entries))
    keys = (table.Key * n)()
    values = (table.Leaf * n)()
    token = C.c_uint32(0)
    count = C.c_uint32(0)
    first = True
    while True:
        count.value = n
        res = lib.bpf_map_lookup_batch(table.map_fd, None if first else C.byref(token),
                                       C.byref(token), C.byref(keys), C.byref(values),
                                       C.byref(count), None)
        err = C.get_errno()
        if res != 0 and err not in (errno.ENOENT,):
            if first and err in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                yield None
                return
            raise OSError(err, f"BPF_MAP_LOOKUP_BATCH on {table.name}: {os.strerror(err)}")
        yield keys, values, count.value
        if res != 0 or count.value == 0:
            return
        first = False


def dump_table(table, chunk: int = 4096) -> dict[bytes, object]:
    """All entries of a hash map, read in batches (one syscall per chunk
    instead of two per key); falls back to iteration where batches are refused."""
    out: dict[bytes, object] = {}
    for batch in _batches(table, chunk):
        if batch is None:
            return {bytes(k): v for k, v in table.items()}
        keys, values, n = batch
        for i in range(n):
            out[bytes(keys[i])] = type(values[i]).from_buffer_copy(values[i])
    return out


def read_batches(table, chunk: int = 4096) -> tuple[bytes, bytes]:
    """All keys and all values of a hash map, each packed into one
    bytes object (for struct.iter_unpack: no Python object per entry)."""
    ks, vs = [], []
    k_size, v_size = C.sizeof(table.Key), C.sizeof(table.Leaf)
    for batch in _batches(table, chunk):
        if batch is None:
            for k, v in table.items():
                ks.append(bytes(k))
                vs.append(bytes(v))
            break
        keys, values, n = batch
        ks.append(C.string_at(keys, n * k_size))
        vs.append(C.string_at(values, n * v_size))
    return b"".join(ks), b"".join(vs)


def percpu_sum(table, key) -> int:
    """Sum of a per-CPU counter at `key` (0 when the key is absent)."""
    try:
        values = table[table.Key(key)] if not isinstance(key, C.Structure) else table[key]
    except KeyError:
        return 0
    return sum(int(getattr(v, "value", v)) for v in values)


class Totals:
    """Monotonic per-key totals of counters kept in an LRU map: an entry the
    LRU drops and remakes starts again from 0, which would read as a counter
    going back. Keys beyond `max_keys` (the least recently grown first) are
    folded into key 0."""

    def __init__(self, max_keys: int = 4096):
        self.max_keys = max_keys
        self._last: dict = {}
        self._total: dict = {}

    def update(self, current: dict) -> dict:
        """current: key → the map's counter now. Returns the totals."""
        last, total = self._last, self._total
        for key, value in current.items():
            before = last.get(key, 0)
            grew = value - before if value >= before else value   # remade: counts from 0
            if grew:
                total[key] = total.pop(key, 0) + grew              # most recently grown last
            last[key] = value
        for key in [k for k in last if k not in current]:
            del last[key]
        while len(total) - (0 in total) > self.max_keys:
            key = next(k for k in total if k != 0)
            total[0] = total.get(0, 0) + total.pop(key)
        return dict(total)

