"""The span join: when an OTLP span arrives, its kernel facts are taken from the
kernel's span facts map (one row per trace id + span id, aggregated there at
the moment of each event) and put on the span as `kernel.*` attributes; the
sampled individual events that came for it become span events. A periodic
sweep sends facts that came after their span was passed on (within join.ttl_s
of it) as their own record (a child span with the same trace id), and deletes
rows whose span never came.

Batched steps (DESIGN.md): a span with links is a step; it gets its own facts
like any span, and each span it links to (a request) gets its weighted share of
them as `kernel.batch.*` attributes. Once a step has been seen, request (SERVER)
spans are held back (join(..., held=[]), released by release()) at most
join.batch_wait_s for their steps; shares waiting for their request are kept in
a table bounded in count and age; a share for a request already passed on goes
out as a late record of the request's trace.

Facts stay in their pod: the kernel keeps one row per span and writing
cgroup, and join() is given the sender's origin (the cgroup ids of its pod,
established from the connection; None when unknown). A span gets only the
rows of cgroups in its origin; any other cgroup's row for the same ids is
deleted and counted (foreign, reason other_pod). With the sender unknown, rows
from more than one cgroup are a conflict: the span gets the row of the cgroup
that did most for it (launches + syncs + violations + graph launches; the
cgroup that made its row first on a tie), the others are counted (reason
conflict). The same holds for late rows: the origin is kept with the span
passed on; late rows of an unknown sender are picked among those of one sweep.
The batch waiting room is bounded per sender too (join.batch_max_*_per_pod)."""

from __future__ import annotations

import itertools
import logging
import re
import struct
import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from google.protobuf.internal.encoder import _VarintBytes as _varint
from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet import events
from spanlet.config import JoinConfig

log = logging.getLogger(__name__)

LATE_SPAN_NAME = "spanlet.kernel.late_events"

# The kernel facts a span gets, as (attribute, Facts field); only non-zero ones.
# every facts attribute's key starts so (SpanJoin.join searches a resource's bytes for it)
_FACT_PREFIX = b"kernel."
FACT_ATTRIBUTES = (
    ("kernel.gpu.launches", "launches"),
    ("kernel.gpu.graph_launches", "graph_launches"),
    ("kernel.gpu.graph_kernels", "graph_kernels"),
    ("kernel.gpu.launch_ns", "launch_ns"),
    ("kernel.gpu.sync_wait_ns", "sync_wait_ns"),
    ("kernel.gpu.syncs", "syncs"),
    ("kernel.net.rx_bytes", "rx_bytes"),
    ("kernel.net.tx_bytes", "tx_bytes"),
    ("kernel.sandbox.violations", "violations"),
    ("kernel.sched.cpu_ns", "cpu_ns"),
    ("kernel.sched.runqueue_ns", "runqueue_ns"),
    ("kernel.sched.blocked_ns", "blocked_ns"),
    ("kernel.sched.iowait_ns", "iowait_ns"),
    ("kernel.sched.switches", "switches"),
    ("kernel.sched.preemptions", "preemptions"),
    ("kernel.gpu.memcpy_h2d_bytes", "memcpy_h2d_bytes"),
    ("kernel.gpu.memcpy_d2h_bytes", "memcpy_d2h_bytes"),
    ("kernel.gpu.memcpy_d2d_bytes", "memcpy_d2d_bytes"),
    ("kernel.gpu.memcpy_other_bytes", "memcpy_other_bytes"),
    ("kernel.gpu.memcpy_calls", "memcpy_calls"),
    ("kernel.gpu.memcpy_ns", "memcpy_ns"),
    ("kernel.gpu.alloc_bytes", "alloc_bytes"),
)
# Request anatomy, in FACT_ATTRIBUTES' order: the scheduler's facts of a row,
# then its GPU memory traffic.
SCHED_FIELDS = ("cpu_ns", "runqueue_ns", "blocked_ns", "iowait_ns", "switches", "preemptions")
MEMORY_FIELDS = ("memcpy_h2d_bytes", "memcpy_d2h_bytes", "memcpy_d2d_bytes", "memcpy_other_bytes",
                 "memcpy_calls", "memcpy_ns", "alloc_bytes")
ANATOMY_FIELDS = (*SCHED_FIELDS, *MEMORY_FIELDS)
_ANATOMY_ATTRIBUTES = tuple(attr for attr, f in FACT_ATTRIBUTES if f in ANATOMY_FIELDS)
_NO_ANATOMY = (0,) * len(ANATOMY_FIELDS)
# A step's facts shared among its requests, as (request attribute, row field).
BATCH_SHARES = (
    ("kernel.batch.gpu.launches", "launches"),
    ("kernel.batch.gpu.graph_launches", "graph_launches"),
    ("kernel.batch.gpu.graph_kernels", "graph_kernels"),
    ("kernel.batch.gpu.sync_wait_ns", "sync_wait_ns"),
    ("kernel.batch.sched.cpu_ns", "cpu_ns"),
    ("kernel.batch.sched.runqueue_ns", "runqueue_ns"),
    ("kernel.batch.sched.blocked_ns", "blocked_ns"),
    ("kernel.batch.sched.iowait_ns", "iowait_ns"),
    ("kernel.batch.gpu.memcpy_h2d_bytes", "memcpy_h2d_bytes"),
    ("kernel.batch.gpu.memcpy_d2h_bytes", "memcpy_d2h_bytes"),
    ("kernel.batch.gpu.memcpy_d2d_bytes", "memcpy_d2d_bytes"),
    ("kernel.batch.gpu.memcpy_other_bytes", "memcpy_other_bytes"),
)
BATCH_STEPS = "kernel.batch.steps"
WEIGHT_KEY = "spanlet.weight"
# on a step span: its links' weights in one array, in link order (instead of
# spanlet.weight on each link; the OTel SDK copies a link's attributes per span)
WEIGHTS_KEY = "spanlet.batch.weights"
# on a step span: the tensor-parallel rank that made it, when not 0 (its facts
# are shared, the step is counted by rank 0's span)
SHARD_KEY = "spanlet.batch.shard"
_SERVER = trace_pb2.Span.SPAN_KIND_SERVER
# A Span.links entry on the wire: field 13 (0x6a), its length, then the link's
# trace_id (field 1, 16 bytes: 0x0a 0x10). The bytes searched are the agent's
# own serialization (fields in number order, whatever the sender wrote); a
# link without a 16-byte trace id gets no share anyway. A chance match in
# ids only costs a look at span.links.
_LINK_WIRE = re.compile(rb"\x6a[\x80-\xff]{0,4}[\x00-\x7f]\x0a\x10", re.S)
_KERNEL_FIELDS = ("launches", "launch_ns", "sync_wait_ns", "syncs", "graph_launches",
                  "graph_kernels", "violations", *ANATOMY_FIELDS)


