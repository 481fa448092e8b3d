"""The ring-buffer readers on a real BPF ring buffer: a program on the
getppid tracepoint writes one numbered record per call of this process
(launch and sync records, some discarded, some of a kind the agent does not
know) into a one-page ring that wraps round many times; the C walk and the
Python walk, taking turns on the same ring, hand the consumer every record
that was submitted, in order, with exactly the fields written, and count the
unknown ones as decode errors."""

from __future__ import annotations

import os
import random
import threading

import pytest

from spanlet import config, events
from spanlet.probes import ringbuf
from spanlet.probes.base import BPF_DIR, Probe, expand_source

pytestmark = pytest.mark.kernel

PROGRAM = r"""
#include "spanlet.h"
BPF_ARRAY(ctl, u64, 2);          /* [0] the test's pid, [1] records numbered so far */

/* BCC rewrites no map call inside a macro: the reserve is outside it */
#define FILL_HDR(ev, kind_)                                 \
    __builtin_memset(ev, 0, sizeof(*ev));                   \
    ev->hdr.ts_ns = bpf_ktime_get_ns();                     \
    ev->hdr.pid = pid_tgid >> 32;                           \
    ev->hdr.tid = (u32)pid_tgid;                            \
    ev->hdr.kind = kind_;                                   \
    ev->hdr.span_id = n;

TRACEPOINT_PROBE(syscalls, sys_enter_getppid)
{
    u64 pid_tgid = bpf_get_current_pid_tgid();
    int k0 = 0, k1 = 1;
    u64 *want = ctl.lookup(&k0);
    if (!want || *want != (pid_tgid >> 32))
        return 0;
    u64 *seq = ctl.lookup(&k1);
    if (!seq)
        return 0;
    u64 n = __sync_fetch_and_add(seq, 1);
    if (n % 3 == 1) {
        struct gpu_launch_event *ev = events.ringbuf_reserve(sizeof(*ev));
        if (!ev)
            return 0;
        FILL_HDR(ev, SPANLET_KIND_GPU_LAUNCH)
        ev->hdr.trace_id[0] = n & 0xff;
        ev->hdr.trace_id[15] = 0xA5;
        ev->func = n * 7;
        ev->stream = ~n;
        ev->grid[0] = n; ev->grid[1] = n + 1; ev->grid[2] = n + 2;
        ev->block[2] = 32;
        ev->shared_mem = n & 0xffff;
        ev->api = 1;
        ev->entry = n % 20 + 1;
        if (n % 5 == 2)
            events.ringbuf_discard(ev, 0);
        else
            events.ringbuf_submit(ev, 0);
    } else {
        struct gpu_sync_event *ev = events.ringbuf_reserve(sizeof(*ev));
        if (!ev)
            return 0;
        FILL_HDR(ev, n % 11 == 4 ? 99 : SPANLET_KIND_GPU_SYNC)
        ev->hdr.modality = n % 4;
        ev->stream = n;
        ev->duration_ns = n * 3;
        ev->api = 2;
        ev->entry = 4;
        if (n % 7 == 6)
            events.ringbuf_discard(ev, 0);
        else
            events.ringbuf_submit(ev, 0);
    }
    return 0;
}
"""


def submitted(n: int) -> bool:
    return n % 5 != 2 if n % 3 == 1 else n % 7 != 6


def unknown_kind(n: int) -> bool:
    return n % 3 != 1 and n % 11 == 4


def check(ev, n: int, pid: int, tid: int) -> None:
    h = ev.hdr
    assert (h.span_id, h.pid, h.tid) == (n, pid, tid)
    if n % 3 == 1:
        assert h.kind == events.Kind.GPU_LAUNCH
        assert (h.trace_id[0], h.trace_id[15]) == (n & 0xFF, 0xA5)
        assert (ev.func, ev.stream, list(ev.grid), list(ev.block)) == \
            (n * 7, ~n & (2**64 - 1), [n, n + 1, n + 2], [0, 0, 32])
        assert (ev.shared_mem, ev.api, ev.entry, ev.duration_ns) == (n & 0xFFFF, 1, n % 20 + 1, 0)
    else:
        assert h.kind == events.Kind.GPU_SYNC and h.modality == n % 4
        assert (ev.stream, ev.duration_ns, ev.api, ev.entry) == (n, n * 3, 2, 4)
        assert bytes(h.trace_id) == bytes(16)


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    from bcc import BPF

    cfg = config.load(env={})
    tmp = tmp_path_factory.mktemp("ring")
    for h in ("spanlet.h", "spanlet_types.h"):
        (tmp / h).write_text((BPF_DIR / h).read_text())
    src = tmp / "ring_test.bpf.c"
    src.write_text(PROGRAM)
    p = Probe(cfg)
    p.bpf = BPF(text=expand_source(src), cflags=["-DSPANLET_RINGBUF_PAGES=1"])   # attaches itself
    p.bpf["ctl"][p.bpf["ctl"].Key(0)] = p.bpf["ctl"].Leaf(os.getpid())
    try:
        yield p
    finally:
        p.stop()


@pytest.mark.parametrize("run", range(12))
def test_every_record_in_order_with_exact_fields_through_both_walks(program, run):
    assert ringbuf.NATIVE, "spanlet._ring is not built"
    fd = program.bpf["events"].map_fd
    readers = [ringbuf.NativeRingBufferReader(fd, 4096), ringbuf.RingBufferReader(fd, 4096)]
    ctl = program.bpf["ctl"]
    got: list = []
    program.sink = got.append
    rng = random.Random(run)
    pid, tid = os.getpid(), threading.get_native_id()
    program.drain()                       # nothing left from an earlier run
    first = ctl[ctl.Key(1)].value
    read0, errors0 = program.events_read, program.decode_errors
    types = set()
    try:
        for _ in range(200):
            for _ in range(rng.randrange(1, 30)):   # at most ~3,400 of the ring's 4,096 bytes
                os.getppid()
            program._ring = readers[rng.randrange(2)]
            program.drain()
            types.update(type(ev).__name__ for ev in got[-5:])
    finally:
        program._ring = None
        for r in readers:
            r.close()
    last = ctl[ctl.Key(1)].value
    want = [n for n in range(first, last) if submitted(n) and not unknown_kind(n)]
    assert [ev.hdr.span_id for ev in got] == want
    for ev, n in zip(got, want):
        check(ev, n, pid, tid)
    assert [ev.hdr.ts_ns for ev in got] == sorted(ev.hdr.ts_ns for ev in got)
    assert program.decode_errors - errors0 == sum(
        submitted(n) and unknown_kind(n) for n in range(first, last))
    assert program.events_read - read0 == len(want)
    assert program.events_dropped() == 0
    assert types == {"Record", "GpuLaunch", "GpuSync"}   # both walks took turns
    assert last - first > 1_000
