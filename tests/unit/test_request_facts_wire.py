"""spanlet._wire.request_facts (native/spanlet_wire.c), the per-span read of the
request totals (agent/request_totals.py): against an oracle over the parsed
span, on random spans with every kind of value the attributes can hold, and
on the edge cases one by one."""

from __future__ import annotations

import random
import struct

import pytest
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet import _wire
from spanlet.request_totals import _KEYS
from wire_gen import N, oracle, random_span


def read(span_bytes: bytes, pad: bytes = b"\x01\x02") -> tuple:
    blob = pad + span_bytes + pad
    return _wire.request_facts(blob, len(pad), len(pad) + len(span_bytes), _KEYS)


def test_random_spans_read_as_the_parsed_span_says():
    rnd = random.Random(7)
    for _ in range(3000):
        s = random_span(rnd)
        assert read(s.SerializeToString()) == oracle(s), s


def test_each_summed_key_lands_in_its_total():
    for key, i in _KEYS:
        s = trace_pb2.Span()
        s.attributes.add(key=(b"kernel." + key).decode()).value.int_value = 9
        s.attributes.add(key=(b"kernel." + key).decode()).value.double_value = 0.5   # a key twice: both
        sums, has_totals = read(s.SerializeToString())
        assert sums == [9.5 if j == i else 0.0 for j in range(N)] and not has_totals


def test_the_last_field_of_a_value_wins_as_a_parse_keeps():
    sched = "kernel." + _KEYS[0][0].decode()
    # AnyValue{int_value: 5, string_value: "x"}: a parse keeps the string (no number)
    kv = common_pb2.KeyValue(key=sched)
    raw = kv.SerializeToString() + b"\x12\x05" + b"\x18\x05" + b"\x0a\x01x"
    span = b"\x4a" + bytes((len(raw),)) + raw
    assert trace_pb2.Span.FromString(span).attributes[0].value.WhichOneof("value") == "string_value"
    assert read(span) == (None, False)
    # AnyValue{string_value: "x", int_value: 5}: the int
    raw = kv.SerializeToString() + b"\x12\x05" + b"\x0a\x01x" + b"\x18\x05"
    span = b"\x4a" + bytes((len(raw),)) + raw
    assert read(span) == ([5.0] + [0.0] * (N - 1), False)


@pytest.mark.parametrize("cut", range(1, 29))
def test_bytes_not_well_formed_add_nothing_and_never_fail(cut):
    """Cut inside the second attribute: the first one, whole, is not read either."""
    s = trace_pb2.Span()
    s.attributes.add(key="kernel." + _KEYS[0][0].decode()).value.int_value = 300
    s.attributes.add(key="kernel.request.cpu_ns").value.int_value = 1      # 29 bytes
    b = s.SerializeToString()[:-cut]
    with pytest.raises(Exception):
        trace_pb2.Span.FromString(b)
    assert read(b) == (None, False)
    assert read(b"\xff") == (None, False)


def test_bad_arguments_are_errors_not_crashes():
    with pytest.raises(ValueError):
        _wire.request_facts(b"abc", 2, 1, _KEYS)
    with pytest.raises(ValueError):
        _wire.request_facts(b"abc", 0, 4, _KEYS)
    with pytest.raises(TypeError):
        _wire.request_facts(b"abc", 0, 3, ((b"x",),))
    with pytest.raises(ValueError):
        _wire.request_facts(b"abc", 0, 3, ((b"x", 99),))


def test_a_double_is_read_bit_for_bit():
    s = trace_pb2.Span()
    s.attributes.add(key="kernel." + _KEYS[0][0].decode()).value.double_value = 0.1
    sums, _ = read(s.SerializeToString())
    assert struct.pack("<d", sums[0]) == struct.pack("<d", 0.1)


@pytest.mark.parametrize("group", [b"\x63\x64", b"\x63\x6b\x08\x01\x6c\x64"])
def test_a_group_field_is_skipped_as_a_parse_keeps_it(group):
    """Found by the differential fuzzing (test_wire_differential.py): a span
    with a group (wire types 3 and 4, kept by a parse as an unknown field)
    still adds its facts."""
    s = trace_pb2.Span()
    s.attributes.add(key="kernel.sched.cpu_ns").value.int_value = 5
    data = s.SerializeToString() + group
    assert trace_pb2.Span.FromString(data).attributes[0].value.int_value == 5
    assert read(data) == ([5.0] + [0.0] * (N - 1), False)
    for bad in (b"\x63", b"\x63\x6c", b"\x64"):     # unterminated, mismatched, an end alone
        assert read(s.SerializeToString() + bad) == (None, False)
