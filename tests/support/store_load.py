# Steady store load for the outage tests: enriched-span and kernel-event rows with unique ids, written to a
# ClickHouseSink the way the agent's store path writes them, and an exact tally of what was offered.
from __future__ import annotations

import ctypes as C
import time
from dataclasses import dataclass, field

from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet import events
from spanlet.exporters.clickhouse import rows

TRACES, KERNEL_EVENTS = "otel_traces", "kernel_events"
BASE_NS = time.time_ns() - 3600 * 1_000_000_000  # inside the tables' TTL
TRACE = bytes(range(1, 17))


def span_id_hex(n: int) -> str:
    return (0x5100_0000_0000_0000 + n).to_bytes(8, "big").hex()


def resource_spans(start: int, count: int) -> list[trace_pb2.ResourceSpans]:
    """`count` server spans with span ids start..start+count-1 (span_id_hex), as the receiver hands them on."""
    rs = trace_pb2.ResourceSpans()
    for key, value in (("service.name", "frontend"), ("k8s.pod.name", "web-0"), ("k8s.namespace.name", "prod")):
        rs.resource.attributes.add(key=key).value.string_value = value
    ss = rs.scope_spans.add()
    ss.scope.name = "spanlet-test"
    for n in range(start, start + count):
        span = ss.spans.add()
        span.trace_id = TRACE
        span.span_id = bytes.fromhex(span_id_hex(n))
        span.name = f"POST /v1/images/{n % 7}"
        span.kind = trace_pb2.Span.SPAN_KIND_SERVER
        span.start_time_unix_nano = BASE_NS + n * 1000
        span.end_time_unix_nano = span.start_time_unix_nano + 2_000_000
        span.attributes.add(key="http.method").value.string_value = "POST"
        span.attributes.add(key="kernel.gpu.launches").value.int_value = n % 13
    return [rs]


def kernel_events(start: int, count: int) -> list[events.GpuLaunch]:
    """Decoded GPU launch events whose timestamps BASE_NS+n are their ids."""
    out = []
    for n in range(start, start + count):
        ev = events.GpuLaunch()
        ev.hdr.kind = events.Kind.GPU_LAUNCH
        ev.hdr.pid, ev.hdr.tid, ev.hdr.cgroup_id = 4242, 4243, 77
        ev.hdr.ts_ns = ev.epoch_ns = BASE_NS + n
        ev.hdr.trace_id = (C.c_uint8 * 16)(*TRACE)
        ev.hdr.span_id = 0x5100_0000_0000_0000 + n
        ev.func, ev.stream, ev.duration_ns = 0xdeadbeef, 3, 1000 + n % 97
        ev.grid = (C.c_uint32 * 3)(4, 5, 6)
        ev.block = (C.c_uint32 * 3)(128, 1, 1)
        ev.api, ev.entry = events.Api.driver, events.Entry.cuLaunchKernel
        out.append(ev)
    return out


@dataclass
class Feed:
    """Writes `spans` spans and `events` kernel events per step; counts what it offered."""

    sink: object
    spans: int = 20
    events: int = 30
    offered: dict[str, int] = field(default_factory=lambda: {TRACES: 0, KERNEL_EVENTS: 0})

    steps: int = 0

    def step(self) -> None:
        """Every other step in the agent's own forms (serialized spans, ring-buffer records), the others
        as Python rows: both ways into the store meet the same outages."""
        agent_forms = self.steps % 2 == 0
        self.steps += 1
        n = self.offered[TRACES]
        if agent_forms:
            self.sink.write(TRACES, rows.SPAN_PROTO_COLUMNS, rows.span_proto_rows(resource_spans(n, self.spans)))
        else:
            self.sink.write(TRACES, rows.TRACE_COLUMNS, rows.span_rows(resource_spans(n, self.spans)))
        self.offered[TRACES] += self.spans
        n = self.offered[KERNEL_EVENTS]
        make, columns = ((rows.kernel_record_rows, rows.KERNEL_RECORD_COLUMNS) if agent_forms
                         else (rows.kernel_event_rows, rows.KERNEL_EVENT_COLUMNS))
        self.sink.write(KERNEL_EVENTS, columns, make(kernel_events(n, self.events), node="node-a"))
        self.offered[KERNEL_EVENTS] += self.events

    def run(self, steps: int, period_s: float = 0.0) -> None:
        next_at = time.monotonic()
        for _ in range(steps):
            self.step()
            if period_s:
                next_at += period_s
                time.sleep(max(0.0, next_at - time.monotonic()))


# The statements that read back what the store holds, by id: (total rows, distinct ids, ids).
STORED_SQL = {
    TRACES: "SELECT SpanId FROM spanlet.otel_traces",
    KERNEL_EVENTS: "SELECT toUnixTimestamp64Nano(Timestamp) FROM spanlet.kernel_events",
}


def offered_ids(table: str, count: int, base_ns: int = BASE_NS) -> set[str]:
    """The ids (as STORED_SQL reads them, in text) of the first `count` rows a Feed wrote to `table`, in a
    process whose BASE_NS was `base_ns`."""
    if table == TRACES:
        return {span_id_hex(n) for n in range(count)}
    return {str(base_ns + n) for n in range(count)}
