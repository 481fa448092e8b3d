"""The span join: kernel events that carry a span id wait in a bounded buffer
until the OTLP span with that id arrives; the span then gets `kernel.*`
attributes and span events. Events that come after their span was passed on
(within join.ttl_s of it) are emitted later as their own record (a child span
with the same trace id)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable

from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet import events
from spanlet.config import JoinConfig

log = logging.getLogger(__name__)

LATE_SPAN_NAME = "spanlet.kernel.late_events"

# The kernel facts a span gets, as (attribute, Facts field).
FACT_ATTRIBUTES = (
    ("kernel.gpu.launches", "launches"),
    ("kernel.gpu.launch_ns", "launch_ns"),
    ("kernel.gpu.sync_wait_ns", "sync_wait_ns"),
    ("kernel.net.rx_bytes", "rx_bytes"),
    ("kernel.net.tx_bytes", "tx_bytes"),
    ("kernel.sandbox.violations", "violations"),
)


@dataclass
class Facts:
    """What the kernel did for one span."""

    trace_id: bytes
    first_ns: int
    cgroup_id: int = 0                               # of the first event
    launches: int = 0
    launch_ns: int = 0
    sync_wait_ns: int = 0
    rx_bytes: int = 0
    tx_bytes: int = 0
    violations: int = 0
    count: int = 0                                   # events folded in
    samples: list = field(default_factory=list)      # individual events kept, capped
    samples_capped: int = 0

    def add(self, ev: events._Event, cap: int) -> None:
        kind = ev.hdr.kind
        if kind == events.Kind.GPU_LAUNCH:
            self.launches += 1
            self.launch_ns += ev.duration_ns
        elif kind == events.Kind.GPU_SYNC:
            self.sync_wait_ns += ev.duration_ns
        elif kind == events.Kind.SANDBOX:
            self.violations += 1
        self.count += 1
        if len(self.samples) < cap:
            self.samples.append(ev)
        else:
            self.samples_capped += 1

    def merge(self, other: "Facts", cap: int) -> None:
        for _, name in FACT_ATTRIBUTES:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.count += other.count
        room = max(0, cap - len(self.samples))
        self.samples.extend(other.samples[:room])
        self.samples_capped += other.samples_capped + max(0, len(other.samples) - room)


@dataclass
class JoinStats:
    events_in: int = 0            # events that carried a span id
    events_joined: int = 0        # found their span (on time or late)
    events_evicted: int = 0       # their span never came (TTL or size bound)
    spans_in: int = 0
    spans_joined: int = 0         # got at least one kernel event
    late_records: int = 0
    span_events_capped: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


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
    existing = None
    for attr, name in FACT_ATTRIBUTES:
        value = getattr(facts, name)
        if not value:
            continue
        if existing is None:
            existing = {kv.key: kv for kv in span.attributes if kv.key.startswith("kernel.")}
        if attr in existing:
            existing[attr].value.int_value += value
        else:
            span.attributes.add(key=attr).value.int_value = value
    for ev in facts.samples:
        e = span.events.add(time_unix_nano=ev.epoch_ns,
                            name=_EVENT_NAMES.get(ev.hdr.kind, "kernel.event"))
        _add_event_attributes(e.attributes, ev)
    if facts.samples_capped:
        span.dropped_events_count += facts.samples_capped


HttpBytesReader = Callable[[events.FlowKey], "tuple[bytes, int, tuple[int, int]] | None"]


class SpanJoin:
    """Thread-safe: reader threads add events, receiver threads join spans.

    Network bytes join through the W3C traceparent the TC program parsed: the
    span whose parent is the traceparent's span id (the server span of that
    request) gets the request's wire bytes, rx in the request's direction."""

    def __init__(self, cfg: JoinConfig,
                 on_late: Callable[[list[tuple[int, trace_pb2.ResourceSpans]]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.on_late = on_late
        self.clock = clock
        self.stats = JoinStats()
        self._lock = threading.Lock()
        self._pending: OrderedDict[int, tuple[float, Facts]] = OrderedDict()
        self._buffered = 0
        # span id → (when passed on, trace id) of spans already passed on, for
        # late events: bounded like _pending, in count and age (ttl_s), so that
        # it holds ttl_s of spans, not buffer_events whatever the span rate.
        self._done: OrderedDict[int, tuple[float, bytes]] = OrderedDict()
        self._late: dict[int, Facts] = {}
        # (trace id, traceparent span id) → the request's connection / its bytes
        self._http_flows: OrderedDict[tuple[bytes, int], events.FlowKey] = OrderedDict()
        self._http_done: OrderedDict[tuple[bytes, int], tuple[int, int]] = OrderedDict()
        self.http_bytes_reader: HttpBytesReader | None = None

    # -- kernel side -------------------------------------------------------------
    def add_event(self, ev: events._Event) -> None:
        span_id = ev.hdr.span_id
        if not span_id:
            return
        if ev.hdr.kind in (events.Kind.HTTP, events.Kind.HTTP_BYTES):
            self._add_http(ev)
            return
        if ev.hdr.kind not in _EVENT_NAMES:
            return
        trace_id = bytes(ev.hdr.trace_id)
        with self._lock:
            self.stats.events_in += 1
            done = self._done.get(span_id)
            if done is not None and done[1] == trace_id and done[0] >= self.clock() - self.cfg.ttl_s:
                late = self._late.get(span_id)
                if late is None:
                    late = self._late[span_id] = Facts(trace_id, ev.epoch_ns, ev.hdr.cgroup_id)
                late.add(ev, self.cfg.max_span_events)
                self.stats.events_joined += 1
                return
            entry = self._pending.get(span_id)
            if entry is None or entry[1].trace_id != trace_id:
                entry = (self.clock(), Facts(trace_id, ev.epoch_ns, ev.hdr.cgroup_id))
                self._pending[span_id] = entry
            entry[1].add(ev, self.cfg.max_span_events)
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
        while self._pending:
            span_id, (born, facts) = next(iter(self._pending.items()))
            if self._buffered <= self.cfg.buffer_events and born >= deadline:
                break
            del self._pending[span_id]
            self._buffered -= facts.count
            self.stats.events_evicted += facts.count

    def pending_events(self) -> int:
        with self._lock:
            return self._buffered

    # -- span side ---------------------------------------------------------------
    def join(self, resource_spans: Iterable[trace_pb2.ResourceSpans]) -> list[int]:
        """Enrich the spans in place. Returns, per ResourceSpans, the cgroup id
        its kernel events came from (0 when none joined), for the resource."""
        cgroups = []
        with self._lock:
            for rs in resource_spans:
                cgroup = 0
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        cgroup = self._join_span_locked(span) or cgroup
                cgroups.append(cgroup)
            self._evict_locked()
        return cgroups

    def _join_span_locked(self, span: trace_pb2.Span) -> int:
        """Enrich one span; the cgroup id of its events, 0 if none joined."""
        span_id = int.from_bytes(span.span_id, "big")
        self.stats.spans_in += 1
        self._done.pop(span_id, None)            # re-inserted at the end: age order
        self._done[span_id] = (self.clock(), bytes(span.trace_id))
        if len(self._done) > self.cfg.buffer_events:
            self._done.popitem(last=False)
        entry = self._pending.get(span_id)
        net = self._http_bytes_locked(span) if self._http_flows or self._http_done else None
        if entry is None or entry[1].trace_id != bytes(span.trace_id):
            if net is None:
                return 0
            entry = (0.0, Facts(bytes(span.trace_id), span.start_time_unix_nano))
        else:
            del self._pending[span_id]
            self._buffered -= entry[1].count
        facts = entry[1]
        if net is not None:
            facts.rx_bytes, facts.tx_bytes = facts.rx_bytes + net[0], facts.tx_bytes + net[1]
        apply_facts(span, facts)
        self.stats.events_joined += facts.count
        self.stats.spans_joined += 1
        self.stats.span_events_capped += facts.samples_capped
        return facts.cgroup_id or 1

    def flush_late(self) -> int:
        """Emit the events that arrived after their span as child spans, one
        ResourceSpans per cgroup (resource attributes are the caller's)."""
        with self._lock:
            late, self._late = self._late, {}
            self._evict_locked()
        if not late:
            return 0
        by_cgroup: dict[int, list[trace_pb2.Span]] = {}
        for span_id, facts in late.items():
            span = trace_pb2.Span(
                trace_id=facts.trace_id, parent_span_id=span_id.to_bytes(8, "big"),
                span_id=_late_span_id(span_id, facts.first_ns), name=LATE_SPAN_NAME,
                kind=trace_pb2.Span.SPAN_KIND_INTERNAL,
                start_time_unix_nano=facts.first_ns,
                end_time_unix_nano=max([facts.first_ns] + [e.epoch_ns for e in facts.samples]))
            apply_facts(span, facts)
            by_cgroup.setdefault(facts.cgroup_id, []).append(span)
        records = []
        for cgroup, spans in by_cgroup.items():
            rs = trace_pb2.ResourceSpans(scope_spans=[trace_pb2.ScopeSpans(spans=spans)])
            rs.scope_spans[0].scope.name = "spanlet"
            records.append((cgroup, rs))
        with self._lock:
            self.stats.late_records += len(late)
        if self.on_late is not None:
            self.on_late(records)
        return len(late)

    def coverage(self) -> tuple[float | None, float | None]:
        """(share of spans joined to a kernel event, share of events that found their span)."""
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


def _late_span_id(span_id: int, first_ns: int) -> bytes:
    """A stable id for the late record of a span (so a retried insert dedups)."""
    mixed = (span_id * 0x9E3779B97F4A7C15 + first_ns) & 0xFFFFFFFFFFFFFFFF
    return (mixed or 1).to_bytes(8, "big")
