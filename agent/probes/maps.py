"""Readers of BPF maps shared by the probes: a batch dump of a BCC hash table
and the sum of a per-CPU counter."""

from __future__ import annotations

import ctypes as C
import errno
import os


def _bcc_lib():
    from bcc.libbcc import lib  # imported late: unit tiers run without BCC
    return lib


def dump_table(table, chunk: int = 4096) -> dict[bytes, object]:
    """All entries of a BCC hash table, read in batches (one syscall per chunk
    instead of two per key); falls back to iteration where batches are refused."""
    lib = _bcc_lib()
    n = max(1, min(chunk, table.max_entries))
    keys = (table.Key * n)()
    values = (table.Leaf * n)()
    token = C.c_uint32(0)
    count = C.c_uint32(0)
    out: dict[bytes, object] = {}
    first = True
    while True:
        count.value = n
        res = lib.bpf_lookup_batch(table.map_fd, None if first else C.byref(token),
                                   C.byref(token), C.byref(keys), C.byref(values),
                                   C.byref(count))
        err = C.get_errno()
        if res != 0 and err not in (errno.ENOENT,):
            if first and err in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                return {bytes(k): v for k, v in table.items()}
            raise OSError(err, f"BPF_MAP_LOOKUP_BATCH on {table.name}: {os.strerror(err)}")
        for i in range(count.value):
            out[bytes(keys[i])] = type(values[i]).from_buffer_copy(values[i])
        if res != 0 or count.value == 0:
            return out
        first = False


def percpu_sum(table, key) -> int:
    """Sum of a per-CPU counter at `key` (0 when the key is absent)."""
    try:
        values = table[table.Key(key)] if not isinstance(key, C.Structure) else table[key]
    except KeyError:
        return 0
    return sum(int(getattr(v, "value", v)) for v in values)