class KernelRow(Protocol):
    """One row of the kernel's span facts map (spanlet.probes.span_facts.KernelFacts)."""
    trace_id: bytes
    span_id: int
    cgroup_id: int
    first_ns: int           # epoch ns
    launches: int
    launch_ns: int
    sync_wait_ns: int
    syncs: int
    violations: int
    graph_launches: int
    graph_kernels: int
    cpu_ns: int
    runqueue_ns: int
    blocked_ns: int
    iowait_ns: int
    switches: int
    preemptions: int
    memcpy_h2d_bytes: int
    memcpy_d2h_bytes: int
    memcpy_d2d_bytes: int
    memcpy_other_bytes: int
    memcpy_calls: int
    memcpy_ns: int
    alloc_bytes: int


class FactsReader(Protocol):
    """The kernel's span facts map (spanlet.probes.span_facts.SpanFacts)."""

    # every cgroup's row of the span, taken, in the order the kernel made them
    def take_rows(self, trace_id: bytes, span_id: int, origin=None) -> list[KernelRow]: ...
    def take_row(self, trace_id: bytes, span_id: int, cgroup_id: int) -> KernelRow | None: ...
    def join_resource(self, blob: bytes, origin=None): ...  # the common case of a resource, or None
    # (trace id, span id, cgroup id, first epoch ns)
    def ages(self) -> list[tuple[bytes, int, int, int]]: ...
    def delete(self, trace_id: bytes, span_id: int, cgroup_id: int) -> bool: ...
    def stats(self): ...


Origin = "frozenset[int] | None"    # the sender's cgroup ids, None when unknown
FOREIGN_REASONS = ("other_pod", "conflict")
# the join's per-cgroup table of foreign rows (cgroups past it counted in total only)
FOREIGN_CGROUPS_MAX = 4096


def _score(row: KernelRow) -> int:
    return row.launches + row.syncs + row.violations + row.graph_launches


def pick_rows(rows: list, origin) -> tuple[list, list[tuple[int, str]]]:
    """The rows a span gets and (cgroup, reason) of those it does not: with
    an origin, the rows of its cgroups (others: other_pod); without, all of
    one cgroup's, else the row with most launches + syncs + violations +
    graph launches, the first made on a tie (others: conflict). The C join
    (native/spanlet_wire.c) picks the same."""
    if origin is None:
        if len(rows) <= 1:
            return rows, []
        best = max(rows, key=_score)    # the first of the highest
        return [best], [(r.cgroup_id, "conflict") for r in rows if r is not best]
    kept = [r for r in rows if r.cgroup_id in origin]
    if len(kept) == len(rows):
        return rows, []
    return kept, [(r.cgroup_id, "other_pod") for r in rows if r.cgroup_id not in origin]


def _merged(rows: list) -> KernelRow:
    """Rows of the sender's cgroups as one (counts summed, the first's ids)."""
    if len(rows) == 1:
        return rows[0]
    first = rows[0]
    m = Facts(first.trace_id, first.first_ns, first.cgroup_id)
    for r in rows:
        m.add_row(r)
    return m


@dataclass
class Facts:
    """What the kernel did for one span, as it is put on the span."""

    trace_id: bytes
    first_ns: int
    cgroup_id: int = 0                               # of the first event
    launches: int = 0
    launch_ns: int = 0
    sync_wait_ns: int = 0
    syncs: int = 0
    graph_launches: int = 0
    graph_kernels: int = 0
    rx_bytes: int = 0
    tx_bytes: int = 0
    violations: int = 0
    cpu_ns: int = 0                                  # SCHED_FIELDS: where the threads' time went
    runqueue_ns: int = 0
    blocked_ns: int = 0
    iowait_ns: int = 0
    switches: int = 0
    preemptions: int = 0
    memcpy_h2d_bytes: int = 0                        # MEMORY_FIELDS: GPU copies and allocations
    memcpy_d2h_bytes: int = 0
    memcpy_d2d_bytes: int = 0
    memcpy_other_bytes: int = 0
    memcpy_calls: int = 0
    memcpy_ns: int = 0
    alloc_bytes: int = 0
    samples: list = field(default_factory=list)      # sampled individual events, capped
    samples_capped: int = 0

    def add_row(self, row: KernelRow) -> None:
        """Fold in a span facts row (counts summed; cgroup of the first row).
        Field by field (the _KERNEL_FIELDS): a getattr/setattr loop costs
        several times as much, once per span."""
        self.launches += row.launches
        self.launch_ns += row.launch_ns
        self.sync_wait_ns += row.sync_wait_ns
        self.syncs += row.syncs
        self.graph_launches += row.graph_launches
        self.graph_kernels += row.graph_kernels
        self.violations += row.violations
        self.cpu_ns += row.cpu_ns
        self.runqueue_ns += row.runqueue_ns
        self.blocked_ns += row.blocked_ns
        self.iowait_ns += row.iowait_ns
        self.switches += row.switches
        self.preemptions += row.preemptions
        self.memcpy_h2d_bytes += row.memcpy_h2d_bytes
        self.memcpy_d2h_bytes += row.memcpy_d2h_bytes
        self.memcpy_d2d_bytes += row.memcpy_d2d_bytes
        self.memcpy_other_bytes += row.memcpy_other_bytes
        self.memcpy_calls += row.memcpy_calls
        self.memcpy_ns += row.memcpy_ns
        self.alloc_bytes += row.alloc_bytes
        if not self.cgroup_id:
            self.cgroup_id = row.cgroup_id

    def add_sample(self, ev: events._Event, cap: int) -> None:
        if len(self.samples) < cap:
            self.samples.append(ev)
        else:
            self.samples_capped += 1


