"""Request totals (DESIGN.md "Request anatomy"): a server span gets the kernel
facts of its in-process span subtree summed, as `kernel.request.*` attributes,
so that one number per request says where its time went.

What is summed: a span's own scheduler facts (`kernel.sched.cpu_ns`,
`runqueue_ns`, `blocked_ns`), its batched steps' shares of them
(`kernel.batch.sched.*`: the request's part of engine steps that ran in other
spans, often in another process, so they are its CPU in the engine and never
counted twice) and the bytes it copied host to device
(`kernel.gpu.memcpy_h2d_bytes`, and its steps' share of theirs), over the
server span and its descendants by parent_span_id chains, among the spans
of the same trace and the same process (the sender's pod and the resource
as received) that reached the agent before the server span or in the same
export request, in any order within it.

Children end, and are exported, before their parent. A child span exported
after its parent (a streaming response's background work, a span that ended
late, facts the join sends later as a late record) is NOT in the parent's
totals: its subtree waits for a parent that has gone by, and is dropped
when its trace is evicted (counted in stats.dropped, by reason).

Where a subtree stops: a server span whose flags say its parent is in this
process (nested server spans, e.g. two layers of instrumentation) gets its
own subtree's totals and passes them on to its parent's request, as its
duration is inside its parent's; a server span whose parent is remote or
not said to be local is a request of its own (spanlet.metrics.serving's
reading of a request), and its totals go no further, so the requests' totals
of a process add up without counting a span twice. A span whose flags say
its parent is remote passes nothing on.

Which attributes: the three scheduler totals together when any of them is
non-zero (a zero among them is a measured zero, e.g. no wait in the run
queue; none at all means the scheduler program did not see the request),
`kernel.request.gpu.memcpy_h2d_bytes` when non-zero; all as int
attributes (ns, bytes), added once (a server span that carries any
`kernel.request.*` already keeps what it has).

Cost: the facts are read from the bytes of each resource (the join's, or
serialized once here), each span's own attributes walked in C
(spanlet._wire.request_facts), never attribute by attribute from the
protobuf objects (~1 µs each), and the sums are put on as bytes (one
MergeFromString, the bytes handed on patched): bench/request_totals_bench.py
measures it per span beside serializing the span. A
resource without any fact key and without waiting subtrees of its process
costs two byte searches. What is remembered between requests is only each
waiting subtree's sum, by (process, trace) and parent span id, bounded in
traces, subtrees and age (oldest first), and a subtree is forgotten once
its parent has taken it."""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet import _wire

REQUEST_CPU_NS = "kernel.request.cpu_ns"
REQUEST_RUNQUEUE_NS = "kernel.request.runqueue_ns"
REQUEST_BLOCKED_NS = "kernel.request.blocked_ns"
REQUEST_MEMCPY_H2D_BYTES = "kernel.request.gpu.memcpy_h2d_bytes"
# (request attribute, the span attributes summed into it), the scheduler's first
TOTALS = (
    (REQUEST_CPU_NS, ("kernel.sched.cpu_ns", "kernel.batch.sched.cpu_ns")),
    (REQUEST_RUNQUEUE_NS, ("kernel.sched.runqueue_ns", "kernel.batch.sched.runqueue_ns")),
    (REQUEST_BLOCKED_NS, ("kernel.sched.blocked_ns", "kernel.batch.sched.blocked_ns")),
    (REQUEST_MEMCPY_H2D_BYTES, ("kernel.gpu.memcpy_h2d_bytes", "kernel.batch.gpu.memcpy_h2d_bytes")),
)
SCHED_TOTALS = 3              # the first three of TOTALS go on a span together

# Bounds of what waits for its parent: the defaults of the
# join.request_totals_* settings (agent/config.py).
MAX_TRACES = 16_384           # (process, trace)s with subtrees waiting
MAX_SUBTREES = 32_768         # waiting subtrees in all (~250 bytes each)
MAX_SUBTREES_PER_TRACE = 256  # one trace cannot push the others out
TTL_S = 600.0                 # a trace's subtrees wait this long after its last span

DROP_REASONS = ("age", "traces", "subtrees", "trace_full")

_SERVER = trace_pb2.Span.SPAN_KIND_SERVER
_HAS_IS_REMOTE = trace_pb2.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK      # 0x100
_IS_REMOTE = trace_pb2.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK              # 0x200

