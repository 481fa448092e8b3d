"""Writes the fuzz targets' seed corpora (fuzz/corpus/<target>/): OTLP spans
encoded by the OpenTelemetry SDK's own encoder (encode_spans), with what the
SDK cannot make (a key twice, a kvlist inside an array, enums out of range)
edited into the protos, and the ring and marker targets' inputs in the
layouts their harnesses read (fuzz/*.c). Deterministic: a rerun writes the
same files. Run from the repository root with the venv's Python:

    .venv/bin/python fuzz/make_corpus.py
"""

from __future__ import annotations

import math
import shutil
import struct
from pathlib import Path

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags, TraceState
from opentelemetry.trace.status import Status, StatusCode

CORPUS = Path(__file__).resolve().parent / "corpus"

T0 = 1_700_000_000_000_000_000
RESOURCE = Resource({"service.name": "fuzz", "host.name": "seed"})
SCOPE = InstrumentationScope("spanlet.fuzz", "1.0")

# The spans whose rows the join target's maps hold (fuzz/wire_join_resource.c):
# trace id 16 bytes of 0x10 + k, span id 01 02 03 04 05 06 07 08 + k.
JOIN_IDS = [(int.from_bytes(bytes([0x10 + k]) * 16, "big"), 0x0102030405060708 + k) for k in range(3)]

# The keys the request totals sum (agent/request_totals.py _KEYS), as span attributes.
KERNEL_FACTS = {
    "kernel.sched.cpu_ns": 1_500,
    "kernel.batch.sched.cpu_ns": 2.5,
    "kernel.sched.runqueue_ns": 7,
    "kernel.sched.blocked_ns": -3,
    "kernel.gpu.memcpy_h2d_bytes": 4096.0,
    "kernel.request.cpu_ns": 9,
    "kernel.unknown": 1,
}


def context(trace_id: int, span_id: int, remote: bool = False, state: TraceState | None = None):
    return SpanContext(trace_id, span_id, is_remote=remote, trace_flags=TraceFlags(1), trace_state=state)


def span(name: str, trace_id: int = 0x0AF7651916CD43DD8448EB211C80319C, span_id: int = 0xB7AD6B7169203331,
         parent: SpanContext | None = None, attributes=None, events=(), links=(),
         kind: SpanKind = SpanKind.INTERNAL, status: Status | None = None,
         start: int = T0, end: int = T0 + 1_000_000, resource: Resource = RESOURCE,
         scope: InstrumentationScope = SCOPE, state: TraceState | None = None) -> ReadableSpan:
    return ReadableSpan(name, context(trace_id, span_id, state=state), parent, resource, attributes,
                        events, links, kind, status=status or Status(), start_time=start, end_time=end,
                        instrumentation_scope=scope)


def request(*spans: ReadableSpan) -> ExportTraceServiceRequest:
    return encode_spans(list(spans))


EVERY_TYPE = {
    "str": "value", "str.empty": "", "str.unicode": "ünïcødé ✓", "bool.true": True, "bool.false": False,
    "int.zero": 0, "int.neg": -1, "int.max": 2**63 - 1, "int.min": -(2**63), "double.zero": 0.0,
    "double.plain": 1.5, "double.neg": -2.25, "double.small": 1e-5, "double.big": 1e20,
    "double.nan": math.nan, "double.inf": math.inf, "array.str": ["a", "b"], "array.bool": [True, False],
    "array.int": [1, 2, 3], "array.double": [0.5, 2.0], "array.empty": [], "bytes": b"\x00\x01\xfe\xff",
    "bytes.empty": b"", "kvlist": {"a": 1, "b": {"c": "d"}, "e": [1, "x"]},
}


