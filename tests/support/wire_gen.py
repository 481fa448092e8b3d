"""Random OTLP spans and resources for the tests of spanlet._wire
(native/spanlet_wire.c), with the oracles the C readings are held to (what
the parsed message says)."""

from __future__ import annotations

import math
import random

from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet.request_totals import _KEYS, TOTALS

T0 = 1_700_000_000_000_000_000
KINDS = list(range(6))


def resource(rng: random.Random, triggers: bool) -> trace_pb2.ResourceSpans:
    rs = trace_pb2.ResourceSpans(resource=resource_pb2.Resource())
    kv = rs.resource.attributes.add(key="k8s.pod.name")
    kv.value.string_value = f"pod-{rng.randrange(3)}"
    for _ in range(rng.randrange(1, 4)):
        ss = rs.scope_spans.add()
        ss.scope.name = "s"
        for _ in range(rng.randrange(0, 40)):
            start = T0 + rng.randrange(10**9)
            sp = ss.spans.add(trace_id=rng.randbytes(16), span_id=rng.randbytes(8), kind=rng.choice(KINDS),
                              parent_span_id=rng.choice([b"", rng.randbytes(8)]),
                              flags=rng.choice([0, 0x100, 0x300]), start_time_unix_nano=start,
                              end_time_unix_nano=start + rng.randrange(1, 10**9),
                              name=rng.choice(["infer", "\x30\x02", "Z" * 11]))
            sp.attributes.add(key="mm.modality").value.string_value = rng.choice(["image", "text", "audio"])
            if triggers and rng.random() < 0.2:
                sp.attributes.add(key="gen_ai.usage.output_tokens").value.int_value = rng.randrange(100)
            if rng.random() < 0.15:
                sp.events.add(name=rng.choice(["first_token", "other"]), time_unix_nano=start + 5)
    return rs


def serving_oracle(rs: trace_pb2.ResourceSpans) -> list[tuple[int, int]]:
    """(scope index, span index) of the spans of SERVER kind or with events."""
    return [(i, j) for i, ss in enumerate(rs.scope_spans) for j, sp in enumerate(ss.spans)
            if sp.kind == trace_pb2.Span.SPAN_KIND_SERVER or len(sp.events)]


N = len(TOTALS)
SUMMED = [b"kernel." + k for k, _ in _KEYS]
OTHER_KEYS = [b"kernel.gpu.launches", b"kernel.request.cpu_ns", b"kernel.request.x", b"kernel.", b"kernel",
              b"http.route", b"kernel.sched.cpu_nsx", b"kernel.request."]


def oracle(span: trace_pb2.Span) -> tuple[list | None, bool]:
    sums, has_totals = [0.0] * N, False
    index = {b"kernel." + k: i for k, i in _KEYS}
    for kv in span.attributes:
        key, kind = kv.key.encode(), kv.value.WhichOneof("value")
        if kind not in ("int_value", "double_value"):
            continue
        x = getattr(kv.value, kind)
        if key.startswith(b"kernel.request.") and len(key) > len(b"kernel.request."):
            has_totals = True
        elif key in index:
            if kind == "int_value" and x >= 0 or kind == "double_value" and 0.0 < x < math.inf:
                sums[index[key]] += x
    return (sums if any(sums) else None), has_totals


def value(rnd: random.Random, kv: common_pb2.KeyValue) -> None:
    kind = rnd.randrange(7)
    if kind == 0:
        kv.value.int_value = rnd.choice([0, 1, 5, 1 << 40, -3, (1 << 63) - 1, -(1 << 63)])
    elif kind == 1:
        kv.value.double_value = rnd.choice([0.0, 0.5, 12.25, -1.0, math.inf, -math.inf, math.nan, 1e300])
    elif kind == 2:
        kv.value.string_value = "12"
    elif kind == 3:
        kv.value.bool_value = True
    elif kind == 4:
        kv.value.bytes_value = b"\x18\x05"
    elif kind == 5:
        kv.value.array_value.values.add().int_value = 4
    # 6: no value


def random_span(rnd: random.Random) -> trace_pb2.Span:
    s = trace_pb2.Span(trace_id=rnd.randbytes(16), span_id=rnd.randbytes(8), name="s")
    for _ in range(rnd.randrange(12)):
        kv = s.attributes.add(key=rnd.choice(SUMMED + OTHER_KEYS).decode())
        value(rnd, kv)
    # the same keys on an event and a link: never read
    ev = s.events.add(name="e")
    ev.attributes.add(key=SUMMED[0].decode()).value.int_value = 1000
    s.links.add(trace_id=rnd.randbytes(16), span_id=rnd.randbytes(8)).attributes.add(
        key="kernel.request.cpu_ns").value.int_value = 7
    return s


def mutate(rnd: random.Random, data: bytes) -> bytes:
    """The bytes with one to three mutations: a bit flipped, a byte set to an
    edge value, a piece cut, inserted or repeated, a length or tag off by one,
    the tail cut (the differential fuzzing's, test_wire_differential.py)."""
    b = bytearray(data)
    for _ in range(rnd.randrange(1, 4)):
        if not b:
            b += rnd.randbytes(rnd.randrange(1, 8))
            continue
        i, op = rnd.randrange(len(b)), rnd.randrange(7)
        if op == 0:
            b[i] ^= 1 << rnd.randrange(8)
        elif op == 1:
            b[i] = rnd.choice((0x00, 0x01, 0x7f, 0x80, 0xff))
        elif op == 2:
            del b[i:i + rnd.randrange(1, 9)]
        elif op == 3:
            b[i:i] = rnd.randbytes(rnd.randrange(1, 9))
        elif op == 4:
            j = rnd.randrange(len(b))
            b[i:i] = b[j:j + rnd.randrange(1, 33)]
        elif op == 5:
            b[i] = (b[i] + rnd.choice((-1, 1))) & 0xff      # a length or a tag off by one
        else:
            del b[i:]
    return bytes(b)