_PREFIX = b"kernel."
# (key after "kernel.", index in TOTALS) of each span attribute summed, for
# spanlet._wire.request_facts (native/spanlet_wire.c), which walks a span's
# own attributes in its bytes (events and links are not read).
_KEYS = tuple((key.encode()[len(_PREFIX):], i) for i, (_, keys) in enumerate(TOTALS) for key in keys)
# Every key of _KEYS holds one of these: a resource without any has no facts.
_MARKS = (b"sched.", b"memcpy_h2d")
_INT64_MAX = (1 << 63) - 1
_SPANS = 2                  # ResourceSpans.scope_spans and ScopeSpans.spans: both field 2
_RESOURCE = 1               # ResourceSpans.resource


def _read_varint(b: bytes, p: int) -> tuple[int, int]:
    """(value, position after it) of the varint at p; IndexError past the end."""
    x = b[p]
    if x < 0x80:
        return x, p + 1
    x &= 0x7F
    shift = 7
    while True:
        p += 1
        c = b[p]
        x |= (c & 0x7F) << shift
        if c < 0x80:
            return x, p + 1
        shift += 7


def _fields(b: bytes, p: int, end: int) -> list[tuple[int, int, int, int]]:
    """(field number, its length's position, start, end) of each
    length-delimited field in b[p:end]; other wire types are skipped;
    ValueError or IndexError for bytes not well-formed."""
    out = []
    while p < end:
        tag, p = _read_varint(b, p)
        kind = tag & 7
        if kind == 2:
            n, start = _read_varint(b, p)
            out.append((tag >> 3, p, start, start + n))
            p = start + n
        elif kind == 0:
            _, p = _read_varint(b, p)
        elif kind == 1 or kind == 5:
            p += 8 if kind == 1 else 4
        else:
            raise ValueError(f"wire type {kind}")
    if p != end:
        raise ValueError("field past its message")
    return out


@dataclass
class _Layout:
    """Where a serialized ResourceSpans' parts are: its resource's bytes and,
    per ScopeSpans, (its length's position, start, end, [its spans' the same])."""
    resource: bytes = b""
    scopes: list = field(default_factory=list)


def _layout(blob: bytes) -> _Layout | None:
    """None for bytes not well-formed."""
    out = _Layout()
    try:
        for num, at, start, end in _fields(blob, 0, len(blob)):
            if num == _RESOURCE:
                out.resource = blob[start:end]
            elif num == _SPANS:
                spans = [(a, s, e) for n, a, s, e in _fields(blob, start, end) if n == _SPANS]
                out.scopes.append((at, start, end, spans))
    except (IndexError, ValueError):
        return None
    return out


class _Group:
    """The spans of one (process, trace) in this request, by span id: the
    parent each passes its subtree sum on to in this process (None: no
    parent, a parent said to be remote, or a request: module doc), their
    own facts, and the server spans with their sums so far."""
    __slots__ = ("up", "own", "servers")

    def __init__(self):
        self.up: dict[bytes, bytes | None] = {}
        self.own: dict[bytes, list] = {}
        # span id -> [span, (resource, scope, span index), carries totals already, sums]
        self.servers: dict[bytes, list] = {}

    def merge(self, other: "_Group") -> None:
        self.up.update(other.up)
        self.own.update(other.own)
        self.servers.update(other.servers)


class _Waiting:
    """A (process, trace)'s subtree sums waiting for their parent, by parent span id."""
    __slots__ = ("touched", "subtrees")

    def __init__(self, now: float):
        self.touched = now
        self.subtrees: dict[bytes, list] = {}


def _add(into: dict, key, v: list) -> None:
    old = into.get(key)
    into[key] = list(v) if old is None else [a + b for a, b in zip(old, v)]


def _varint_bytes(x: int) -> bytes:
    out = bytearray()
    while x >= 0x80:
        out.append(x & 0x7F | 0x80)
        x >>= 7
    out.append(x)
    return bytes(out)


# A Span.attributes entry of each request total up to its varint, by the
# varint's length: KeyValue{key (1), value (2): AnyValue{int_value (3)}}, its
# lengths one byte each (the keys are short).
_HEADS = tuple(tuple(b"\x4a" + bytes((len(k) + 5 + n,)) + b"\x0a" + bytes((len(k),)) + k
                     + b"\x12" + bytes((1 + n,)) + b"\x18" for n in range(11))
               for k in (attr.encode() for attr, _ in TOTALS))