def seed_requests() -> dict[str, ExportTraceServiceRequest]:
    """The named requests every OTLP target's seeds come from."""
    parent = context(0x0AF7651916CD43DD8448EB211C80319C, 0x00F067AA0BA902B7)
    remote = context(0x0AF7651916CD43DD8448EB211C80319C, 0x00F067AA0BA902B8, remote=True)
    seeds = {
        "one_span": request(span("GET /", parent=parent)),
        "every_attribute_type": request(span("attrs", parent=parent, attributes=EVERY_TYPE)),
        "events_links": request(span(
            "batch", parent=parent,
            events=[Event("first_token", {"n": 1, "d": 0.25}, timestamp=T0 + 5), Event("empty", timestamp=0)],
            links=[Link(context(0x1, 0x2, state=TraceState([("k", "v")])), {"link.kind": "batch"}),
                   Link(context(0xFF, 0xEE))])),
        "server_client_status": request(
            span("serve", kind=SpanKind.SERVER, parent=remote, status=Status(StatusCode.ERROR, "boom")),
            span("call", span_id=0x11, kind=SpanKind.CLIENT, status=Status(StatusCode.OK)),
            span("consume", span_id=0x12, kind=SpanKind.CONSUMER),
            span("produce", span_id=0x13, kind=SpanKind.PRODUCER)),
        "ids_zero": request(span("zero", trace_id=0, span_id=0, parent=context(0, 0))),
        "ids_all_ff": request(span("ff", trace_id=2**128 - 1, span_id=2**64 - 1,
                                   parent=context(2**128 - 1, 2**64 - 1))),
        "empty_fields": request(span("", start=0, end=0, resource=Resource({}),
                                     scope=InstrumentationScope(""))),
        "huge_fields": request(span("n" * 1500, attributes={"big": "v" * 1500, "k" * 200: 1})),
        "trace_state": request(span("state", state=TraceState([("vendor", "a1"), ("other", "x")]))),
        "kernel_facts": request(
            span("serve", kind=SpanKind.SERVER, attributes=KERNEL_FACTS),
            span("child", span_id=0x21, parent=parent, attributes={"kernel.sched.cpu_ns": 10,
                                                                   "kernel.sched.cpu_ns.x": 1.0})),
        "many_attributes": request(span("wide", attributes={f"a{i}": i for i in range(70)})),
        "many_spans": request(*[
            span(f"s{i}", span_id=0x100 + i, parent=parent if i % 2 else None,
                 kind=SpanKind.SERVER if i % 7 == 0 else SpanKind.INTERNAL,
                 resource=RESOURCE if i < 20 else Resource({"service.name": "other"}),
                 scope=InstrumentationScope(f"scope{i % 3}", "2"))
            for i in range(40)]),
        "join_spans": request(*[
            span(f"join{k}", trace_id=t, span_id=s, parent=parent if k else None,
                 kind=SpanKind.SERVER if k == 0 else SpanKind.INTERNAL, attributes={"http.route": "/v1"})
            for k, (t, s) in enumerate(JOIN_IDS)]),
    }
    seeds.update(edited_requests(seeds))
    return seeds


def edited_requests(seeds: dict[str, ExportTraceServiceRequest]) -> dict[str, ExportTraceServiceRequest]:
    """What the SDK does not make, edited into copies of its requests."""
    out = {}
    r = ExportTraceServiceRequest()
    r.CopyFrom(seeds["one_span"])
    s = r.resource_spans[0].scope_spans[0].spans[0]
    s.attributes.add(key="dup").value.int_value = 1
    s.attributes.add(key="dup").value.string_value = "again"
    s.attributes.add(key="no_value")
    arr = s.attributes.add(key="nested").value.array_value.values.add().kvlist_value.values.add(key="x")
    arr.value.double_value = 2.0
    s.kind = 99                               # an enum out of range: proto3 keeps it
    s.status.code = 7
    s.flags = 0x300
    s.dropped_attributes_count = 3
    out["proto_edits"] = r
    r = ExportTraceServiceRequest()
    r.CopyFrom(seeds["join_spans"])
    r.resource_spans[0].scope_spans[0].spans[1].attributes.add(key="kernel.gpu.syncs").value.int_value = 2
    out["join_kernel_attribute"] = r
    r = ExportTraceServiceRequest()
    r.CopyFrom(seeds["join_spans"])
    r.resource_spans[0].scope_spans[0].spans[2].links.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    out["join_link"] = r
    r = ExportTraceServiceRequest()
    r.resource_spans.add().scope_spans.add()
    r.resource_spans.add()
    out["empty_scope_and_resource"] = r
    return out


def resource_blobs(req: ExportTraceServiceRequest) -> list[bytes]:
    return [rs.SerializeToString() for rs in req.resource_spans]


def span_bounds(blob: bytes, req_rs: trace_pb2.ResourceSpans) -> list[tuple[int, int]]:
    """Where each span's bytes lie in its serialized ResourceSpans."""
    bounds, at = [], 0
    for ss in req_rs.scope_spans:
        for sp in ss.spans:
            b = sp.SerializeToString()
            at = blob.index(b, at)
            bounds.append((at, at + len(b)))
            at += len(b)
    return bounds


