"""The embedded store's insert of serialized spans (rows.SPAN_PROTO_COLUMNS,
span_protos.py: a Native block made in C), for real in chdb: every stored
value is the one the Python row builder (rows.span_rows) stores for the same
spans, for random spans with every kind of attribute value, with and without
events and links, one resource or hundreds, rows in any order and of any
sequence type; the spans the C block leaves out go the Python way; a retried
batch leaves one copy; proto rows survive the sink's spool."""

from __future__ import annotations

import collections
import math
import random
import struct
import time

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from spanlet.exporters.clickhouse import rows, span_protos
from spanlet.exporters.clickhouse.chdb_backend import INCOMING_FILE, ChdbBackend
from spanlet.exporters.clickhouse.sink import decode_batch, encode_batch
from spanlet.exporters.otlp.common import varint

T0 = time.time_ns() - 3600 * 1_000_000_000   # inside the TTL
STRINGS = ["", "x", "ünï 字", "a'b\"c\\n\t", "<&>", "0", "{'k':'v'}"]
DOUBLES = [0.0, -0.0, 0.1, 0.25, 1e15, 1e21, 1e-7, 3.5, -2.75, 123456789.125, math.nan, math.inf, -math.inf]


def _value(rnd: random.Random, v, depth: int = 0, simple: bool = False) -> None:
    kinds = ["s", "i", "b", "by"] if simple else ["s", "i", "b", "d", "by", "arr", "kv", "none"]
    k = rnd.choice(kinds if depth < 2 else ["s", "i", "b", "d"])
    if k == "s":
        v.string_value = rnd.choice(STRINGS)
    elif k == "i":
        v.int_value = rnd.choice([0, -1, 2 ** 63 - 1, -2 ** 63, 42])
    elif k == "b":
        v.bool_value = rnd.choice([True, False])
    elif k == "d":
        v.double_value = rnd.choice(DOUBLES + [struct.unpack("d", struct.pack("Q", rnd.getrandbits(64)))[0]])
    elif k == "by":
        v.bytes_value = rnd.randbytes(rnd.randint(0, 5))
    elif k == "arr":
        for _ in range(rnd.randint(0, 3)):
            _value(rnd, v.array_value.values.add(), depth + 1)
    elif k == "kv":
        for _ in range(rnd.randint(0, 3)):
            _value(rnd, v.kvlist_value.values.add(key=rnd.choice("abc")).value, depth + 1)


def _attributes(rnd: random.Random, kvs, simple: bool) -> None:
    for j in range(rnd.randint(0, 4)):
        key = f"k{j}" if simple else rnd.choice(["k1", "k2", "k3", "mm.modality"])
        _value(rnd, kvs.add(key=key).value, simple=simple)


def _spans(seed: int, *, resources: int = 3, scopes: int = 2, per_scope: int = 60, nested: bool = True,
           simple_share: float = 0.7) -> ExportTraceServiceRequest:
    rnd = random.Random(seed)
    req = ExportTraceServiceRequest()
    for r in range(resources):
        rs = req.resource_spans.add()
        rs.resource.attributes.add(key="service.name").value.string_value = f"svc-{r}"
        rs.resource.attributes.add(key="k8s.pod.name").value.string_value = f"pod-'{r}'"
        rs.resource.attributes.add(key="n").value.int_value = r
        for sc in range(scopes):
            ss = rs.scope_spans.add()
            ss.scope.name, ss.scope.version = f"scope-{sc}", "1.0" if sc else ""
            for _ in range(per_scope):
                simple = rnd.random() < simple_share
                s = ss.spans.add(
                    name=rnd.choice(["infer", "", "GET /x"]),
                    trace_id=rnd.choice([rnd.randbytes(16), bytes(16), b""]), span_id=rnd.randbytes(8),
                    parent_span_id=rnd.choice([b"", bytes(8), rnd.randbytes(8)]), kind=rnd.randint(0, 6),
                    trace_state=rnd.choice(["", "k=v"]),
                    start_time_unix_nano=T0 + rnd.randint(0, 10 ** 12),
                    end_time_unix_nano=T0 + rnd.randint(0, 10 ** 12))
                s.status.code, s.status.message = rnd.randint(0, 3), rnd.choice(["", "bad 'x'"])
                _attributes(rnd, s.attributes, simple)
                if nested:
                    for _ in range(rnd.randint(0, 2)):
                        e = s.events.add(time_unix_nano=T0 + rnd.randint(0, 10 ** 12),
                                         name=rnd.choice(["first_token", "x"]))
                        _attributes(rnd, e.attributes, simple)
                    for _ in range(rnd.randint(0, 2)):
                        lk = s.links.add(trace_id=rnd.randbytes(16), span_id=rnd.choice([rnd.randbytes(8), bytes(8)]),
                                         trace_state=rnd.choice(["", "a=b"]))
                        _attributes(rnd, lk.attributes, simple)
    return req


