"""Decoder: kinds, short or unknown records, monotonic → epoch conversion."""

import ctypes
import time

import pytest

from spanlet import events


def record(cls, **hdr):
    ev = cls()
    for k, v in hdr.items():
        setattr(ev.hdr, k, v)
    return bytes(ev)


def test_header_matches_the_c_layout():
    # bpf/spanlet.h: struct spanlet_hdr is 56 bytes, kind at offset 48.
    assert ctypes.sizeof(events.Header) == 56
    assert events.Header.kind.offset == 48
    assert ctypes.sizeof(events.FlowKey) == 40


def test_decode_gpu_launch():
    ev = events.GpuLaunch()
    ev.hdr.kind = events.Kind.GPU_LAUNCH
    ev.hdr.pid, ev.hdr.tid, ev.hdr.span_id = 10, 11, 0xABC
    ev.hdr.trace_id[:] = list(range(16))
    ev.grid[:] = [4, 2, 1]
    ev.api = events.Api.runtime
    clock = events.MonotonicClock()
    ev.hdr.ts_ns = time.monotonic_ns()
    out = events.decode(bytes(ev), clock)
    assert isinstance(out, events.GpuLaunch)
    assert list(out.grid) == [4, 2, 1]
    d = out.as_dict()
    assert d["kind"] == "GPU_LAUNCH" and d["pid"] == 10 and d["tid"] == 11
    assert d["trace_id"] == bytes(range(16)).hex()
    assert d["span_id"] == "0000000000000abc"
    assert abs(out.epoch_ns - time.time_ns()) < 50_000_000


def test_short_and_unknown_records_are_rejected():
    clock = events.MonotonicClock()
    with pytest.raises(events.DecodeError, match="shorter than the header"):
        events.decode(b"\0" * 10, clock)
    with pytest.raises(events.DecodeError, match="unknown record kind 99"):
        events.decode(record(events.GpuSync, kind=99), clock)
    with pytest.raises(events.DecodeError, match="GpuLaunch record of 56 bytes"):
        events.decode(bytes(events.Header(kind=events.Kind.GPU_LAUNCH)), clock)


def test_flow_key_addresses():
    k = events.FlowKey(family=4, sport=1234, dport=80, l4proto=6)
    k.saddr[:4] = [169, 254, 77, 1]
    k.daddr[:4] = [169, 254, 77, 2]
    assert k.as_dict() == {"src": "169.254.77.1", "dst": "169.254.77.2",
                           "sport": 1234, "dport": 80, "l4proto": 6}


def test_clock_offset_follows_wall_clock():
    clock = events.MonotonicClock(refresh_s=0)
    mono = time.monotonic_ns()
    assert abs(clock.to_epoch(mono) - time.time_ns()) < 50_000_000
