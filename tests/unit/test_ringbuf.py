"""The ring-buffer readers on the kernel's memory layout in a plain file: the
C walk (spanlet._ring) hands the consumer every record, in order, with the
same fields, epoch times and counts as the Python walk and the ctypes decode
do, through wrap-around, discarded, busy and malformed records."""

from __future__ import annotations

import ctypes as C
import random
import struct
import sys
import threading
import time

import pytest

from require import cannot_run
from fake_ring import PAGE, FakeRing, random_record
from spanlet import events
from spanlet.probes import ringbuf
from spanlet.probes.base import Probe


@pytest.fixture(autouse=True)
def _native_reader_built():
    if not ringbuf.NATIVE:
        cannot_run("spanlet._ring is not built (every build of the package builds it)")


def det_clock(cls=events.MonotonicClock):
    """A clock whose refreshes are numbered: the k-th sets an offset of its
    own and holds until ts 37 µs * k (records come every 1 µs)."""
    clock = cls()
    refreshes = iter(range(1, 1 << 30))

    def refresh():
        k = next(refreshes)
        clock.offset_ns = 1_700_000_000_000_000_000 + 1_000 * k
        clock._next = 37_000 * k
    clock.refresh = refresh
    clock.offset_ns, clock._next = 1_700_000_000_000_000_000, 0
    return clock


class AnyClock(events.MonotonicClock):
    """A clock the C reader does not know: it asks to_epoch for each record."""


@pytest.fixture
def fake(tmp_path):
    """A one-page ring laid out as the kernel lays it out, closed at teardown."""
    ring = FakeRing(tmp_path / "ring", PAGE)
    yield ring
    ring.close()


@pytest.fixture
def synced(tmp_path):
    """filled(n, seed) -> (reader, raws): a one-page ring holding n sync
    records (ts 1 µs apart), read by the C walk; all closed at teardown."""
    opened = []

    def filled(n: int, seed: int):
        fake = FakeRing(tmp_path / f"ring{len(opened)}", PAGE)
        reader = ringbuf.NativeRingBufferReader(fake.fd, fake.size, fake.wake_fd)
        opened.extend([fake, reader])
        rng = random.Random(seed)
        raws = [random_record(rng, 1_000 * (i + 1), events.Kind.GPU_SYNC) for i in range(n)]
        for r in raws:
            fake.put(r)
        return reader, raws
    yield filled
    for x in reversed(opened):
        x.close()


def reader_probe(cfg, fake: FakeRing, native: bool, clock) -> tuple[Probe, list]:
    got: list = []
    p = Probe(cfg, sink=got.append, clock=clock)
    cls = ringbuf.NativeRingBufferReader if native else ringbuf.RingBufferReader
    p._ring = cls(fake.fd, fake.size, fake.wake_fd)
    return p, got


def malformed(rng: random.Random, ts: int) -> bytes:
    """A record the decoder refuses: shorter than the header, of an unknown
    kind, or shorter than its kind's struct."""
    which = rng.randrange(3)
    if which == 0:
        return rng.randbytes(rng.randrange(1, C.sizeof(events.Header)))
    raw = bytearray(random_record(rng, ts, events.Kind.GPU_SYNC))
    if which == 1:
        struct.pack_into("<H", raw, events.Header.kind.offset, rng.choice([0, 7, 99, 65535]))
        return bytes(raw)
    struct.pack_into("<H", raw, events.Header.kind.offset, events.Kind.GPU_LAUNCH)
    return bytes(raw)      # a sync record's size, a launch record's kind


def stream(seed: int, n: int):
    """(record, discard) of one run: valid records of every kind (some with
    bytes past their struct), discarded and malformed ones."""
    rng = random.Random(seed)
    for i in range(n):
        ts = 1_000 * (i + 1)
        r = rng.random()
        if r < 0.1:
            yield malformed(rng, ts), False
        elif r < 0.2:
            yield random_record(rng, ts), True
        elif r < 0.25:
            yield random_record(rng, ts) + rng.randbytes(rng.randrange(1, 20)), False
        else:
            yield random_record(rng, ts), False


def expected_event(raw: bytes):
    try:
        return events.from_record(raw, 0)
    except events.DecodeError:
        return None


def fields(ev) -> tuple:
    d = ev.as_dict()
    return bytes(ev), ev.epoch_ns, d