@pytest.fixture
def backend(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)      # where the engine would write a schema it got as text
    b = ChdbBackend(str(tmp_path / "store"))
    try:
        b.ensure_schema()
        b.query("CREATE TABLE spanlet.reference AS spanlet.otel_traces")
        yield b
    finally:
        b.close()


def _stored(b: ChdbBackend, table: str) -> list[tuple]:
    return b.query(f"SELECT * FROM spanlet.{table} ORDER BY SpanId, TraceId, Timestamp")


def _both_ways(b: ChdbBackend, req: ExportTraceServiceRequest) -> tuple[list, list]:
    b.insert("otel_traces", rows.SPAN_PROTO_COLUMNS, rows.span_proto_rows(req.resource_spans))
    b.insert("reference", rows.TRACE_COLUMNS, rows.span_rows(req.resource_spans))
    return _stored(b, "otel_traces"), _stored(b, "reference")


def _python_rows(req) -> int:
    """How many spans the C block leaves to the Python way."""
    data, skip = span_protos.native(rows.span_proto_rows(req.resource_spans))
    return len(skip)


@pytest.mark.parametrize("seed", range(6))
def test_stored_rows_are_the_python_rows_for_random_spans(backend, tmp_path, seed):
    req = _spans(seed, nested=seed % 2 == 0)
    got, want = _both_ways(backend, req)
    assert len(got) == 3 * 2 * 60
    assert got == want
    # most spans were in the Native block, the complex rest made by Python
    assert 0 < _python_rows(req) < len(got) // 2
    assert not (tmp_path / "store" / INCOMING_FILE).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]   # nothing else written


def test_simple_spans_are_all_in_the_native_block(backend):
    req = _spans(11, simple_share=1.0)
    got, want = _both_ways(backend, req)
    assert got == want and len(got) == 360
    assert _python_rows(req) == 0


def test_a_batch_of_complex_spans_only(backend):
    req = _spans(12, resources=1, scopes=1, per_scope=40, simple_share=0.0)
    for s in req.resource_spans[0].scope_spans[0].spans:
        s.attributes.add(key="list").value.array_value.values.add().string_value = "x"
    got, want = _both_ways(backend, req)
    assert got == want and len(got) == 40


def test_hundreds_of_resources_in_one_batch(backend):
    req = _spans(13, resources=300, scopes=1, per_scope=2)
    got, want = _both_ways(backend, req)
    assert got == want and len(got) == 600
    assert len({r[7] for r in got}) == 300                      # ServiceName per resource


def test_retried_batch_leaves_one_copy(backend):
    req = _spans(14, resources=1, scopes=1, per_scope=50)
    proto_rows = rows.span_proto_rows(req.resource_spans)
    for _ in range(2):
        backend.insert("otel_traces", rows.SPAN_PROTO_COLUMNS, proto_rows)
    backend.query("OPTIMIZE TABLE spanlet.otel_traces FINAL")
    assert backend.query("SELECT count() FROM spanlet.otel_traces") == [(50,)]


def test_proto_rows_survive_the_spool(backend):
    req = _spans(15, resources=2, scopes=1, per_scope=30)
    proto_rows = rows.span_proto_rows(req.resource_spans)
    table, columns, back = decode_batch(encode_batch("otel_traces", rows.SPAN_PROTO_COLUMNS, proto_rows))
    assert (table, tuple(columns)) == ("otel_traces", rows.SPAN_PROTO_COLUMNS)
    assert back == proto_rows
    backend.insert(table, columns, back)
    backend.insert("reference", rows.TRACE_COLUMNS, rows.span_rows(req.resource_spans))
    assert _stored(backend, "otel_traces") == _stored(backend, "reference")


def test_rows_from_span_protos_are_span_rows():
    req = _spans(16)
    assert rows.rows_from_span_protos(rows.span_proto_rows(req.resource_spans)) == \
        rows.span_rows(req.resource_spans)