def otlp_seeds() -> dict[str, dict[str, bytes]]:
    reqs = seed_requests()
    seeds: dict[str, dict[str, bytes]] = {t: {} for t in (
        "wire_valid_spans", "wire_serving_spans", "wire_span_proto_rows", "wire_trace_native",
        "wire_request_facts", "wire_join_resource")}
    for name, req in reqs.items():
        seeds["wire_valid_spans"][name] = req.SerializeToString()
        for i, blob in enumerate(resource_blobs(req)):
            key = name if i == 0 else f"{name}_{i}"
            seeds["wire_serving_spans"][key] = blob
            seeds["wire_span_proto_rows"][key] = blob
            seeds["wire_trace_native"][key] = b"\x00" + blob
    seeds["wire_valid_spans"]["empty_request"] = b""
    every = resource_blobs(reqs["every_attribute_type"])[0]
    plain = resource_blobs(reqs["one_span"])[0]
    many = resource_blobs(reqs["many_spans"])
    for sel, name in ((0x01, "no_resource_attributes"), (0x02, "int_resource_attribute"),
                      (0x03, "surrogate_resource_attribute"), (0x04, "surrogate_service"),
                      (0x08, "resource_none")):
        seeds["wire_trace_native"][name] = bytes([sel]) + plain
    seeds["wire_trace_native"]["two_groups"] = b"\x40" + many[0]
    one = reqs["events_links"].resource_spans[0].scope_spans[0].spans[0].SerializeToString()
    seeds["wire_trace_native"]["one_span_bytes"] = b"\x80" + one
    seeds["wire_trace_native"]["every_type_two_groups"] = b"\x41" + every
    for name in ("kernel_facts", "every_attribute_type", "proto_edits", "one_span"):
        req = reqs[name]
        blob = resource_blobs(req)[0]
        for j, (start, end) in enumerate(span_bounds(blob, req.resource_spans[0])):
            seeds["wire_request_facts"][f"{name}_{j}"] = struct.pack("<HH", start, len(blob) - end) + blob
        sp = req.resource_spans[0].scope_spans[0].spans[0].SerializeToString()
        seeds["wire_request_facts"][f"{name}_span"] = b"\x00\x00\x00\x00" + sp
    seeds["wire_request_facts"]["bounds_past_end"] = b"\xff\xff\x00\x00" + plain
    join = resource_blobs(reqs["join_spans"])[0]
    # (origin, index, rows) selectors: fuzz/wire_join_resource.c
    for name, sel in (("sender_unknown", (0x80, 0x02, 0x1F)), ("origin_two", (0x02, 0x03, 0x0F)),
                      ("index_past_four", (0x02, 0x06, 0x1F)), ("tie", (0x80, 0x03, 0x27)),
                      ("rows_without_cgroup", (0x80, 0x11, 0x51)), ("duplicate_slot", (0x01, 0x0A, 0x03)),
                      ("origin_past_max", (0x20, 0x05, 0x1F)), ("origin_not_int", (0x41, 0x02, 0x1F)),
                      ("map_error", (0x80, 0x82, 0x1F)), ("no_rows", (0x80, 0x02, 0x00))):
        seeds["wire_join_resource"][name] = bytes(sel) + join
    for name in ("join_kernel_attribute", "join_link", "many_spans", "one_span", "ids_zero"):
        seeds["wire_join_resource"][name] = bytes((0x80, 0x02, 0x1F)) + resource_blobs(reqs[name])[0]
    return seeds


# -- the ring target (fuzz/ring_read.c) -------------------------------------

BUSY, DISCARD = 1 << 31, 1 << 30
PAGE = 4096


def ring_record(kind: int, size: int, ts: int, flags: int = 0) -> bytes:
    """One record as the kernel lays it out: length (and bits), page offset,
    struct spanlet_hdr and the rest of the struct, padded to 8 bytes."""
    hdr = struct.pack("<QIIQ16sQHBBI", ts, 4242, 4243, 77, bytes(range(16)), 0x0102030405060708,
                      kind, 1, 0, 0)
    body = (hdr + bytes(range(256)) * 20)[:size]
    rec = struct.pack("<II", size | flags, 0) + body
    return rec + bytes(-len(rec) % 8)