def _attributes_of(total: list) -> bytes:
    """The kernel.request.* attributes of a server span's sums (module doc), as bytes."""
    ints = [min(round(x), _INT64_MAX) for x in total]
    sched = any(ints[:SCHED_TOTALS])
    out = []
    for i, n in enumerate(ints):
        if n or (sched and i < SCHED_TOTALS):
            v = _varint_bytes(n)
            out.append(_HEADS[i][len(v)] + v)
    return b"".join(out)


def _patched(blob: bytes, layout: _Layout, added: dict[tuple[int, int], bytes]) -> bytes:
    """The ResourceSpans bytes with `added` appended to those spans (their
    lengths and their scopes' rewritten), as span.MergeFromString(added) leaves
    the proto."""
    by_scope: dict[int, list[int]] = {}
    for si, sj in sorted(added):
        by_scope.setdefault(si, []).append(sj)
    out, pos = [], 0
    for si, edited in by_scope.items():
        scope_at, scope_start, scope_end, spans = layout.scopes[si]
        body, ipos = [], scope_start
        for sj in edited:
            at, start, end = spans[sj]
            extra = added[(si, sj)]
            body += [blob[ipos:at], _varint_bytes(end - start + len(extra)), blob[start:end], extra]
            ipos = end
        body.append(blob[ipos:scope_end])
        inner = b"".join(body)
        out += [blob[pos:scope_at], _varint_bytes(len(inner)), inner]
        pos = scope_end
    out.append(blob[pos:])
    return b"".join(out)


@dataclass
class RequestTotalsStats:
    summed: int = 0                                   # server spans given totals
    dropped: Counter = field(default_factory=Counter)  # waiting subtrees dropped, by DROP_REASONS

    def as_dict(self) -> dict:
        return {"summed": self.summed, **{f"dropped_{r}": self.dropped[r] for r in DROP_REASONS}}