@dataclass
class JoinStats:
    spans_in: int = 0
    spans_joined: int = 0         # got kernel facts, sampled events or wire bytes
    rows_taken: int = 0           # span facts rows taken by their span
    rows_late: int = 0            # rows made for a span already passed on (late records)
    rows_expired: int = 0         # rows whose span never came within ttl_s, deleted
    late_records: int = 0         # late records sent (one per span and sweep)
    events_in: int = 0            # sampled events that carried a span id
    events_joined: int = 0        # put on their span
    events_evicted: int = 0       # not: their span never came, came first, or the buffer was full
    span_events_capped: int = 0
    batch_steps: int = 0          # step spans (spans with links) joined
    batch_links: int = 0          # their links read (one share each)
    batch_links_dropped: int = 0  # not: past join.batch_max_links, or not a span's ids
    batch_held: int = 0           # request spans held back for their steps
    batch_hold_full: int = 0      # not held: join.batch_max_held_spans were
    batch_requests: int = 0       # request spans sent with their shares on them
    batch_late: int = 0           # request shares sent as late records (request went first)
    batch_expired: int = 0        # request shares whose request never came (age or bound)
    batch_pod_dropped: int = 0    # of those, dropped by their sender's join.batch_max_pending_per_pod
    batch_pod_hold_full: int = 0  # not held: their sender's join.batch_max_held_per_pod were
    foreign_other_pod: int = 0    # rows of another pod's cgroup for a span's ids, not added
    foreign_conflict: int = 0     # rows not added: sender unknown, another cgroup picked
    foreign_cgroups_overflow: int = 0  # foreign rows of cgroups past the per-cgroup table

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class _Shares:
    """A request's shares of its steps so far; owner: the sender (pod) whose
    step made it wait, or whose request is held (the key of _owner)."""
    __slots__ = ("born", "first_ns", "steps", "values", "owner")

    def __init__(self, born: float, first_ns: int, owner: int = 0):
        self.born, self.first_ns, self.steps, self.owner = born, first_ns, 0, owner
        self.values = [0.0] * len(BATCH_SHARES)


def _owner(origin) -> int:
    """A sender's key in the batch waiting room: its least cgroup id, 0 unknown."""
    return min(origin) if origin else 0


def _kv_prefix(key: str, value_len: int) -> bytes:
    """The wire bytes of a Span.attributes entry (field 9) up to its AnyValue's
    value: KeyValue{key (1), value (2): AnyValue of value_len bytes}."""
    k = key.encode()
    inner = b"\x0a" + _varint(len(k)) + k + b"\x12" + _varint(value_len)
    return b"\x4a" + _varint(len(inner) + value_len) + inner


# AnyValue double_value (field 4, fixed64): tag 0x21 and 8 bytes
_SHARE_PREFIXES = tuple(_kv_prefix(attr, 9) + b"\x21" for attr, _ in BATCH_SHARES)
_DOUBLES = struct.Struct("<" + "d" * len(BATCH_SHARES))
_STEPS_WIRE = _kv_prefix(BATCH_STEPS, 2) + b"\x18"     # AnyValue int_value (field 3), < 128


def put_shares(span: trace_pb2.Span, shares: _Shares) -> None:
    """The kernel.batch.* attributes of a request span: one merge of their wire
    bytes (adding them one by one through the proto API costs ~9 µs a span)."""
    n = shares.steps
    steps = _STEPS_WIRE + bytes((n,)) if n < 0x80 else \
        _kv_prefix(BATCH_STEPS, 1 + len(_varint(n))) + b"\x18" + _varint(n)
    packed = _DOUBLES.pack(*shares.values)
    span.MergeFromString(steps + b"".join(
        [p + packed[8 * i:8 * i + 8] for i, p in enumerate(_SHARE_PREFIXES)]))


def _step_attributes(span: trace_pb2.Span) -> tuple[bool, list | None]:
    """(whether a step span is another rank's part of a step: spanlet.batch.shard
    > 0; its links' weights in one array, spanlet.batch.weights, if it has one)."""
    shard, weights = False, None
    for kv in span.attributes:
        if kv.key == SHARD_KEY:
            shard = kv.value.int_value > 0
        elif kv.key == WEIGHTS_KEY and kv.value.HasField("array_value"):
            weights = [_number(v) for v in kv.value.array_value.values]
    return shard, weights