def test_a_span_with_every_otlp_field_set_is_in_the_native_block(backend):
    """The C block's wire types (native/spanlet_wire.c, WIRE_TYPES) against the
    OTLP proto's own: a span with every field of Span, Event, Link, Status,
    KeyValue and the scalar AnyValues set is read, not left out."""
    from opentelemetry.proto.trace.v1 import trace_pb2
    s = trace_pb2.Span(trace_id=b"t" * 16, span_id=b"s" * 8, trace_state="a=b", parent_span_id=b"p" * 8,
                       flags=0x301, name="every", kind=3, start_time_unix_nano=T0, end_time_unix_nano=T0 + 7,
                       dropped_attributes_count=1, dropped_events_count=2, dropped_links_count=3)
    for key, kind, value in (("s", "string_value", "x"), ("b", "bool_value", True), ("i", "int_value", -3),
                             ("d", "double_value", 2.5), ("y", "bytes_value", b"\x00\xff"),
                             ("z", "string_value_strindex", 5)):
        setattr(s.attributes.add(key=key).value, kind, value)
    e = s.events.add(time_unix_nano=T0 + 1, name="ev", dropped_attributes_count=4)
    e.attributes.add(key="k").value.string_value = "v"
    s.attributes[0].key_strindex = 9
    lk = s.links.add(trace_id=b"u" * 16, span_id=b"v" * 8, trace_state="c=d", dropped_attributes_count=5,
                     flags=0x100)
    lk.attributes.add(key="w").value.int_value = 2
    s.status.message, s.status.code = "fine", 1
    for message in (s, e, lk, s.status, s.attributes[0]):
        declared = {f.name for f in message.DESCRIPTOR.fields if f.name != "deprecated_code"}
        assert {f.name for f, _ in message.ListFields()} == declared, message.DESCRIPTOR.name
    assert {f.name for f in s.attributes[0].value.DESCRIPTOR.fields} - {"array_value", "kvlist_value"} == \
        {v.WhichOneof("value") for v in (kv.value for kv in s.attributes)}
    req = ExportTraceServiceRequest()
    req.resource_spans.add().scope_spans.add().spans.append(s)
    assert _python_rows(req) == 0
    got, want = _both_ways(backend, req)
    assert got == want and len(got) == 1


def test_a_request_span_keeps_its_batch_shares_in_span_attributes(backend):
    """Batched steps: the request's kernel.batch.* (an int and doubles, put on
    the span as wire bytes by the join) are stored with its other attributes,
    and a step span keeps its links with their weights."""
    from spanlet.join import _Shares, put_shares

    req = ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    request = ss.spans.add(name="POST /generate", trace_id=bytes(range(16)), span_id=b"\x01" * 8, kind=2,
                           start_time_unix_nano=T0, end_time_unix_nano=T0 + 5)
    shares = _Shares(0.0, 0)
    shares.steps, shares.values = 3, [12.5, 0.25, 1.75, 1500.0, 2e6, 3e5, 0.0, 0.0, 4096.0, 0.0, 0.0, 0.0]
    put_shares(request, shares)
    step = ss.spans.add(name="engine.step", trace_id=bytes(range(1, 17)), span_id=b"\x02" * 8, kind=1,
                        start_time_unix_nano=T0, end_time_unix_nano=T0 + 5)
    lk = step.links.add(trace_id=request.trace_id, span_id=request.span_id)
    lk.attributes.add(key="spanlet.weight").value.double_value = 2.0
    got, want = _both_ways(backend, req)
    assert got == want
    attrs = dict(backend.query("SELECT SpanAttributes FROM spanlet.otel_traces "
                               "WHERE SpanName = 'POST /generate'")[0][0])
    assert {k: v for k, v in attrs.items() if k.startswith("kernel.batch.")} == {
        "kernel.batch.steps": "3", "kernel.batch.gpu.launches": "12.5",
        "kernel.batch.gpu.graph_launches": "0.25", "kernel.batch.gpu.graph_kernels": "1.75",
        "kernel.batch.gpu.sync_wait_ns": "1500", "kernel.batch.sched.cpu_ns": "2000000",
        "kernel.batch.sched.runqueue_ns": "300000", "kernel.batch.sched.blocked_ns": "0",
        "kernel.batch.sched.iowait_ns": "0", "kernel.batch.gpu.memcpy_h2d_bytes": "4096",
        "kernel.batch.gpu.memcpy_d2h_bytes": "0", "kernel.batch.gpu.memcpy_d2d_bytes": "0",
        "kernel.batch.gpu.memcpy_other_bytes": "0"}