class RequestTotals:
    """Puts kernel.request.* on the server spans of each export request
    (apply), remembering the subtrees that wait for their parent. Thread-safe:
    receiver threads call apply at once."""

    def __init__(self, max_traces: int = MAX_TRACES, max_subtrees: int = MAX_SUBTREES,
                 max_subtrees_per_trace: int = MAX_SUBTREES_PER_TRACE, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.max_traces, self.max_subtrees = max_traces, max_subtrees
        self.max_subtrees_per_trace, self.ttl_s = max_subtrees_per_trace, ttl_s
        self.clock = clock
        self.stats = RequestTotalsStats()
        self._lock = threading.Lock()
        # (process, trace id) -> its waiting subtrees, least recently touched first
        self._waiting: OrderedDict[tuple[int, bytes], _Waiting] = OrderedDict()
        self._subtrees = 0
        self._processes: Counter = Counter()          # process -> its traces in _waiting

    def waiting(self) -> tuple[int, int]:
        """(traces, subtrees) waiting for their parent now."""
        with self._lock:
            return len(self._waiting), self._subtrees

    def apply(self, resource_spans: Sequence[trace_pb2.ResourceSpans], blobs: list,
              origin=None) -> None:
        """Sum the spans of one export request into their server spans.
        `blobs`: per ResourceSpans its spans' bytes as they are (the join's),
        or None; on return each holds those bytes with what was added here
        (serialized here where it was None). `origin`: the sender's pod (its
        cgroup ids, None unknown), part of what a process is."""
        groups: dict[tuple[int, bytes], _Group] = {}
        layouts: dict[int, _Layout] = {}
        for i, rs in enumerate(resource_spans):
            if blobs[i] is None:
                blobs[i] = rs.SerializeToString()
            layout = self._group(i, rs, blobs[i], origin, groups)
            if layout is not None:
                layouts[i] = layout
        if not groups:
            return
        with self._lock:
            now = self.clock()
            for key, group in groups.items():
                self._sum_locked(key, group, now)
            self._evict_locked(now)
        self._put(groups, blobs, layouts)

    def _group(self, i: int, rs: trace_pb2.ResourceSpans, blob: bytes, origin,
               groups: dict[tuple[int, bytes], _Group]) -> _Layout | None:
        """The resource's spans into their (process, trace) groups, if any of
        them can add to a sum or take one; its layout then."""
        hot = _MARKS[0] in blob or _MARKS[1] in blob
        if not hot and not self._waiting:
            return None
        layout = _layout(blob)
        if layout is None or len(layout.scopes) != len(rs.scope_spans):
            return None
        process = hash((origin, layout.resource))
        if not hot and not self._processes.get(process):
            return None
        request_facts = _wire.request_facts
        by_trace: dict[bytes, _Group] = {}
        for si, ss in enumerate(rs.scope_spans):
            where = layout.scopes[si][3]
            spans = ss.spans
            if len(spans) != len(where):
                return None
            for sj, span in enumerate(spans):
                trace = span.trace_id
                group = by_trace.get(trace)
                if group is None:
                    group = by_trace[trace] = _Group()
                span_id, parent, server = span.span_id, span.parent_span_id, span.kind == _SERVER
                if parent:
                    flags = span.flags
                    if flags & _IS_REMOTE or server and not flags & _HAS_IS_REMOTE:
                        parent = b""
                group.up[span_id] = parent or None
                has_totals = False
                if hot and (parent or server):         # else its sum would go nowhere
                    _, start, end = where[sj]
                    own, has_totals = request_facts(blob, start, end, _KEYS)
                    if own is not None:
                        group.own[span_id] = own
                if server:
                    group.servers[span_id] = [span, (i, si, sj), has_totals, None]
        for trace, group in by_trace.items():
            key = (process, trace)
            if key in groups:            # another resource of the same process
                groups[key].merge(group)
            else:
                groups[key] = group
        return layout

    def _sum_locked(self, key: tuple[int, bytes], group: _Group, now: float) -> None:
        """Each span's own facts and waiting subtrees added up its chain of
        parents in this request: into every server span on the way, and into
        the waiting sum of the first parent not in it."""
        up, own, servers = group.up, group.own, group.servers
        waiting = self._waiting.get(key)
        if waiting is not None:
            for span_id in up:
                sub = waiting.subtrees.pop(span_id, None)
                if sub is not None:
                    self._subtrees -= 1
                    _add(own, span_id, sub)
        passed: dict[bytes, list] = {}
        for span_id, v in own.items():
            at, steps = span_id, 0
            while True:
                server = servers.get(at)
                if server is not None:
                    server[3] = list(v) if server[3] is None else [a + b for a, b in zip(server[3], v)]
                parent = up[at]
                if parent is None:
                    break
                if parent not in up:
                    _add(passed, parent, v)
                    break
                steps += 1
                if steps > len(up):              # a loop of parents: not a tree
                    break
                at = parent
        if passed:
            self._wait_locked(key, passed, waiting, now)
        elif waiting is not None and not waiting.subtrees:
            self._forget_locked(key)

    def _wait_locked(self, key, passed: dict[bytes, list], waiting: _Waiting | None, now: float) -> None:
        if waiting is None:
            waiting = self._waiting[key] = _Waiting(now)
            self._processes[key[0]] += 1
        else:
            waiting.touched = now
            self._waiting.move_to_end(key)
        subs = waiting.subtrees
        for parent, v in passed.items():
            if parent in subs:
                _add(subs, parent, v)
            elif len(subs) >= self.max_subtrees_per_trace:
                self.stats.dropped["trace_full"] += 1
            else:
                subs[parent] = v
                self._subtrees += 1
        if not subs:
            self._forget_locked(key)

    def _forget_locked(self, key) -> int:
        """Drop a (process, trace)'s waiting subtrees; returns how many."""
        waiting = self._waiting.pop(key)
        n = len(waiting.subtrees)
        self._subtrees -= n
        left = self._processes[key[0]] - 1
        if left:
            self._processes[key[0]] = left
        else:
            del self._processes[key[0]]
        return n

    def _evict_locked(self, now: float) -> None:
        deadline = now - self.ttl_s
        dropped = self.stats.dropped
        while self._waiting:
            key, oldest = next(iter(self._waiting.items()))
            if oldest.touched < deadline:
                reason = "age"
            elif len(self._waiting) > self.max_traces:
                reason = "traces"
            elif self._subtrees > self.max_subtrees:
                reason = "subtrees"
            else:
                return
            dropped[reason] += self._forget_locked(key)

    def _put(self, groups: dict[tuple[int, bytes], _Group], blobs: list,
             layouts: dict[int, _Layout]) -> None:
        """The sums onto their server spans, in the protos and in `blobs`."""
        added: dict[int, dict[tuple[int, int], bytes]] = {}
        for group in groups.values():
            for span, (i, si, sj), has_totals, total in group.servers.values():
                extra = _attributes_of(total) if total is not None and not has_totals else b""
                if extra:
                    span.MergeFromString(extra)
                    added.setdefault(i, {})[(si, sj)] = extra
        for i, edits in added.items():
            blobs[i] = _patched(blobs[i], layouts[i], edits)
        if added:
            with self._lock:
                self.stats.summed += sum(len(edits) for edits in added.values())