def _number(v) -> float:
    """An AnyValue as a weight: int or double, finite, >= 0, else 1."""
    w = v.double_value if v.HasField("double_value") else \
        float(v.int_value) if v.HasField("int_value") else 1.0
    return w if 0.0 <= w < float("inf") else 1.0


def _weight(link: trace_pb2.Span.Link) -> float:
    """A link's spanlet.weight (int or double, finite, >= 0), else 1."""
    if not link.attributes:
        return 1.0
    for kv in link.attributes:
        if kv.key == WEIGHT_KEY:
            return _number(kv.value)
    return 1.0


def _add_event_attributes(attrs, ev: events._Event) -> None:
    kind = ev.hdr.kind
    attrs.add(key="tid").value.int_value = ev.hdr.tid
    if kind == events.Kind.GPU_LAUNCH or kind == events.Kind.GPU_SYNC:
        attrs.add(key="entry").value.string_value = _ENTRY_NAMES.get(ev.entry, "unknown")
        attrs.add(key="duration_ns").value.int_value = ev.duration_ns
        if kind == events.Kind.GPU_LAUNCH:
            g, b = ev.grid, ev.block
            attrs.add(key="grid").value.string_value = f"{g[0]}x{g[1]}x{g[2]}"
            attrs.add(key="block").value.string_value = f"{b[0]}x{b[1]}x{b[2]}"
            attrs.add(key="shared_mem").value.int_value = ev.shared_mem
    elif kind == events.Kind.SANDBOX:
        attrs.add(key="rule").value.string_value = _RULE_NAMES.get(ev.rule, "unknown")
        attrs.add(key="action").value.string_value = _ACTION_NAMES.get(ev.action, "unknown")
        attrs.add(key="pool_id").value.int_value = ev.pool_id
        attrs.add(key="len").value.int_value = ev.len


_ENTRY_NAMES = {e.value: e.name for e in events.Entry}
_RULE_NAMES = {r.value: r.name for r in events.Rule}
_ACTION_NAMES = {a.value: a.name for a in events.Action}
_EVENT_NAMES = {
    events.Kind.GPU_LAUNCH: "kernel.gpu.launch",
    events.Kind.GPU_SYNC: "kernel.gpu.sync_wait",
    events.Kind.SANDBOX: "kernel.sandbox.violation",
}


def apply_facts(span: trace_pb2.Span, facts: Facts) -> None:
    """Add the facts to a span proto: the non-zero ones as attributes (summed
    with any already there from an earlier join) and the kept events as span
    events. Protos are filled in place with add(): a built-then-appended
    message is copied, which costs as much again."""
    f = facts
    _add_counts(span, f.launches, f.launch_ns, f.sync_wait_ns, f.syncs, f.rx_bytes, f.tx_bytes,
                f.violations, f.graph_launches, f.graph_kernels, anatomy=_anatomy_of(f))
    for ev in facts.samples:
        e = span.events.add(time_unix_nano=ev.epoch_ns,
                            name=_EVENT_NAMES.get(ev.hdr.kind, "kernel.event"))
        _add_event_attributes(e.attributes, ev)
    if facts.samples_capped:
        span.dropped_events_count += facts.samples_capped


def _anatomy_of(row) -> tuple:
    """The row's ANATOMY_FIELDS."""
    return (row.cpu_ns, row.runqueue_ns, row.blocked_ns, row.iowait_ns, row.switches, row.preemptions,
            row.memcpy_h2d_bytes, row.memcpy_d2h_bytes, row.memcpy_d2d_bytes, row.memcpy_other_bytes,
            row.memcpy_calls, row.memcpy_ns, row.alloc_bytes)


def _add_counts(span: trace_pb2.Span, launches: int, launch_ns: int, sync_wait_ns: int, syncs: int,
                rx_bytes: int, tx_bytes: int, violations: int, graph_launches: int = 0,
                graph_kernels: int = 0, fresh: bool = False, anatomy: tuple = _NO_ANATOMY) -> None:
    """The FACT_ATTRIBUTES of a span, in that order, the non-zero ones (summed
    with any already there; `fresh`: the caller knows there are none). Values
    passed one by one: on the span path a getattr by name per attribute costs
    more than the attribute."""
    existing = {} if fresh else None
    for attr, value in (("kernel.gpu.launches", launches),
                        ("kernel.gpu.graph_launches", graph_launches),
                        ("kernel.gpu.graph_kernels", graph_kernels), ("kernel.gpu.launch_ns", launch_ns),
                        ("kernel.gpu.sync_wait_ns", sync_wait_ns), ("kernel.gpu.syncs", syncs),
                        ("kernel.net.rx_bytes", rx_bytes), ("kernel.net.tx_bytes", tx_bytes),
                        ("kernel.sandbox.violations", violations), *zip(_ANATOMY_ATTRIBUTES, anatomy)):
        if not value:
            continue
        if existing is None:
            existing = {kv.key: kv for kv in span.attributes if kv.key.startswith("kernel.")}
        if attr in existing:
            existing[attr].value.int_value += value
        else:
            span.attributes.add(key=attr).value.int_value = value


HttpBytesReader = Callable[[events.FlowKey], "tuple[bytes, int, tuple[int, int]] | None"]
SpanKey = tuple[bytes, int]   # (trace id, span id)


