"""kernel_events rows built by the engine from ring-buffer records
(kernel_records.py) are the rows rows.kernel_event_row builds in Python,
value for value: records of every kind with random bytes in every field
(unknown enum values, zero and non-zero ids, any address family), stored
both ways into a real chdb store and read back."""

from __future__ import annotations

import ctypes as C
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spanlet import events
from spanlet.exporters.clickhouse import BackendError, rows
from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend
from spanlet.exporters.clickhouse.kernel_records import encode

NOW = time.time_ns() - 3600 * 1_000_000_000   # inside the TTL
COLUMNS = ", ".join(f"`{c}`" for c in rows.KERNEL_EVENT_COLUMNS)
KINDS = sorted(int(k) for k in events.RECORDS)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    b = ChdbBackend(str(tmp_path_factory.mktemp("records") / "store"))
    b.ensure_schema()
    yield b
    b.close()


def _record(kind: int, payload: bytes, n: int, v4: bool) -> events._Event:
    cls = events.RECORDS[kind]
    raw = bytearray(payload[:C.sizeof(cls)].ljust(C.sizeof(cls), b"\0"))
    ev = cls.from_buffer(raw)
    ev.hdr.kind = kind
    if "flow" in dict(cls._fields_) and v4:
        ev.flow.family = 4
    out = cls.from_buffer_copy(raw)
    out.epoch_ns = NOW + n
    return out


records = st.lists(st.tuples(st.sampled_from(KINDS), st.binary(min_size=120, max_size=120), st.booleans()),
                   min_size=1, max_size=40)
names = st.text(max_size=12)


def _stored(backend) -> list[tuple]:
    return backend.query(f"SELECT {COLUMNS} FROM spanlet.kernel_events ORDER BY Timestamp")


@pytest.mark.parametrize("repeat", range(3))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=records, ns=names, pod=names, container=names, node=names)
def test_records_are_stored_as_the_python_rows(backend, repeat, specs, ns, pod, container, node):
    evs = [_record(kind, payload, n, v4) for n, (kind, payload, v4) in enumerate(specs)]
    resolve = lambda cgroup: (ns, f"{pod}{cgroup % 3}", container)   # noqa: E731
    backend.query("TRUNCATE TABLE spanlet.kernel_events")
    backend.insert("kernel_events", rows.KERNEL_EVENT_COLUMNS, rows.kernel_event_rows(evs, resolve, node))
    want = _stored(backend)
    backend.query("TRUNCATE TABLE spanlet.kernel_events")
    backend.insert("kernel_events", rows.KERNEL_RECORD_COLUMNS, rows.kernel_record_rows(evs, resolve, node))
    assert _stored(backend) == want
    assert len(want) == len(evs)


def test_the_python_rows_of_records_are_the_events_rows():
    """What a server backend (and the spool's reader) makes of the records."""
    evs = [_record(kind, bytes(range(7, 127)), n, n % 2 == 0) for n, kind in enumerate(KINDS * 2)]
    resolve = lambda cgroup: ("ns", f"pod-{cgroup}", "c")   # noqa: E731
    assert (rows.rows_from_kernel_records(rows.kernel_record_rows(evs, resolve, "node-1"))
            == rows.kernel_event_rows(evs, resolve, "node-1"))


@pytest.mark.parametrize("raw", [b"", bytes(40), bytes(events.GpuLaunch())[:-1], bytes(200)])
def test_a_record_of_the_wrong_size_is_refused(raw):
    if len(raw) >= 56:
        raw = bytearray(raw)
        raw[events.Header.kind.offset] = events.Kind.GPU_LAUNCH
    with pytest.raises(BackendError):
        encode([[bytes(raw), NOW, "", "", "", ""]])