@pytest.mark.parametrize("seed", range(24))
@pytest.mark.parametrize("clock_kind", ["monotonic", "any"])
def test_c_walk_gives_what_the_python_walk_gives(cfg, tmp_path, seed, clock_kind):
    """Two rings fed the same records (wrapping round a one-page ring many
    times), read at the same points, one by each reader: the same events,
    fields, epoch times, order and counts, and what was written."""
    cls = events.MonotonicClock if clock_kind == "monotonic" else AnyClock
    size = PAGE * (1 if seed % 2 else 2)
    fakes = [FakeRing(tmp_path / f"ring{k}", size) for k in range(2)]
    try:
        (pn, got_n), (pp, got_p) = (reader_probe(cfg, fakes[0], True, det_clock(cls)),
                                    reader_probe(cfg, fakes[1], False, det_clock(cls)))
        rng = random.Random(seed * 7919)
        want, errors, dropped = [], 0, 0
        read_n = read_p = 0
        for raw, discard in stream(seed, 3_000):
            placed = [f.put(raw, discard=discard) for f in fakes]
            assert placed[0] == placed[1]
            if placed[0] is None:
                dropped += 1
            elif not discard:
                ev = expected_event(raw)
                if ev is None:
                    errors += 1
                else:
                    want.append(ev)
            if rng.random() < 0.03:
                read_n += pn.drain()
                read_p += pp.drain()
        read_n += pn.drain()
        read_p += pp.drain()
        assert dropped > 0 or size > PAGE        # the small ring filled up at times
        assert read_n == read_p == len(want) + errors
        assert pn.events_read == pp.events_read == len(want)
        assert pn.decode_errors == pp.decode_errors == errors
        assert len(got_n) == len(got_p) == len(want)
        assert all(type(ev).__name__ == "Record" for ev in got_n)
        for a, b, w in zip(got_n, got_p, want):
            assert fields(a) == fields(b)
            assert bytes(a) == bytes(w)
        assert [ev.epoch_ns for ev in got_n] == [ev.epoch_ns for ev in got_p]
        assert fakes[0].consumer == fakes[0].prod and fakes[1].consumer == fakes[1].prod
    finally:
        for f in fakes:
            f.close()


def test_a_busy_record_holds_back_the_ones_after_it(cfg, fake):
    p, got = reader_probe(cfg, fake, True, events.MonotonicClock())
    rng = random.Random(1)
    recs = [random_record(rng, 1_000 * (i + 1), events.Kind.GPU_SYNC) for i in range(3)]
    fake.put(recs[0])
    busy = fake.put(recs[1], busy=True)
    fake.put(recs[2])
    assert p.drain() == 1 and [bytes(ev) for ev in got] == recs[:1]
    assert p.drain() == 0 and p._ring.pending()
    fake.commit(busy)
    assert p.drain() == 2 and [bytes(ev) for ev in got] == recs
    assert not p._ring.pending()


def test_limit_and_space_given_back_during_a_long_drain(tmp_path):
    """A read stops at its limit with the position after the last record it
    gave; a long drain gives space back every 256 records, before its end."""
    fake = FakeRing(tmp_path / "ring", 16 * PAGE)
    try:
        reader = ringbuf.NativeRingBufferReader(fake.fd, fake.size, fake.wake_fd)
        rng = random.Random(2)
        positions = [fake.put(random_record(rng, 1_000 * (i + 1), events.Kind.GPU_SYNC))
                     for i in range(600)]
        assert None not in positions
        seen = []

        class Watching(events.MonotonicClock):
            def to_epoch(self, mono_ns):   # called for every record (not a MonotonicClock)
                seen.append(fake.consumer)
                return mono_ns

        recs, errors = reader.read(events.RECORD_LAYOUT, Watching(), limit=10)
        assert len(recs) == 10 and errors == 0 and fake.consumer == positions[10]
        assert reader.positions() == (positions[10], fake.prod)
        recs, _ = reader.read(events.RECORD_LAYOUT, Watching())
        assert len(recs) == 590 and fake.consumer == fake.prod
        # the 256th record of the drain was given back before the 257th was read
        assert seen[10 + 256] == positions[10 + 256]
        assert [r.epoch_ns for r in recs] == [1_000 * (i + 11) for i in range(590)]
        reader.close()
    finally:
        fake.close()