class SpanJoin:
    """Thread-safe: reader threads add sampled events, receiver threads join
    spans, the daemon's refresh loop sweeps.

    `facts` is the kernel's span facts map (None: no kernel facts, as in
    unit tests and with the span_ctx probe not attached); the daemon sets it
    once the probe is attached. Network bytes join through the W3C
    traceparent the TC program parsed: the span whose parent is the
    traceparent's span id (the server span of that request) gets the
    request's wire bytes, rx in the request's direction."""

    def __init__(self, cfg: JoinConfig, facts: FactsReader | None = None,
                 on_late: Callable[[list[tuple[int, trace_pb2.ResourceSpans]]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.facts = facts
        self.on_late = on_late
        self.clock = clock
        self.stats = JoinStats()
        self._lock = threading.Lock()
        # sampled events waiting for their span: key → (first seen, events)
        self._samples: OrderedDict[SpanKey, tuple[float, list]] = OrderedDict()
        self._buffered = 0
        # spans already passed on → (when, the sender's origin), for late
        # facts: bounded in count (buffer_events) and age (ttl_s), so it holds
        # ttl_s of spans. The spans of one request share one tuple.
        self._done: OrderedDict[SpanKey, tuple[float, object]] = OrderedDict()
        # foreign rows (not added to the span asking) by the cgroup that made them
        self.foreign_by_cgroup: dict[int, int] = {}
        self._late: dict[SpanKey, Facts] = {}
        self._last_sweep = float("-inf")
        # (trace id, traceparent span id) → the request's connection / its bytes
        self._http_flows: OrderedDict[tuple[bytes, int], events.FlowKey] = OrderedDict()
        self._http_done: OrderedDict[tuple[bytes, int], tuple[int, int]] = OrderedDict()
        self.http_bytes_reader: HttpBytesReader | None = None
        # batched steps: nothing here until a step span is seen
        self.steps_seen = False
        self._held: dict[SpanKey, _Shares] = {}                   # requests held back
        self._shares: OrderedDict[SpanKey, _Shares] = OrderedDict()  # waiting for their request
        self._late_shares: dict[SpanKey, _Shares] = {}            # for requests passed on
        # the waiting room per sender (_owner): shares waiting, in age order; held count
        self._owner_shares: defaultdict[int, OrderedDict] = defaultdict(OrderedDict)
        self._owner_held: defaultdict[int, int] = defaultdict(int)
        self.batch_dropped_by_owner: dict[int, int] = {}   # shares dropped by the sender's bound
        self.batch_hold_full_by_owner: dict[int, int] = {}

    def _foreign_locked(self, taken) -> None:
        """Count rows not added to the span that asked: (cgroup, reason) each."""
        st, by = self.stats, self.foreign_by_cgroup
        for cg, reason in taken:
            if reason == "other_pod" or reason == 1:
                st.foreign_other_pod += 1
            elif reason == "conflict" or reason == 2:
                st.foreign_conflict += 1
            else:
                continue
            if cg in by or len(by) < FOREIGN_CGROUPS_MAX:
                by[cg] = by.get(cg, 0) + 1
            else:
                st.foreign_cgroups_overflow += 1
    # -- kernel side: the sampled event stream -----------------------------------
    def add_event(self, ev: events._Event) -> None:
        """A ring-buffer record. Counts never come this way (they are in the
        span facts map): a GPU or sandbox record is kept as a span event of
        its span, at most join.max_span_events per span."""
        span_id = ev.hdr.span_id
        if not span_id:
            return
        if ev.hdr.kind in (events.Kind.HTTP, events.Kind.HTTP_BYTES):
            self._add_http(ev)
            return
        if ev.hdr.kind not in _EVENT_NAMES:
            return
        key = (bytes(ev.hdr.trace_id), span_id)
        with self._lock:
            self.stats.events_in += 1
            if key in self._done:
                self.stats.events_evicted += 1   # its span went out first; its counts did not
                return
            entry = self._samples.get(key)
            if entry is None:
                entry = self._samples[key] = (self.clock(), [])
            entry[1].append(ev)
            self._buffered += 1
            self._evict_locked()

    def _add_http(self, ev: events._Event) -> None:
        key = (bytes(ev.hdr.trace_id), ev.hdr.span_id)
        with self._lock:
            if ev.hdr.kind == events.Kind.HTTP:
                if ev.has_traceparent:
                    _bounded_put(self._http_flows, key, events.FlowKey.from_buffer_copy(ev.flow),
                                 self.cfg.buffer_events)
            else:
                self._http_flows.pop(key, None)
                _bounded_put(self._http_done, key, ev.rx_tx(), self.cfg.buffer_events)

    def _http_bytes_locked(self, span: trace_pb2.Span) -> tuple[int, int] | None:
        if len(span.parent_span_id) != 8:
            return None
        key = (bytes(span.trace_id), int.from_bytes(span.parent_span_id, "big"))
        done = self._http_done.pop(key, None)
        if done is not None:
            return done
        flow = self._http_flows.pop(key, None)
        if flow is None or self.http_bytes_reader is None:
            return None
        live = self.http_bytes_reader(flow)
        if live is None or (live[0], live[1]) != key:
            return None
        return live[2]

    def _evict_locked(self) -> None:
        deadline = self.clock() - self.cfg.ttl_s
        done = self._done
        while done and next(iter(done.values()))[0] < deadline:
            done.popitem(last=False)
        shares = self._shares
        while shares and next(iter(shares.values())).born < deadline:
            self._pop_share_locked(next(iter(shares)))
            self.stats.batch_expired += 1
        while self._samples:
            key, (born, evs) = next(iter(self._samples.items()))
            if self._buffered <= self.cfg.buffer_events and born >= deadline:
                break
            del self._samples[key]
            self._buffered -= len(evs)
            self.stats.events_evicted += len(evs)

    def pending_events(self) -> int:
        """Sampled events waiting for their span."""
        with self._lock:
            return self._buffered

    # -- span side ---------------------------------------------------------------
    def join(self, resource_spans: Iterable[trace_pb2.ResourceSpans],
             held: list | None = None, origin: frozenset[int] | None = None,
             blobs: list | None = None) -> list[int]:
        """Enrich the spans in place. Returns, per ResourceSpans, the cgroup id
        its kernel facts came from (0 when none joined), for the resource.
        `held`: a list the caller will hold these spans back for (batched
        steps): once a step has been seen (and join.batch_wait_s > 0), each
        request span is appended to it as (key, span) and waits for its steps
        until the caller passes the list to release(). `origin`: the cgroup
        ids of the sender's pod, established from the connection (never from
        the payload); None when it cannot be (pick_rows says what a span gets).
        `blobs`: a list that gets, per ResourceSpans, serialized bytes whose
        spans are its spans as joined (the resource's part as it came), or
        None where the spans were changed from Python: the store makes its
        rows from them without serializing each resource again."""
        cgroups = []
        with self._lock:
            mark = (self.clock(), origin)   # one read per request: its spans arrived together
            if held is not None and not (self.steps_seen and self.cfg.batch_wait_s > 0):
                held = None
            # Nothing but facts rows to put on spans (no sampled events, wire
            # bytes or batch shares waiting, no request to hold): a resource is
            # joined in C from its bytes unless a span has links or facts already.
            plain = self.facts is not None and held is None and not (
                self._samples or self._http_flows or self._http_done or self._shares)
            for rs in resource_spans:
                cgroup = 0
                # Reading a span's attributes from Python costs ~1.5 µs each;
                # one search of the resource's bytes says whether any span
                # already has facts attributes (an earlier join) to add to.
                blob = rs.SerializeToString()
                if plain:
                    got = self.facts.join_resource(blob, origin)
                    if got is not None:
                        cgroups.append(self._joined_in_c(rs, got, mark))
                        if blobs is not None:
                            blobs.append(blob if got[0] is None else got[0])
                        continue
                if blobs is not None:
                    blobs.append(None)
                fresh = _FACT_PREFIX not in blob
                # and whether any span has links (span.links costs ~0.2 µs a span)
                linked = _LINK_WIRE.search(blob) is not None
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        got = self._join_span_locked(span, mark, fresh, held, linked)
                        if got > 1 or not cgroup:    # a real cgroup wins over "joined" (1)
                            cgroup = got or cgroup
                cgroups.append(cgroup)
            self._evict_locked()
        return cgroups

    def _joined_in_c(self, rs: trace_pb2.ResourceSpans, got, mark: tuple) -> int:
        """What SpanFacts.join_resource did, as _join_span_locked would have
        left it: the resource's spans with their facts, the spans passed on."""
        new_blob, keys, rows, cgroup, taken = got
        if new_blob is not None:
            rs.ParseFromString(new_blob)
        done = self._done
        done.update(zip(keys, itertools.repeat(mark)))   # a span sent again keeps its first age
        excess = len(done) - self.cfg.buffer_events
        for _ in range(excess if excess > 0 else 0):
            done.popitem(last=False)
        st = self.stats
        st.spans_in += len(keys)
        if taken:
            kept = 0
            for _, reason in taken:
                kept += reason == 0
            st.rows_taken += kept
            if kept != len(taken):
                self._foreign_locked(taken)
        st.spans_joined += rows
        return cgroup

    def _join_span_locked(self, span: trace_pb2.Span, mark: tuple, fresh: bool = False,
                          held: list | None = None, linked: bool = True) -> int:
        """Enrich one span; the cgroup id of its facts, 1 if they have none,
        0 if nothing joined. mark: (now, the sender's origin)."""
        trace_id = bytes(span.trace_id)
        key = (trace_id, int.from_bytes(span.span_id, "big"))
        now, origin = mark
        self.stats.spans_in += 1
        self._done.pop(key, None)            # re-inserted at the end: age order
        self._done[key] = mark
        if len(self._done) > self.cfg.buffer_events:
            self._done.popitem(last=False)
        row = None
        if self.facts is not None:
            rows, foreign = self.facts.take_rows(trace_id, key[1], origin, pick_rows)
            if rows or foreign:
                if foreign:
                    self._foreign_locked(foreign)
                if rows:
                    self.stats.rows_taken += len(rows)
                    row = _merged(rows)
        if linked and span.links:
            self._step_locked(span, row, now, _owner(origin))
        elif held is not None and span.kind == _SERVER:
            self._hold_locked(key, span, now, held, _owner(origin))
        elif self._shares:                   # a linked span not held: what came, now
            acc = self._pop_share_locked(key)
            if acc is not None:
                put_shares(span, acc)
                self.stats.batch_requests += 1
        sampled = self._samples.pop(key, None)
        net = self._http_bytes_locked(span) if self._http_flows or self._http_done else None
        if sampled is None and net is None:
            if row is None:
                return 0
            # the common case, a facts row alone: straight onto the span (as
            # Facts.add_row + apply_facts would put it, without building Facts)
            _add_counts(span, row.launches, row.launch_ns, row.sync_wait_ns, row.syncs, 0, 0,
                        row.violations, row.graph_launches, row.graph_kernels, fresh, _anatomy_of(row))
            self.stats.spans_joined += 1
            return row.cgroup_id or 1
        facts = Facts(trace_id, span.start_time_unix_nano)
        if row is not None:
            facts.add_row(row)
        if sampled is not None:
            self._buffered -= len(sampled[1])
            for ev in sampled[1]:
                facts.add_sample(ev, self.cfg.max_span_events)
            self.stats.events_joined += len(sampled[1])
        if net is not None:
            facts.rx_bytes, facts.tx_bytes = net
        apply_facts(span, facts)
        self.stats.spans_joined += 1
        self.stats.span_events_capped += facts.samples_capped
        return facts.cgroup_id or 1

    # -- batched steps -------------------------------------------------------------
    def _pop_share_locked(self, key: SpanKey) -> _Shares | None:
        """A share waiting for its request, out of the waiting room."""
        acc = self._shares.pop(key, None)
        if acc is not None:
            mine = self._owner_shares.get(acc.owner)
            if mine is not None:
                mine.pop(key, None)
                if not mine:
                    del self._owner_shares[acc.owner]
        return acc

    def _add_share_locked(self, key: SpanKey, acc: _Shares) -> None:
        """A new share waiting; past its sender's bound its sender's oldest
        goes, past the total the oldest of the sender with most waiting (a
        sender flooding steps for requests that never come pushes out only
        its own)."""
        self._shares[key] = acc
        mine = self._owner_shares[acc.owner]
        mine[key] = None
        if len(mine) > self.cfg.batch_max_pending_per_pod:
            victim = acc.owner
            self.stats.batch_pod_dropped += 1
        elif len(self._shares) > self.cfg.batch_max_pending:
            victim = max(self._owner_shares, key=lambda o: len(self._owner_shares[o]))
        else:
            return
        self._pop_share_locked(next(iter(self._owner_shares[victim])))
        self.stats.batch_expired += 1
        by = self.batch_dropped_by_owner
        if victim in by or len(by) < FOREIGN_CGROUPS_MAX:
            by[victim] = by.get(victim, 0) + 1

    def _step_locked(self, span: trace_pb2.Span, row: KernelRow | None, now: float,
                     owner: int = 0) -> None:
        """A step: its facts shared among the spans it links to, by weight. The
        first with facts to share (GPU work, or CPU time with sched facts on)
        tells the join that this node batches (from then on request spans are
        held): spans with links and nothing to share do not. A shard (another
        tensor-parallel rank's part of a step) adds its facts, not a step."""
        st = self.stats
        st.batch_steps += 1
        cap = self.cfg.batch_max_links
        weights: dict[SpanKey, float] = {}
        total = 0.0
        shard, listed = _step_attributes(span)
        n_listed = len(listed) if listed is not None else 0
        for i, link in enumerate(span.links):
            w = listed[i] if i < n_listed else _weight(link)
            total += w            # every link's weight: the kept ones get their true share
            if i >= cap or len(link.trace_id) != 16 or len(link.span_id) != 8:
                st.batch_links_dropped += 1
                continue
            k = (bytes(link.trace_id), int.from_bytes(link.span_id, "big"))
            weights[k] = weights.get(k, 0.0) + w
        st.batch_links += len(weights)
        if not weights:
            return
        if total <= 0.0:          # every weight 0: equal shares
            weights = dict.fromkeys(weights, 1.0)
            total = float(len(weights))
        facts = [float(getattr(row, f)) for _, f in BATCH_SHARES] if row is not None else None
        if facts is not None and not self.steps_seen and any(facts):
            self.steps_seen = True
        first_ns = span.start_time_unix_nano
        counted = 0 if shard else 1
        for k, w in weights.items():
            acc = self._held.get(k)
            if acc is None:
                if k in self._done:       # the request went out already: a late record
                    acc = self._late_shares.get(k)
                    if acc is None:
                        acc = self._late_shares[k] = _Shares(now, first_ns)
                        st.batch_late += 1
                else:
                    acc = self._shares.get(k)
                    if acc is None:
                        acc = _Shares(now, first_ns, owner)
                        self._add_share_locked(k, acc)
            acc.steps += counted
            if facts is not None:
                frac = w / total
                acc.values = [v + f * frac for v, f in zip(acc.values, facts)]

    def _hold_locked(self, key: SpanKey, span: trace_pb2.Span, now: float, held: list,
                     owner: int = 0) -> None:
        if key in self._held:                 # a copy of a span held already (a retry): not again
            return
        acc = self._pop_share_locked(key)
        pod_full = self._owner_held.get(owner, 0) >= self.cfg.batch_max_held_per_pod
        if pod_full or len(self._held) >= self.cfg.batch_max_held_spans:
            self.stats.batch_hold_full += 1
            if pod_full:
                self.stats.batch_pod_hold_full += 1
                by = self.batch_hold_full_by_owner
                if owner in by or len(by) < FOREIGN_CGROUPS_MAX:
                    by[owner] = by.get(owner, 0) + 1
            if acc is not None:               # what came already goes on it now
                put_shares(span, acc)
                self.stats.batch_requests += 1
            return
        if acc is None:
            acc = _Shares(now, 0)
        acc.owner = owner                     # held for this sender now
        self._held[key] = acc
        self._owner_held[owner] += 1
        held.append((key, span))
        self.stats.batch_held += 1

    def release(self, held: list) -> None:
        """The request spans join() held back get the shares of their steps so
        far (those that come later go out as late records)."""
        with self._lock:
            for key, span in held:
                acc = self._held.pop(key, None)
                if acc is None:
                    continue
                left = self._owner_held[acc.owner] - 1
                if left > 0:
                    self._owner_held[acc.owner] = left
                else:
                    del self._owner_held[acc.owner]
                if acc.steps:
                    put_shares(span, acc)
                    self.stats.batch_requests += 1

    def batch_by_owner(self) -> dict[int, dict[str, int]]:
        """Per sender (its least cgroup id, 0 unknown): request spans held,
        shares waiting, shares dropped and spans not held by its bounds."""
        with self._lock:
            owners = (set(self._owner_held) | set(self._owner_shares)
                      | set(self.batch_dropped_by_owner) | set(self.batch_hold_full_by_owner))
            return {o: {"held": self._owner_held.get(o, 0),
                        "pending": len(self._owner_shares.get(o, ())),
                        "dropped": self.batch_dropped_by_owner.get(o, 0),
                        "hold_full": self.batch_hold_full_by_owner.get(o, 0)} for o in owners}

    def foreign(self) -> dict[int, int]:
        """Rows not added to the span that asked, by the cgroup that made them."""
        with self._lock:
            return dict(self.foreign_by_cgroup)

    def batch_pending(self) -> tuple[int, int]:
        """(request spans held back, request shares waiting for their request)."""
        with self._lock:
            return len(self._held), len(self._shares)

    # -- the sweep: late and expired rows -------------------------------------------
    def sweep(self, force: bool = False) -> int:
        """At most every join.sweep_interval_s (unless forced): read the span
        facts map once; a row of a span passed on within ttl_s is taken as a
        late fact, a row older than ttl_s whose span never came is deleted and
        counted. Returns rows handled; late ones are sent by flush_late()."""
        now = self.clock()
        if self.facts is None or (not force and now - self._last_sweep < self.cfg.sweep_interval_s):
            return 0
        self._last_sweep = now
        rows = self.facts.ages()
        too_old = time.time_ns() - int(self.cfg.ttl_s * 1e9)
        handled = 0
        with self._lock:
            self._evict_locked()
            late_rows: dict[SpanKey, list] = {}
            for trace_id, span_id, cgroup_id, first_ns in rows:
                key = (trace_id, span_id)
                done = self._done.get(key)
                # another pod's row of a span passed on stays for its own
                # sender's span (an impostor's span must not be able to make
                # the victim's facts late, nor the other way round) until it
                # expires
                if done is not None and (done[1] is None or cgroup_id in done[1]):
                    late = self.facts.take_row(trace_id, span_id, cgroup_id)
                    if late is None:
                        continue
                    late_rows.setdefault(key, []).append(late)
                elif first_ns < too_old and self.facts.delete(trace_id, span_id, cgroup_id):
                    self.stats.rows_expired += 1
                else:
                    continue
                handled += 1
            # a late row goes out only if the span's sender could have made it
            for key, got in late_rows.items():
                kept, foreign = pick_rows(got, self._done[key][1])
                self._foreign_locked(foreign)
                if not kept:
                    continue
                facts = self._late.get(key)
                if facts is None:
                    facts = self._late[key] = Facts(key[0], kept[0].first_ns)
                for r in kept:
                    facts.add_row(r)
                self.stats.rows_late += len(kept)
        return handled

    def flush_late(self) -> int:
        """Emit the facts that arrived after their span as child spans, one
        ResourceSpans per cgroup (resource attributes are the caller's)."""
        with self._lock:
            late, self._late = self._late, {}
            late_shares, self._late_shares = self._late_shares, {}
            self._evict_locked()
        if not late and not late_shares:
            return 0
        by_cgroup: dict[int, list[trace_pb2.Span]] = {}
        for (trace_id, span_id), facts in late.items():
            span = trace_pb2.Span(
                trace_id=trace_id, parent_span_id=span_id.to_bytes(8, "big"),
                span_id=_late_span_id(span_id, facts.first_ns), name=LATE_SPAN_NAME,
                kind=trace_pb2.Span.SPAN_KIND_INTERNAL,
                start_time_unix_nano=facts.first_ns, end_time_unix_nano=max(facts.first_ns,
                                                                           time.time_ns()))
            apply_facts(span, facts)
            by_cgroup.setdefault(facts.cgroup_id, []).append(span)
        for (trace_id, span_id), shares in late_shares.items():
            span = trace_pb2.Span(
                trace_id=trace_id, parent_span_id=span_id.to_bytes(8, "big"),
                span_id=_late_span_id(span_id ^ _BATCH_LATE_MIX, shares.first_ns),
                name=LATE_SPAN_NAME, kind=trace_pb2.Span.SPAN_KIND_INTERNAL,
                start_time_unix_nano=shares.first_ns,
                end_time_unix_nano=max(shares.first_ns, time.time_ns()))
            put_shares(span, shares)
            by_cgroup.setdefault(0, []).append(span)
        records = []
        for cgroup, spans in by_cgroup.items():
            rs = trace_pb2.ResourceSpans(scope_spans=[trace_pb2.ScopeSpans(spans=spans)])
            rs.scope_spans[0].scope.name = "spanlet"
            records.append((cgroup, rs))
        with self._lock:
            self.stats.late_records += len(late) + len(late_shares)
        if self.on_late is not None:
            self.on_late(records)
        return len(late) + len(late_shares)

    def facts_stats(self):
        """The span facts map's counts (SpanFactsStats), None without one."""
        return self.facts.stats() if self.facts is not None else None

    def coverage(self) -> tuple[float | None, float | None]:
        """(share of spans joined to kernel facts, share of sampled events
        that found their span)."""
        s = self.stats
        spans = s.spans_joined / s.spans_in if s.spans_in else None
        settled = s.events_joined + s.events_evicted
        evs = s.events_joined / settled if settled else None
        return spans, evs


def _bounded_put(d: OrderedDict, key, value, limit: int) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > limit:
        d.popitem(last=False)


_BATCH_LATE_MIX = 0x5BA7C4ED5BA7C4ED   # a request's late shares: another id than its late facts


def _late_span_id(span_id: int, first_ns: int) -> bytes:
    """A stable id for the late record of a span (so a retried insert dedups)."""
    mixed = (span_id * 0x9E3779B97F4A7C15 + first_ns) & 0xFFFFFFFFFFFFFFFF
    return (mixed or 1).to_bytes(8, "big")