def _one(build) -> bytes:
    from opentelemetry.proto.trace.v1 import trace_pb2
    s = trace_pb2.Span(name="x", trace_id=b"t" * 16, span_id=b"s" * 8)
    s.attributes.add(key="plain").value.string_value = "v"
    build(s)
    return s.SerializeToString()


@pytest.mark.parametrize("case, build, named", [
    ("strings, ints, bools, bytes", lambda s: (s.attributes.add(key="i").value.__setattr__("int_value", -5),
                                               s.attributes.add(key="b").value.__setattr__("bool_value", True),
                                               s.attributes.add(key="y").value.__setattr__("bytes_value", b"\0")),
     False),
    ("a plain double", lambda s: s.attributes.add(key="d").value.__setattr__("double_value", 0.25), False),
    ("zero", lambda s: s.attributes.add(key="d").value.__setattr__("double_value", -0.0), False),
    ("a double printed 1e-7", lambda s: s.attributes.add(key="d").value.__setattr__("double_value", 1e-7), True),
    ("a double printed 1e21", lambda s: s.attributes.add(key="d").value.__setattr__("double_value", 1e21), True),
    ("nan", lambda s: s.attributes.add(key="d").value.__setattr__("double_value", math.nan), True),
    ("an array", lambda s: s.attributes.add(key="a").value.array_value.values.add(), True),
    ("a map", lambda s: s.attributes.add(key="m").value.kvlist_value.values.add(key="k"), True),
    ("a key twice", lambda s: s.attributes.add(key="plain").value.__setattr__("int_value", 1), True),
    ("a key twice in an event", lambda s: [s.events.add(name="e").attributes.add(key="k") for _ in range(1)]
     and s.events[0].attributes.add(key="k"), True),
    ("an array in a link", lambda s: s.links.add(trace_id=b"u" * 16, span_id=b"v" * 8)
     .attributes.add(key="a").value.array_value.values.add(), True),
    ("the same key in two events", lambda s: [s.events.add(name="e").attributes.add(key="k") for _ in range(2)],
     False),
    ("64 attributes", lambda s: [s.attributes.add(key=f"k{i}") for i in range(63)], False),
    ("65 attributes", lambda s: [s.attributes.add(key=f"k{i}") for i in range(64)], True),
])
def test_the_native_block_leaves_out_each_complex_case(case, build, named):
    data, skip = span_protos.native([[_one(build), False, {}, "", "", ""]])
    assert skip == ([0] if named else []), case
    assert (data is None) is named


def test_the_native_block_leaves_out_malformed_bytes_and_keeps_indices():
    good = [_one(lambda s: None), False, {}, "", "", ""]
    rows_ = [good, [good[0][:-3], *good[1:]], [b"\xff", *good[1:]], good, [b"", *good[1:]]]
    assert span_protos.native(rows_)[1] == [1, 2]
    with pytest.raises(TypeError):
        span_protos.native([good, ["not bytes", *good[1:]]])
    with pytest.raises(ValueError):
        span_protos.native([good[:4]])
    assert span_protos.native([]) == (None, [])


# -- the rows and their Native block made in C (native/spanlet_wire.c) against the Python way ------

def _shapes(seed: int) -> ExportTraceServiceRequest:
    """Random spans in random shapes: resources with and without service.name, empty scopes and
    resources, scopes with and without a name and version."""
    rnd = random.Random(seed)
    req = _spans(seed, resources=rnd.randint(1, 4), scopes=rnd.randint(1, 3), per_scope=rnd.randint(0, 30),
                 nested=seed % 3 != 0)
    for rs in req.resource_spans:
        if rnd.random() < 0.3:
            del rs.resource.attributes[0]                         # no service.name
        for ss in rs.scope_spans:
            if rnd.random() < 0.3:
                ss.ClearField("scope")
            elif rnd.random() < 0.3:
                ss.scope.name = rnd.choice(STRINGS)
    if rnd.random() < 0.3:
        req.resource_spans.add()                                  # a resource with nothing
    return req