def test_a_batch_hands_each_record_out_once_and_lets_it_go(synced):
    reader, raws = synced(5, 4)
    batch, _ = reader.read(events.RECORD_LAYOUT, events.MonotonicClock())
    assert len(batch) == 5
    it = iter(batch)
    first = next(it)
    assert sys.getrefcount(first) == 2          # ours and getrefcount's: the batch let it go
    assert [bytes(first)] + [bytes(ev) for ev in it] == raws
    assert list(batch) == [] and len(batch) == 5


def test_closed_in_the_middle_of_a_read(synced):
    """The clock may run Python during a read: a close() then waits for the
    read's end to unmap, and the reader refuses reads after it."""
    reader, raws = synced(20, 3)

    class Closing(events.MonotonicClock):
        def to_epoch(self, mono_ns):
            reader.close()
            return mono_ns

    batch, _ = reader.read(events.RECORD_LAYOUT, Closing())
    assert [bytes(ev) for ev in batch] == raws
    with pytest.raises(ValueError):
        reader._ring.pending()
    with pytest.raises(ValueError):
        reader._ring.read_raw(10)


@pytest.mark.parametrize("kind", list(events.RECORDS))
def test_a_record_reads_as_its_struct(fake, kind):
    reader = ringbuf.NativeRingBufferReader(fake.fd, fake.size, fake.wake_fd)
    rng = random.Random(kind)
    raw = random_record(rng, 123_456, kind)
    fake.put(raw)
    (ev,), errors = reader.read(events.RECORD_LAYOUT, det_clock())
    want = events.from_record(raw, ev.epoch_ns)
    assert errors == 0 and ev.epoch_ns == 1_700_000_000_000_000_000 + 1_000 + 123_456
    assert bytes(ev) == raw and memoryview(ev).tobytes() == raw and ev.raw == raw
    assert ev.as_dict() == want.as_dict() and ev.kind == want.kind == kind
    assert isinstance(ev, type(want)) and isinstance(ev, events._Event)
    assert not isinstance(ev, next(c for k, c in events.RECORDS.items() if k != kind))
    for name, _ in type(want)._fields_:
        a, b = getattr(ev, name), getattr(want, name)
        assert bytes(a) == bytes(b) if not isinstance(b, int) else a == b, name
    assert ev.hdr.span_id == want.hdr.span_id and bytes(ev.hdr.trace_id) == bytes(want.hdr.trace_id)
    if kind == events.Kind.HTTP_BYTES:
        assert ev.rx_tx() == want.rx_tx()
    if kind == events.Kind.HTTP:
        assert ev.has_traceparent == want.has_traceparent
        assert bytes(events.FlowKey.from_buffer_copy(ev.flow)) == bytes(want.flow)
    assert events.decode(bytes(ev), events.MonotonicClock()).as_dict()["pid"] == want.hdr.pid
    with pytest.raises(AttributeError):
        ev.epoch_ns = 5
    with pytest.raises(AttributeError):
        ev.no_such_field
    reader.close()


def test_consume_hands_each_record_as_it_is(fake):
    reader = ringbuf.NativeRingBufferReader(fake.fd, fake.size, fake.wake_fd)
    rng = random.Random(5)
    recs = [rng.randbytes(rng.randrange(1, 100)) for _ in range(30)]
    for i, r in enumerate(recs):
        fake.put(r, discard=i % 4 == 1)
    got = []
    assert reader.consume(lambda buf, off, size: got.append(bytes(buf[off:off + size]))) == \
        len(recs) - len(recs[1::4])
    assert got == [r for i, r in enumerate(recs) if i % 4 != 1]
    reader.close()


def test_the_probes_read_through_the_c_walk_where_it_is_built(fake):
    assert Probe.native_ring is True
    for native, cls in [(True, ringbuf.NativeRingBufferReader), (False, ringbuf.RingBufferReader)]:
        reader = ringbuf.open_reader(fake.fd, fake.size, native=native, wake_fd=fake.wake_fd)
        assert type(reader) is cls and reader.native is native
        reader.close()
    with pytest.raises(ValueError):
        ringbuf.open_reader(fake.fd, 3 * PAGE, wake_fd=fake.wake_fd)