def ring_input(records: list[bytes], sel: int = 2, limit: int = 1000, cons: int = 0,
               prod: int | None = None, at: int = 0, ring: int = PAGE) -> bytes:
    """sel, limit, consumer and producer positions, then the data area with
    the records from offset `at` (wrapping round the ring's end)."""
    data = bytearray(ring)
    stream = b"".join(records)
    for i, b in enumerate(stream):
        data[(at + i) % ring] = b
    if prod is None:
        prod = cons + len(stream)
    used = max(len(stream) + at, 0)
    return struct.pack("<BHQQ", sel, limit, cons, prod) + bytes(data[:min(ring, used)])


def ring_seeds() -> dict[str, bytes]:
    three = [ring_record(1, 56, 1000), ring_record(2, 64, 2000), ring_record(3, 200, 3000)]
    return {
        "three_records": ring_input(three),
        "clock_every_record": ring_input(three, sel=0),
        "clock_each_refresh": ring_input(three, sel=4),
        "clock_offset_overflow": ring_input([ring_record(1, 56, 2**64 - 1), ring_record(2, 64, 2**63)],
                                            sel=6),
        "discard_then_busy": ring_input([ring_record(1, 56, 1), ring_record(2, 64, 2, DISCARD),
                                         ring_record(3, 200, 3), ring_record(1, 56, 4, BUSY),
                                         ring_record(1, 56, 5)]),
        "not_of_the_layout": ring_input([ring_record(0, 56, 1), ring_record(5, 56, 2),
                                         ring_record(9, 56, 3), ring_record(1, 10, 4),
                                         ring_record(3, 100, 5), ring_record(4, 300, 6)]),
        "wraps_round": ring_input([ring_record(3, 200, 7)], cons=3 * PAGE + PAGE - 64, at=PAGE - 64),
        "limit_two": ring_input(three * 3, limit=2),
        "give_back_every_256": ring_input([ring_record(1, 56, i) for i in range(128)], sel=3,
                                          prod=300 * 64, ring=2 * PAGE),
        "empty": ring_input([]),
        "largest_record": ring_input([ring_record(4, PAGE - 8, 1)], limit=5),
    }


# -- the marker target (fuzz/marker_args.c) ----------------------------------

def marker_int(value: int, signed: bool = False) -> bytes:
    n = max(1, (value.bit_length() + 8) // 8) if signed else max(1, (value.bit_length() + 7) // 8)
    return bytes([1 if signed else 0, n]) + value.to_bytes(n, "little", signed=signed)


def marker_seeds() -> dict[str, bytes]:
    trace, sp = marker_int(0x0AF7651916CD43DD8448EB211C80319C), marker_int(0xB7AD6B7169203331)
    mode = marker_int(1)
    pair = b"\x07" + trace + sp                 # a (trace, span) tuple
    return {
        "mark_follow_unmark": b"\x00" + trace + sp + mode + b"\x01" + trace + sp + mode
                              + b"\x01" + trace + sp + mode + b"\x02" + trace + sp,
        "forget_flags_follow": b"\x04\x03" + marker_int(3) + b"\x01" + trace + sp + mode + b"\x03"
                               + marker_int(0x10000),
        "negative_ids": b"\x00" + marker_int(-5, True) + sp + mode + b"\x02" + trace + marker_int(-1, True),
        "edges": b"\x00\x16\x06\x0e" + b"\x06" + trace + b"\x26\x1e" + b"\x00\x06" + sp + b"\x36",
        "span_context": b"\x05" + pair + b"\x05\x0f" + trace + sp + b"\x05\x02",
        "wrong_arity": b"\x08" + trace + sp + b"\x10" + trace + sp + mode + mode + b"\x18\x1a",
        "other_types": b"\x00\x02" + sp + mode + b"\x01" + trace + b"\x03" + bytes(8) + mode
                       + b"\x02\x04\x05",
        "wide_ints": b"\x06" + bytes([0, 32]) + b"\xff" * 32 + b"\x06" + bytes([1, 17]) + b"\x80" * 17,
    }


def write(target: str, seeds: dict[str, bytes]) -> None:
    out = CORPUS / target
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for name, data in seeds.items():
        (out / name).write_bytes(data)
    print(f"{target}: {len(seeds)} seeds, {sum(map(len, seeds.values()))} bytes")


def main() -> None:
    for target, seeds in otlp_seeds().items():
        write(target, seeds)
    write("ring_read", ring_seeds())
    write("marker_args", marker_seeds())


if __name__ == "__main__":
    main()
