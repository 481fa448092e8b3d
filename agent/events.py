"""Decoder of ring-buffer records: the one Python definition of the structs in
bpf/spanlet.h, and the CLOCK_MONOTONIC → epoch conversion."""

from __future__ import annotations

import ctypes as C
import enum
import ipaddress
import struct
import time

from spanlet.modality import Modality, modality_name  # noqa: F401 (events.Modality)


class Kind(enum.IntEnum):
    GPU_LAUNCH = 1
    GPU_SYNC = 2
    SANDBOX = 3
    HTTP = 4
    FLOW = 5
    HTTP_BYTES = 6


class Api(enum.IntEnum):
    driver = 1
    runtime = 2
    graph = 3      # kernels run by replays of graphs the agent saw made


class Entry(enum.IntEnum):
    cuLaunchKernel = 1
    cuLaunchKernelEx = 2
    cudaLaunchKernel = 3
    cuStreamSynchronize = 4
    cudaStreamSynchronize = 5
    cudaDeviceSynchronize = 6
    cuLaunchKernel_ptsz = 7
    cuLaunchKernelEx_ptsz = 8
    cuLaunchCooperativeKernel = 9
    cuLaunchCooperativeKernel_ptsz = 10
    cuLaunch = 11
    cuLaunchGrid = 12
    cuLaunchGridAsync = 13
    cudaLaunchKernel_ptsz = 14
    cudaLaunchKernelExC = 15
    cudaLaunchKernelExC_ptsz = 16
    cudaLaunchCooperativeKernel = 17
    cudaLaunchCooperativeKernel_ptsz = 18
    cuGraphLaunch = 19
    cuGraphLaunch_ptsz = 20
    cuStreamSynchronize_ptsz = 21
    cuCtxSynchronize = 22
    cuEventSynchronize = 23
    cudaStreamSynchronize_ptsz = 24
    cudaEventSynchronize = 25
    cuCtxSynchronize_v2 = 26


class Rule(enum.IntEnum):
    unauthorized = 1
    write_on_readonly = 2
    exec = 3
    oversize = 4


class Action(enum.IntEnum):
    audit = 1
    kill = 2


class Proto(enum.IntEnum):
    unknown = 0
    http1 = 1
    http2 = 2
    websocket = 3
    rtp = 4
    tcp = 5
    udp = 6


class Direction(enum.IntEnum):
    ingress = 0
    egress = 1


class Header(C.Structure):
    _fields_ = [
        ("ts_ns", C.c_uint64),
        ("pid", C.c_uint32),
        ("tid", C.c_uint32),
        ("cgroup_id", C.c_uint64),
        ("trace_id", C.c_uint8 * 16),
        ("span_id", C.c_uint64),
        ("kind", C.c_uint16),
        ("modality", C.c_uint8),
        ("flags", C.c_uint8),
        ("_pad", C.c_uint32),
    ]


class SpanCtx(C.Structure):
    _fields_ = [
        ("trace_id", C.c_uint8 * 16),
        ("span_id", C.c_uint64),
        ("modality", C.c_uint8),
        ("_pad", C.c_uint8 * 7),
    ]


class SpanFactsKey(C.Structure):
    """Key of the span facts map: a span (trace id and span id) and the cgroup
    of the tasks that wrote the row."""
    _fields_ = [
        ("trace_id", C.c_uint8 * 16),
        ("span_id", C.c_uint64),
        ("cgroup_id", C.c_uint64),
    ]


class SpanFactsIndexKey(C.Structure):
    """Key of the span facts index: a span."""
    _fields_ = [
        ("trace_id", C.c_uint8 * 16),
        ("span_id", C.c_uint64),
    ]


class SpanFactsIndexVal(C.Structure):
    """The cgroups that made rows for one span, in order; n rows made (n > 4:
    only the first four listed)."""
    _fields_ = [
        ("cgroups", C.c_uint64 * 4),
        ("n", C.c_uint32),
        ("_pad", C.c_uint32),
    ]