@pytest.mark.parametrize("seed", range(40))
def test_the_c_rows_are_the_python_rows(seed):
    from spanlet import _wire
    assert rows._wire_rows is _wire.span_proto_rows              # the agent's way is the C one
    req = _shapes(seed)
    got, want = rows.span_proto_rows(req.resource_spans), rows.python_span_proto_rows(req.resource_spans)
    assert got == want
    assert [type(v) for r in got for v in r] == [type(v) for r in want for v in r]
    # a resource's rows share its one dict (the envelope's groups go by it)
    at = 0
    for rs in req.resource_spans:
        n = sum(len(ss.spans) for ss in rs.scope_spans)
        assert len({id(r[2]) for r in got[at:at + n]}) <= 1
        at += n


@pytest.mark.parametrize("seed", range(24))
def test_the_native_block_of_rows_in_any_order_and_form_stores_the_python_rows(backend, seed):
    from spanlet import _wire
    assert span_protos._trace_native is _wire.trace_native         # the agent's way is the C one
    rnd = random.Random(seed)
    req = _shapes(seed)
    proto_rows = rows.span_proto_rows(req.resource_spans)
    if seed % 4 == 1:
        rnd.shuffle(proto_rows)                                   # groups interleaved
    elif seed % 4 == 2:                                           # back from the spool: a dict a row
        proto_rows = decode_batch(encode_batch("otel_traces", rows.SPAN_PROTO_COLUMNS, proto_rows))[2]
    elif seed % 4 == 3:
        proto_rows = [tuple(r) if i % 2 else collections.deque(r) for i, r in enumerate(proto_rows)]
    backend.insert("otel_traces", rows.SPAN_PROTO_COLUMNS, proto_rows)
    backend.insert("reference", rows.TRACE_COLUMNS, rows.span_rows(req.resource_spans))
    assert _stored(backend, "otel_traces") == _stored(backend, "reference")


def test_plain_doubles_are_stored_as_pcommon_writes_them(backend):
    """Doubles of every magnitude the C block writes itself (plain ones: 0 and
    1e-4 up to 1e15), their shortest digits without an exponent or a trailing
    point, against rows._go_float."""
    rnd = random.Random(21)
    req = ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    values = [0.0, -0.0, 1e-4, -1e-4, 0.1, 1.0, 100.0, 1e14, 999999999999999.9, 123456789.125, 2.0 ** -13]
    values += [rnd.uniform(1, 10) * 10.0 ** rnd.randint(-4, 14) * rnd.choice((1, -1)) for _ in range(400)]
    values += [struct.unpack("d", struct.pack("Q", rnd.getrandbits(64)))[0] for _ in range(2000)]
    values = [v for v in values if v == 0 or 1e-4 <= abs(v) < 1e15]
    for i in range(0, len(values), 8):
        s = ss.spans.add(name="d", trace_id=rnd.randbytes(16), span_id=rnd.randbytes(8),
                         start_time_unix_nano=T0, end_time_unix_nano=T0 + 1)
        for j, v in enumerate(values[i:i + 8]):
            s.attributes.add(key=f"d{j}").value.double_value = v
    assert _python_rows(req) == 0
    got, want = _both_ways(backend, req)
    assert got == want
    stored = [v for r in got for v in dict(r[11]).values()]
    assert sorted(stored) == sorted(rows._go_float(v) for v in values)


@pytest.mark.parametrize("case", ["a name sent as a varint", "a status twice", "a value twice",
                                  "a field numbered 0", "a resource value not a str", "a scope not a str"])
def test_rows_not_of_the_otlp_shape_go_the_python_way(backend, case):
    """What the C block does not read as the OTLP proto declares it (another
    wire type, a singular message twice, field 0) or whose resource or scope
    is not texts is left to the Python way, which stores what a parse of the
    span gives."""
    from opentelemetry.proto.trace.v1 import trace_pb2
    span = trace_pb2.Span(name="x", trace_id=b"t" * 16, span_id=b"s" * 8, start_time_unix_nano=T0,
                          end_time_unix_nano=T0 + 9)
    span.attributes.add(key="k").value.string_value = "v"
    blob, res, scope = span.SerializeToString(), {"service.name": "svc"}, "scope"
    if case == "a name sent as a varint":
        blob += b"\x28\x01"                                     # field 5 (name), wire type 0
    elif case == "a status twice":
        blob += b"\x7a\x02\x18\x02" + b"\x7a\x03\x12\x01m"   # code Error, then message 'm': merged
    elif case == "a value twice":
        blob += b"\x4a\x0b\x0a\x01j\x12\x02\x18\x05\x12\x02\x18\x07"   # key j, value 5 then value 7
    elif case == "a field numbered 0":
        blob += b"\x00\x00"
    elif case == "a resource value not a str":
        res = {"service.name": "svc", "n": 3}
    else:
        scope = None
    row = [blob, False, res, "svc", scope, ""]
    data, skip = span_protos.native([row])
    assert data is None and skip == [0]
    if case in ("a status twice", "a value twice", "a name sent as a varint"):
        parsed = trace_pb2.Span.FromString(blob)
        backend.insert("otel_traces", rows.SPAN_PROTO_COLUMNS, [row])
        backend.insert("reference", rows.TRACE_COLUMNS,
                       [rows._span_row(parsed, "svc", res, scope, "")])
        got = _stored(backend, "otel_traces")
        assert got == _stored(backend, "reference") and len(got) == 1
        if case == "a status twice":
            assert got[0][13:15] == ("Error", "m")
        if case == "a value twice":
            assert dict(got[0][11])["j"] == "7"


