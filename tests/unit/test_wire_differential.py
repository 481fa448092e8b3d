"""Differential fuzzing of spanlet._wire (native/spanlet_wire.c) against the
Python ways it stands in for, on mutated bytes, not only on well-formed
messages: valid messages made at random are mutated (bits flipped, bytes set
to edge values, pieces cut, inserted, repeated, lengths off by one, the tail
cut) and each C reading is held to what the parsed message says wherever the
agent would use it:
- valid_spans(payload), on a payload protobuf parses (the receiver parses
  first): a count n >= 0 means the Python check would drop nothing and the
  request holds n spans;
- serving_spans(blob): a list means protobuf parses the resource and the list
  is exactly its SERVER spans and spans with events (None sends the metrics
  the Python way);
- request_facts(span): on a span protobuf parses, what the oracle over the
  parsed span says; on one it refuses, nothing.
SPANLET_DIFF_MUTANTS sets the mutants per seed message (default a few
thousand in all, seconds; `make fuzz` runs more)."""

from __future__ import annotations

import os
import random

import pytest
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet import _wire
from spanlet.exporters.clickhouse import rows
from spanlet.exporters.otlp.receiver import count_spans, drop_invalid_spans
from spanlet.request_totals import _KEYS
from wire_gen import mutate, oracle, random_span, resource

MUTANTS = int(os.environ.get("SPANLET_DIFF_MUTANTS", "150"))
SEEDS = range(20)


def odd_ids(rnd: random.Random, rs: trace_pb2.ResourceSpans) -> None:
    """Some spans with ids the receiver drops (zero, short, long, a bad parent)."""
    for ss in rs.scope_spans:
        for sp in ss.spans:
            if rnd.random() < 0.1:
                which = rnd.randrange(4)
                if which == 0:
                    sp.trace_id = bytes(16)
                elif which == 1:
                    sp.span_id = rnd.randbytes(rnd.choice((0, 7, 9)))
                elif which == 2:
                    sp.parent_span_id = rnd.randbytes(5)
                else:
                    sp.trace_id = rnd.randbytes(17)


def parses(cls, data: bytes):
    try:
        return cls.FromString(data)
    except (DecodeError, ValueError, RecursionError):
        return None


@pytest.mark.parametrize("seed", SEEDS)
def test_valid_spans_never_counts_a_request_the_python_check_would_change(seed):
    rnd = random.Random(seed)
    request = ExportTraceServiceRequest()
    for _ in range(rnd.randrange(1, 3)):
        rs = resource(rnd, triggers=True)
        if seed % 2:
            odd_ids(rnd, rs)
        request.resource_spans.append(rs)
    payload, counted = request.SerializeToString(), 0
    for _ in range(MUTANTS):
        data = mutate(rnd, payload)
        n = _wire.valid_spans(data)
        parsed = parses(ExportTraceServiceRequest, data)
        if n < 0 or parsed is None:
            continue              # the Python way (or a refused request): C's answer unused
        counted += 1
        before = count_spans(parsed.resource_spans)
        valid, rejected = drop_invalid_spans(parsed)
        assert (n, valid, sum(rejected.values()), count_spans(parsed.resource_spans)) == (
            before, before, 0, before), data.hex()
        assert parsed.SerializeToString() == ExportTraceServiceRequest.FromString(data).SerializeToString()
    assert counted or seed % 2 or MUTANTS < 50       # some mutants are requests C counts


@pytest.mark.parametrize("seed", SEEDS)
def test_serving_spans_names_only_what_the_parsed_resource_says(seed):
    rnd = random.Random(seed)
    blob, named = resource(rnd, triggers=False).SerializeToString(), 0
    for _ in range(MUTANTS):
        data = mutate(rnd, blob)
        got = _wire.serving_spans(data)
        parsed = parses(trace_pb2.ResourceSpans, data)
        if got is None or parsed is None:
            continue
        assert got == [(i, j) for i, ss in enumerate(parsed.scope_spans) for j, sp in enumerate(ss.spans)
                       if sp.kind == trace_pb2.Span.SPAN_KIND_SERVER or len(sp.events)], data.hex()
        named += 1
    assert named or MUTANTS < 50


@pytest.mark.parametrize("seed", SEEDS)
def test_request_facts_of_a_mutated_span_are_the_parsed_spans_or_none(seed):
    rnd = random.Random(seed)
    for _ in range(max(1, MUTANTS // 10)):
        span = random_span(rnd).SerializeToString()
        for _ in range(10):
            data = mutate(rnd, span)
            pad = rnd.randbytes(rnd.randrange(4))
            got = _wire.request_facts(pad + data + pad, len(pad), len(pad) + len(data), _KEYS)
            parsed = parses(trace_pb2.Span, data)
            if parsed is not None:
                assert got == oracle(parsed), data.hex()


@pytest.mark.parametrize("seed", SEEDS)
def test_the_stores_rows_of_a_mutated_resource_are_the_parsed_resources(seed):
    """span_proto_rows (C, on the bytes) makes the rows the Python way makes
    from the parsed resource, as the store reads them (rows_from_span_protos);
    trace_native then lays them out or leaves them to Python, never failing."""
    rnd = random.Random(seed)
    blob, compared = resource(rnd, triggers=True).SerializeToString(), 0
    for _ in range(max(1, MUTANTS // 5)):
        data = mutate(rnd, blob)
        parsed = parses(trace_pb2.ResourceSpans, data)
        if parsed is None:
            continue
        res_attrs, service = rows._resource(parsed)
        c_rows = _wire.span_proto_rows(data, res_attrs, service)
        assert rows.rows_from_span_protos(c_rows) == rows.rows_from_span_protos(
            rows.python_span_proto_rows([parsed])), data.hex()
        block, skip = _wire.trace_native(c_rows)
        assert set(skip) <= set(range(len(c_rows))) and (block is None) == (len(skip) == len(c_rows))
        compared += 1
    assert compared or MUTANTS < 50