class SpanFactsVal(C.Structure):
    """One span's kernel facts row (struct span_facts_val)."""
    _fields_ = [
        ("launches_driver", C.c_uint64),
        ("launches_runtime", C.c_uint64),
        ("launch_ns", C.c_uint64),
        ("sync_wait_ns", C.c_uint64),
        ("syncs", C.c_uint64),
        ("violations", C.c_uint64),
        ("graph_launches", C.c_uint64),
        ("graph_kernels", C.c_uint64),
        ("cpu_ns", C.c_uint64),
        ("runqueue_ns", C.c_uint64),
        ("blocked_ns", C.c_uint64),
        ("iowait_ns", C.c_uint64),
        ("switches", C.c_uint64),
        ("preemptions", C.c_uint64),
        ("memcpy_h2d_bytes", C.c_uint64),
        ("memcpy_d2h_bytes", C.c_uint64),
        ("memcpy_d2d_bytes", C.c_uint64),
        ("memcpy_other_bytes", C.c_uint64),
        ("memcpy_calls", C.c_uint64),
        ("memcpy_ns", C.c_uint64),
        ("alloc_bytes", C.c_uint64),
        ("cgroup_id", C.c_uint64),
        ("first_ns", C.c_uint64),
        ("pid", C.c_uint32),
        ("sampled_events", C.c_uint32),
    ]


class FlowKey(C.Structure):
    _fields_ = [
        ("saddr", C.c_uint8 * 16),
        ("daddr", C.c_uint8 * 16),
        ("sport", C.c_uint16),
        ("dport", C.c_uint16),
        ("l4proto", C.c_uint8),
        ("family", C.c_uint8),
        ("_pad", C.c_uint8 * 2),
    ]

    def addresses(self) -> tuple[str, str]:
        return _addr(self.family, self.saddr), _addr(self.family, self.daddr)

    def as_dict(self) -> dict:
        src, dst = self.addresses()
        return {"src": src, "dst": dst, "sport": self.sport, "dport": self.dport,
                "l4proto": self.l4proto}


def _addr(family: int, raw) -> str:
    data = bytes(raw)
    if family == 4:
        return str(ipaddress.IPv4Address(data[:4]))
    return str(ipaddress.IPv6Address(data))


class _Event(C.Structure):
    """Base of every record: decoded fields plus the epoch timestamp."""

    epoch_ns = 0

    @property
    def kind(self) -> Kind:
        return Kind(self.hdr.kind)

    def as_dict(self) -> dict:
        h = self.hdr
        out = {
            "kind": Kind(h.kind).name,
            "ts_ns": self.epoch_ns,
            "pid": h.pid,
            "tid": h.tid,
            "cgroup_id": h.cgroup_id,
            "trace_id": bytes(h.trace_id).hex(),
            "span_id": f"{h.span_id:016x}",
            "modality": modality_name(h.modality),
        }
        for name, _ in self._fields_[1:]:
            if name.startswith("_"):
                continue
            value = getattr(self, name)
            if isinstance(value, FlowKey):
                value = value.as_dict()
            elif isinstance(value, C.Array):
                value = list(value)
            out[name] = value
        return out


class GpuLaunch(_Event):
    _fields_ = [
        ("hdr", Header),
        ("func", C.c_uint64),
        ("stream", C.c_uint64),
        ("duration_ns", C.c_uint64),
        ("grid", C.c_uint32 * 3),
        ("block", C.c_uint32 * 3),
        ("shared_mem", C.c_uint32),
        ("api", C.c_uint8),
        ("entry", C.c_uint8),
        ("_pad", C.c_uint8 * 2),
    ]


class GpuSync(_Event):
    _fields_ = [
        ("hdr", Header),
        ("stream", C.c_uint64),
        ("duration_ns", C.c_uint64),
        ("api", C.c_uint8),
        ("entry", C.c_uint8),
        ("_pad", C.c_uint8 * 6),
    ]


class SandboxViolation(_Event):
    _fields_ = [
        ("hdr", Header),
        ("addr", C.c_uint64),
        ("len", C.c_uint64),
        ("pool_max_bytes", C.c_uint64),
        ("prot", C.c_uint32),
        ("flags", C.c_uint32),
        ("pool_id", C.c_uint32),
        ("fd", C.c_int32),
        ("rule", C.c_uint8),
        ("action", C.c_uint8),
        ("_pad", C.c_uint8 * 6),
    ]


class HttpRequest(_Event):
    _fields_ = [
        ("hdr", Header),
        ("flow", FlowKey),
        ("ifindex", C.c_uint32),
        ("path_hash", C.c_uint32),
        ("method", C.c_uint8),
        ("direction", C.c_uint8),
        ("trace_flags", C.c_uint8),
        ("_pad", C.c_uint8 * 5),
    ]

    HAS_TRACEPARENT = 1

    @property
    def has_traceparent(self) -> bool:
        return bool(self.hdr.flags & self.HAS_TRACEPARENT)