def test_the_c_rows_read_a_scope_after_its_spans_and_refuse_malformed_bytes():
    from opentelemetry.proto.trace.v1 import trace_pb2

    from spanlet import _wire
    span = trace_pb2.Span(name="x", trace_id=b"t" * 16, span_id=b"s" * 8)
    span.events.add(name="e")
    scope = trace_pb2.ScopeSpans(scope={"name": "late", "version": "2"}).SerializeToString()
    spans = trace_pb2.ScopeSpans(spans=[span, trace_pb2.Span(name="y")]).SerializeToString()
    blob = b"\x12" + varint(len(spans + scope)) + spans + scope      # ResourceSpans.scope_spans
    assert rows.python_span_proto_rows([trace_pb2.ResourceSpans.FromString(blob)]) == [
        [span.SerializeToString(), True, {}, "", "late", "2"],
        [trace_pb2.Span(name="y").SerializeToString(), False, {}, "", "late", "2"]]
    assert _wire.span_proto_rows(blob, {}, "") == rows.python_span_proto_rows([trace_pb2.ResourceSpans.FromString(blob)])
    for bad in (blob[:-1], b"\x12\x05ab", b"\xff", b"\x10\x01"):
        with pytest.raises(ValueError):
            _wire.span_proto_rows(bad, {}, "")


@pytest.mark.parametrize("seed", range(8))
def test_rows_from_the_joins_bytes_store_the_joined_spans(backend, seed):
    """The C join's bytes (attributes appended at each span's end, after its
    events, links and status, as native/spanlet_wire.c's join writes them) give
    the rows the Python way makes of the spans parsed from them; a resource
    without bytes is serialized."""
    from opentelemetry.proto.common.v1.common_pb2 import KeyValue
    from opentelemetry.proto.trace.v1 import trace_pb2

    req = _spans(100 + seed, resources=3, scopes=2, per_scope=20, nested=seed % 2 == 0)
    blobs = []
    for rs in req.resource_spans:
        parts = []
        for ss in rs.scope_spans:
            spans = b""
            for s in ss.spans:
                extra = KeyValue(key="kernel.gpu.launches")
                extra.value.int_value = seed + 1
                body = s.SerializeToString() + b"\x4a" + varint(extra.ByteSize()) + \
                    extra.SerializeToString()
                spans += b"\x12" + varint(len(body)) + body
            scope = ss.scope.SerializeToString()
            whole = b"\x0a" + varint(len(scope)) + scope + spans
            parts.append(b"\x12" + varint(len(whole)) + whole)
        blobs.append(b"".join(parts))
    blobs[1] = None
    joined = ExportTraceServiceRequest()
    for rs, blob in zip(req.resource_spans, blobs):
        r = joined.resource_spans.add()
        r.CopyFrom(rs if blob is None else trace_pb2.ResourceSpans.FromString(blob))
        r.resource.CopyFrom(rs.resource)
    proto_rows = rows.span_proto_rows(req.resource_spans, blobs)
    assert rows.rows_from_span_protos(proto_rows) == rows.span_rows(joined.resource_spans)
    backend.insert("otel_traces", rows.SPAN_PROTO_COLUMNS, proto_rows)
    backend.insert("reference", rows.TRACE_COLUMNS, rows.span_rows(joined.resource_spans))
    got, want = _stored(backend, "otel_traces"), _stored(backend, "reference")
    assert len(got) == 120 and got == want
    launches = [dict(r[11]).get("kernel.gpu.launches") for r in got]
    assert launches.count(str(seed + 1)) == 80                   # the spans of the two resources with bytes