def test_the_header_reads_its_integers_without_a_decode(synced):
    """ev.hdr's integer fields come from the record's bytes (the struct is not
    decoded for them); anything else of the header (trace_id) from the
    decoded struct, of the same type as before."""
    decodes = []

    class Counted(events.GpuSync):
        @classmethod
        def from_buffer_copy(cls, *args):
            decodes.append(1)
            return events.GpuSync.from_buffer_copy(*args)

    classes = list(events.RECORD_LAYOUT[2])
    classes[events.Kind.GPU_SYNC] = Counted
    layout = (*events.RECORD_LAYOUT[:2], tuple(classes), events.RECORD_LAYOUT[3])
    reader, raws = synced(40, 11)
    batch, _ = reader.read(layout, events.MonotonicClock())
    recs = list(batch)
    names = [n for n, _ in events.Header._fields_ if n not in ("trace_id", "_pad")]
    for ev, raw in zip(recs, raws):
        want = events.Header.from_buffer_copy(raw)
        assert {n: getattr(ev.hdr, n) for n in names} == {n: getattr(want, n) for n in names}
        assert bytes(ev.hdr) == bytes(want) and memoryview(ev.hdr).tobytes() == bytes(want)
    assert decodes == []
    for ev, raw in zip(recs, raws):
        tid = ev.hdr.trace_id
        assert type(tid) is type(events.Header.from_buffer_copy(raw).trace_id)
        assert bytes(tid) == raw[24:40]
    assert len(decodes) == len(recs)
    ev = recs[0]
    ev.stream, ev.hdr.trace_id, ev.as_dict()
    assert len(decodes) == len(recs)       # decoded once


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("corrupt", ["record_longer_than_ring", "producer_past_a_ring"])
def test_a_ring_no_kernel_writes_is_given_back_not_read_past_or_walked_for_ever(fake, native, corrupt):
    """Found by the ring reader's fuzz target (fuzz/ring_read.c, inputs in
    fuzz/regressions/ring_read/): a record longer than the ring (read past
    the mapping) or a producer more than a ring ahead (a discarded record the
    size of the ring found again and again); the kernel makes neither. Both
    walks give the ring back up to the producer and read on after."""
    cls = ringbuf.NativeRingBufferReader if native else ringbuf.RingBufferReader
    reader = cls(fake.fd, fake.size, fake.wake_fd)
    try:
        rng = random.Random(3)
        first, after = (random_record(rng, 1_000 * (i + 1), events.Kind.GPU_SYNC) for i in range(2))
        fake.put(first)
        if corrupt == "record_longer_than_ring":
            fake._write(fake.prod, struct.pack("<II", fake.size + 1, 0))
            fake.prod += 64
        else:
            fake._write(fake.prod, struct.pack("<II", (fake.size - 8) | ringbuf.DISCARD_BIT, 0))
            fake.prod += 3 * fake.size
        fake._flush()
        # the records before the bad length are read; a producer past a ring
        # leaves nothing to trust in it
        before = [first] if corrupt == "record_longer_than_ring" else []
        got = []
        assert reader.consume(lambda data, off, size: got.append(bytes(data[off:off + size]))) == len(before)
        assert got == before and fake.consumer == fake.prod
        fake.put(after)
        assert reader.consume(lambda data, off, size: got.append(bytes(data[off:off + size]))) == 1
        assert got == before + [after]
    finally:
        reader.close()


@pytest.mark.parametrize("native", [True, False], ids=["c-walk", "python-walk"])
def test_the_read_loop_and_a_drain_hand_each_record_on_once(cfg, fake, native):
    """The read loop (poll) and the span path (drain, before each join) read one
    ring from two threads while a producer fills it: every record reaches the
    sink once, in the order written (the probe's read lock: without it the
    Python walk's two readers start from the same consumer position and hand
    the same records on; the C walk holds the GIL through a read)."""
    p, got = reader_probe(cfg, fake, native, events.MonotonicClock())
    n, done = 2000, threading.Event()
    rng = random.Random(7)
    raws = [random_record(rng, 1_000 * (i + 1), events.Kind.GPU_SYNC) for i in range(n)]

    def produce() -> None:
        for r in raws:
            while fake.put(r) is None:
                time.sleep(0)
        done.set()

    def read_loop() -> None:
        while not (done.is_set() and fake.consumer == fake.prod):
            p.poll(1)

    def drains() -> None:
        while not (done.is_set() and fake.consumer == fake.prod):
            p.drain()

    threads = [threading.Thread(target=f, daemon=True) for f in (produce, read_loop, drains)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    ts = [struct.unpack_from("<Q", bytes(ev))[0] for ev in got]
    assert ts == [1_000 * (i + 1) for i in range(n)]
