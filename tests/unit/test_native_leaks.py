"""The native extensions give back every Python object they make: each of
spanlet._wire's readings, called many thousands of times on well-formed and
mutated bytes, leaves Python's traced memory where it was (tracemalloc sees
the objects C makes through Python's allocator). The sanitizer run
(scripts/sanitize.sh) reports what the C allocates itself; a leaked Python
object looks there like any other extension's, so it is checked here."""

from __future__ import annotations

import gc
import random
import tracemalloc

from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet import _wire
from spanlet.exporters.clickhouse import rows
from spanlet.request_totals import _KEYS
from wire_gen import mutate, random_span, resource

ROUNDS = 3000


def inputs() -> list[tuple[bytes, bytes]]:
    """(resource bytes, span bytes), well-formed and mutated."""
    rnd = random.Random(5)
    out = []
    for _ in range(30):
        rs, span = resource(rnd, triggers=True).SerializeToString(), random_span(rnd).SerializeToString()
        out.append((rs, span))
        out.append((mutate(rnd, rs), mutate(rnd, span)))
    return out


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7f:
        out.append(n & 0x7f | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def call_all(data: list[tuple[bytes, bytes]]) -> None:
    for rs, span in data:
        _wire.valid_spans(b"\x0a" + varint(len(rs)) + rs)          # a request of the resource
        _wire.serving_spans(rs)
        _wire.request_facts(span, 0, len(span), _KEYS)
        try:
            parsed = trace_pb2.ResourceSpans.FromString(rs)
        except Exception:
            continue
        res_attrs, service = rows._resource(parsed)
        _wire.trace_native(_wire.span_proto_rows(rs, res_attrs, service))


def test_the_wire_readings_leak_no_python_object():
    data = inputs()
    for _ in range(50):                       # caches, interned names, first-time allocations
        call_all(data)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(ROUNDS // 50):
            call_all(data)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # one object leaked a call would be ~60 bytes x 60 inputs x 60 rounds
    assert grown < 32 * 1024, grown