class HttpBytes(_Event):
    _fields_ = [
        ("hdr", Header),
        ("flow", FlowKey),
        ("bytes", C.c_uint64 * 2),
        ("req_dir", C.c_uint8),
        ("_pad", C.c_uint8 * 7),
    ]

    def rx_tx(self) -> tuple[int, int]:
        """(bytes in the request's direction, bytes in the other)."""
        d = self.req_dir & 1
        return self.bytes[d], self.bytes[1 - d]


class FlowSeen(_Event):
    _fields_ = [
        ("hdr", Header),
        ("flow", FlowKey),
        ("ifindex", C.c_uint32),
        ("proto_class", C.c_uint8),
        ("direction", C.c_uint8),
        ("_pad", C.c_uint8 * 2),
    ]


RECORDS: dict[int, type[_Event]] = {
    Kind.GPU_LAUNCH: GpuLaunch,
    Kind.GPU_SYNC: GpuSync,
    Kind.SANDBOX: SandboxViolation,
    Kind.HTTP: HttpRequest,
    Kind.FLOW: FlowSeen,
    Kind.HTTP_BYTES: HttpBytes,
}
_KIND_OFFSET = Header.kind.offset
_HEADER_SIZE = C.sizeof(Header)
_SIZES = {kind: C.sizeof(cls) for kind, cls in RECORDS.items()}


# What the C ring reader (spanlet._ring) needs to check and decode records:
# (header size, offset of the kind, struct of each kind by number, its size).
RECORD_LAYOUT = (_HEADER_SIZE, _KIND_OFFSET,
                 tuple(RECORDS.get(k) for k in range(max(RECORDS) + 1)),
                 tuple(_SIZES.get(k, 0) for k in range(max(RECORDS) + 1)))

_KIND = struct.Struct("<H")
_TS = struct.Struct("<Q")


class DecodeError(ValueError):
    pass


class MonotonicClock:
    """Converts CLOCK_MONOTONIC (bpf_ktime_get_ns) to epoch ns. The offset is
    re-read every `refresh_s` so that a stepped wall clock is followed."""

    def __init__(self, refresh_s: float = 1.0):
        self._refresh_ns = int(refresh_s * 1e9)
        self._next = 0
        self.offset_ns = 0
        self.refresh()

    def refresh(self) -> None:
        # Bracket the wall-clock read by two monotonic reads to halve the error.
        m0 = time.monotonic_ns()
        wall = time.time_ns()
        m1 = time.monotonic_ns()
        self.offset_ns = wall - (m0 + m1) // 2
        self._next = m1 + self._refresh_ns

    def state(self) -> tuple[int, int]:
        """(offset, until): to_epoch(ns) is ns + offset while ns <= until (what
        the C ring reader adds itself; past it, it calls to_epoch)."""
        if type(self) is not MonotonicClock:   # a subclass may convert otherwise
            return 0, -1
        return self.offset_ns, self._next

    def to_epoch(self, mono_ns: int) -> int:
        if mono_ns > self._next:
            self.refresh()
        return mono_ns + self.offset_ns


def decode_from(buf, offset: int, size: int, clock: MonotonicClock) -> _Event:
    """The record of `size` bytes at `offset` in `buf` → a copy of its struct,
    with epoch_ns set. This is the ring-buffer reader's hot path."""
    if size < _HEADER_SIZE:
        raise DecodeError(f"record of {size} bytes is shorter than the header")
    kind = _KIND.unpack_from(buf, offset + _KIND_OFFSET)[0]
    cls = RECORDS.get(kind)
    if cls is None:
        raise DecodeError(f"unknown record kind {kind}")
    if size < _SIZES[kind]:
        raise DecodeError(f"{cls.__name__} record of {size} bytes, expected {_SIZES[kind]}")
    ev = cls.from_buffer_copy(buf, offset)
    # ts_ns is the first field; reading it from the buffer skips a ctypes
    # attribute walk (a third of the decode time).
    ev.epoch_ns = clock.to_epoch(_TS.unpack_from(buf, offset)[0])
    return ev


def from_record(raw: bytes, epoch_ns: int) -> _Event:
    """A record's bytes whose epoch time is known already → its struct."""
    kind = _KIND.unpack_from(raw, _KIND_OFFSET)[0] if len(raw) >= _HEADER_SIZE else None
    cls = RECORDS.get(kind)
    if cls is None or len(raw) < _SIZES[kind]:
        raise DecodeError(f"record of {len(raw)} bytes of kind {kind}")
    ev = cls.from_buffer_copy(raw)
    ev.epoch_ns = epoch_ns
    return ev


def decode(raw: bytes, clock: MonotonicClock) -> _Event:
    """One record held in a bytes object → its struct."""
    return decode_from(raw, 0, len(raw), clock)
