"""What the agent has → rows of the store's tables: OTLP ResourceSpans →
otel_traces (as the OpenTelemetry Collector's ClickHouse exporter writes
them), decoded kernel events → kernel_events, metric Families →
metric_samples. Values follow schema.py's conventions (DateTime64 as int ns)."""

from __future__ import annotations

import base64
import json
import math
import struct
from decimal import Decimal
from itertools import repeat
from operator import attrgetter
from typing import Any, Callable, Iterable, Mapping, Sequence

from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet import events

try:
    from spanlet._wire import span_proto_rows as _wire_rows
except ImportError:        # a source tree without its build: the rows made in Python
    _wire_rows = None

# ---------------------------------------------------------------------------
# otel_traces

TRACE_COLUMNS = (
    "Timestamp", "TraceId", "SpanId", "ParentSpanId", "TraceState", "SpanName", "SpanKind",
    "ServiceName", "ResourceAttributes", "ScopeName", "ScopeVersion", "SpanAttributes",
    "Duration", "StatusCode", "StatusMessage",
    "Events.Timestamp", "Events.Name", "Events.Attributes",
    "Links.TraceId", "Links.SpanId", "Links.TraceState", "Links.Attributes",
)

# The collector's spellings (pdata SpanKind.String / StatusCode.String, what
# its ClickHouse exporter has written since 2024 and its dashboards filter
# on); schema migration 4 rewrites rows stored with the proto enum names.
SPAN_KINDS = {trace_pb2.Span.SPAN_KIND_UNSPECIFIED: "Unspecified", trace_pb2.Span.SPAN_KIND_INTERNAL: "Internal",
              trace_pb2.Span.SPAN_KIND_SERVER: "Server", trace_pb2.Span.SPAN_KIND_CLIENT: "Client",
              trace_pb2.Span.SPAN_KIND_PRODUCER: "Producer", trace_pb2.Span.SPAN_KIND_CONSUMER: "Consumer"}
STATUS_CODES = {trace_pb2.Status.STATUS_CODE_UNSET: "Unset", trace_pb2.Status.STATUS_CODE_OK: "Ok",
                trace_pb2.Status.STATUS_CODE_ERROR: "Error"}


def _go_float(f: float) -> str:
    """strconv.FormatFloat(f, 'f', -1, 64), which pcommon's AsString uses:
    the shortest exact digits, never an exponent."""
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    text = format(Decimal(repr(f)), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def _raw(v: AnyValue) -> Any:
    """pcommon Value.AsRaw, for the JSON of arrays and maps."""
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_raw(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _raw(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    if which is None:
        return None
    return getattr(v, which)


def attribute_string(v: AnyValue) -> str:
    """pcommon Value.AsString: the text the collector stores in the Map."""
    which = v.WhichOneof("value")
    if which == "string_value":
        return v.string_value
    if which == "int_value":
        return str(v.int_value)
    if which == "bool_value":
        return "true" if v.bool_value else "false"
    if which == "double_value":
        return _go_float(v.double_value)
    if which == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    if which in ("array_value", "kvlist_value"):
        # Go's json.Marshal: compact, map keys sorted, no HTML escaping
        # differences that matter for attribute text.
        return json.dumps(_raw(v), separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    return ""


def attributes_map(kvs) -> dict[str, str]:
    """{key: attribute_string(value)}, with the two kinds nearly every
    attribute is (string, int) done inline: this runs for every span and span
    event stored, and the call per attribute cost a third of it."""
    out = {}
    for kv in kvs:
        v = kv.value
        which = v.WhichOneof("value")
        if which == "string_value":
            out[kv.key] = v.string_value
        elif which == "int_value":
            out[kv.key] = str(v.int_value)
        else:
            out[kv.key] = attribute_string(v)
    return out


def _hex_or_empty(raw: bytes) -> str:
    """traceutil.TraceIDToHexOrEmptyString: '' for an empty (all-zero) id."""
    return raw.hex() if raw and any(raw) else ""


def span_rows(resource_spans: Iterable[trace_pb2.ResourceSpans]) -> list[list]:
    """One otel_traces row (in TRACE_COLUMNS order) per span."""
    return _per_span(resource_spans, _span_row)


# The store's own form of otel_traces rows: each span as its serialized
# proto, whether it has events or links, and its resource and scope beside it
# (the dict is shared by the spans of one resource). Making one costs a
# SerializeToString; the embedded store lays these rows out as TRACE_COLUMNS
# in C (span_protos.py), any other backend through rows_from_span_protos.
SPAN_PROTO_COLUMNS = ("SpanProto", "SpanNested", "ResourceAttributes", "ServiceName", "ScopeName",
                      "ScopeVersion")


def span_proto_rows(resource_spans: Iterable[trace_pb2.ResourceSpans],
                    blobs: Sequence[bytes | None] | None = None) -> list[list]:
    """One SPAN_PROTO_COLUMNS row per span: in C from each resource's bytes
    (native/spanlet_wire.c), the same rows as python_span_proto_rows.
    `blobs`: per resource, bytes whose spans are its spans (those the join
    read and wrote: only their resource part may be older), or None where
    the resource is serialized here."""
    if _wire_rows is None:
        return python_span_proto_rows(resource_spans)
    out = []
    for i, rs in enumerate(resource_spans):
        blob = blobs[i] if blobs else None
        res_attrs, service = _resource(rs)
        out.extend(_wire_rows(rs.SerializeToString() if blob is None else blob, res_attrs, service))
    return out


def python_span_proto_rows(resource_spans: Iterable[trace_pb2.ResourceSpans]) -> list[list]:
    """span_proto_rows made span by span from the proto objects."""
    return _per_span(resource_spans, _span_proto_row)


def _per_span(resource_spans: Iterable[trace_pb2.ResourceSpans], make: Callable[..., list]) -> list[list]:
    """make(span, service, resource attributes, scope name, scope version) for each span."""
    out = []
    for rs in resource_spans:
        res_attrs, service = _resource(rs)
        for ss in rs.scope_spans:
            scope_name, scope_version = ss.scope.name, ss.scope.version
            out.extend(make(span, service, res_attrs, scope_name, scope_version) for span in ss.spans)
    return out


def _span_proto_row(span: trace_pb2.Span, service: str, res_attrs: dict[str, str], scope_name: str,
                    scope_version: str) -> list:
    return [span.SerializeToString(), bool(span.events or span.links), res_attrs, service, scope_name,
            scope_version]


def rows_from_span_protos(proto_rows: Iterable[Sequence]) -> list[list]:
    """SPAN_PROTO_COLUMNS rows → the same spans' TRACE_COLUMNS rows."""
    parse = trace_pb2.Span.FromString
    return [_span_row(parse(blob), service, res_attrs, scope_name, scope_version)
            for blob, _, res_attrs, service, scope_name, scope_version in proto_rows]


def _resource(rs: trace_pb2.ResourceSpans) -> tuple[dict[str, str], str]:
    """(the resource's attributes as stored, its service.name)."""
    for kv in rs.resource.attributes:
        if kv.key == "service.name":
            return attributes_map(rs.resource.attributes), kv.value.string_value
    return attributes_map(rs.resource.attributes), ""


def _span_row(span: trace_pb2.Span, service: str, res_attrs: dict[str, str], scope_name: str,
              scope_version: str) -> list:
    start, end = span.start_time_unix_nano, span.end_time_unix_nano
    events, links = span.events, span.links
    return [
        start,
        _hex_or_empty(span.trace_id),
        _hex_or_empty(span.span_id),
        _hex_or_empty(span.parent_span_id),
        span.trace_state,
        span.name,
        SPAN_KINDS.get(span.kind, ""),
        service,
        res_attrs,
        scope_name,
        scope_version,
        attributes_map(span.attributes),
        max(0, end - start),
        STATUS_CODES.get(span.status.code, ""),
        span.status.message,
        [e.time_unix_nano for e in events] if events else [],
        [e.name for e in events] if events else [],
        [attributes_map(e.attributes) for e in events] if events else [],
        [_hex_or_empty(lk.trace_id) for lk in links] if links else [],
        [_hex_or_empty(lk.span_id) for lk in links] if links else [],
        [lk.trace_state for lk in links] if links else [],
        [attributes_map(lk.attributes) for lk in links] if links else [],
    ]


# ---------------------------------------------------------------------------
# kernel_events

KERNEL_EVENT_COLUMNS = (
    "Timestamp", "Kind", "Pid", "Tid", "CgroupId", "TraceId", "SpanId", "Modality",
    "HeaderFlags", "K8sNamespace", "K8sPodName", "K8sContainerName",
    "Api", "Entry", "Func", "Stream", "DurationNs", "Grid", "Block", "SharedMem",
    "Rule", "Action", "Addr", "Len", "PoolMaxBytes", "Prot", "MapFlags", "PoolId", "Fd",
    "SrcAddr", "DstAddr", "SrcPort", "DstPort", "L4Proto", "Ifindex", "Direction",
    "ProtoClass", "Method", "PathHash", "TraceFlags", "RequestBytes", "ResponseBytes",
    "Node",     # schema v2
)
_KE_INDEX = {c: i for i, c in enumerate(KERNEL_EVENT_COLUMNS)}
_KE_DEFAULTS = [0] * len(KERNEL_EVENT_COLUMNS)
for _c in ("Kind", "TraceId", "SpanId", "Modality", "K8sNamespace", "K8sPodName",
           "K8sContainerName", "Api", "Entry", "Rule", "Action", "SrcAddr", "DstAddr",
           "Direction", "ProtoClass", "Node"):
    _KE_DEFAULTS[_KE_INDEX[_c]] = ""
_KE_DEFAULTS[_KE_INDEX["Grid"]] = []
_KE_DEFAULTS[_KE_INDEX["Block"]] = []


def _enum_name(enum_cls, value: int) -> str:
    try:
        return enum_cls(value).name
    except ValueError:
        return str(value)


# Pod of a cgroup: cgroup_id → (namespace, pod, container), or None.
PodResolver = Callable[[int], "tuple[str, str, str] | None"]


def kernel_event_row(ev: events._Event, resolve: PodResolver | None = None,
                     node: str = "") -> list:
    """One kernel_events row (KERNEL_EVENT_COLUMNS order) for a decoded event."""
    d = ev.as_dict()
    row = list(_KE_DEFAULTS)
    ix = _KE_INDEX

    def put(col, value):
        row[ix[col]] = value

    put("Timestamp", d["ts_ns"])
    put("Kind", d["kind"])
    put("Pid", d["pid"])
    put("Tid", d["tid"])
    put("CgroupId", d["cgroup_id"])
    put("TraceId", d["trace_id"] if int(d["trace_id"], 16) else "")
    put("SpanId", d["span_id"] if int(d["span_id"], 16) else "")
    put("Modality", d["modality"])
    put("HeaderFlags", ev.hdr.flags)
    put("Node", node)
    if resolve is not None:
        pod = resolve(d["cgroup_id"])
        if pod:
            put("K8sNamespace", pod[0])
            put("K8sPodName", pod[1])
            put("K8sContainerName", pod[2])
    kind = ev.hdr.kind
    if kind in (events.Kind.GPU_LAUNCH, events.Kind.GPU_SYNC):
        put("Api", _enum_name(events.Api, d["api"]))
        put("Entry", _enum_name(events.Entry, d["entry"]))
        put("Stream", d["stream"])
        put("DurationNs", d["duration_ns"])
        if kind == events.Kind.GPU_LAUNCH:
            put("Func", d["func"])
            put("Grid", list(d["grid"]))
            put("Block", list(d["block"]))
            put("SharedMem", d["shared_mem"])
    elif kind == events.Kind.SANDBOX:
        put("Rule", _enum_name(events.Rule, d["rule"]))
        put("Action", _enum_name(events.Action, d["action"]))
        put("Addr", d["addr"])
        put("Len", d["len"])
        put("PoolMaxBytes", d["pool_max_bytes"])
        put("Prot", d["prot"])
        put("MapFlags", d["flags"])
        put("PoolId", d["pool_id"])
        put("Fd", d["fd"])
    elif "flow" in d:
        flow = d["flow"]
        put("SrcAddr", flow["src"])
        put("DstAddr", flow["dst"])
        put("SrcPort", flow["sport"])
        put("DstPort", flow["dport"])
        put("L4Proto", flow["l4proto"])
        if kind in (events.Kind.HTTP, events.Kind.FLOW):     # seen on an interface, one way
            put("Ifindex", d["ifindex"])
            put("Direction", _enum_name(events.Direction, d["direction"]))
        if kind == events.Kind.HTTP:
            put("Method", d["method"])
            put("PathHash", d["path_hash"])
            put("TraceFlags", d["trace_flags"])
        elif kind == events.Kind.FLOW:
            put("ProtoClass", _enum_name(events.Proto, d["proto_class"]))
        elif kind == events.Kind.HTTP_BYTES:
            req, other = ev.rx_tx()
            put("Direction", _enum_name(events.Direction, d["req_dir"] & 1))
            put("RequestBytes", req)
            put("ResponseBytes", other)
    return row


def kernel_event_rows(evs: Iterable[events._Event], resolve: PodResolver | None = None,
                      node: str = "") -> list[list]:
    return [kernel_event_row(ev, resolve, node) for ev in evs]


# The store's own form of kernel_events rows: each event as its record's
# bytes (the struct the ring buffer carried), its epoch time and where it
# ran. Making one costs a bytes() of the struct; the embedded store reads
# the fields in the engine (kernel_records.py), any other backend through
# rows_from_kernel_records.
KERNEL_RECORD_COLUMNS = ("Record", "EpochNs", "K8sNamespace", "K8sPodName", "K8sContainerName", "Node")
_CGROUP = struct.Struct("<Q")
_CGROUP_AT = events.Header.cgroup_id.offset
_NO_POD = ("", "", "")


def kernel_record_rows(evs: Iterable[events._Event], resolve: PodResolver | None = None,
                       node: str = "") -> list[list]:
    """One KERNEL_RECORD_COLUMNS row per event (`resolve` asked once per cgroup)."""
    pods: dict[int, tuple[str, str, str]] = {}
    cgroup_of = _CGROUP.unpack_from
    out = []
    for ev in evs:
        raw = bytes(ev)
        cgroup = cgroup_of(raw, _CGROUP_AT)[0]
        pod = pods.get(cgroup)
        if pod is None:
            pod = pods[cgroup] = (resolve(cgroup) if resolve is not None else None) or _NO_POD
        out.append([raw, ev.epoch_ns, pod[0], pod[1], pod[2], node])
    return out


def rows_from_kernel_records(record_rows: Iterable[Sequence]) -> list[list]:
    """KERNEL_RECORD_COLUMNS rows → the same events' KERNEL_EVENT_COLUMNS rows."""
    out = []
    for raw, epoch_ns, ns, pod, container, node in record_rows:
        ev = events.from_record(raw, epoch_ns)
        out.append(kernel_event_row(ev, lambda _cgroup: (ns, pod, container), node))
    return out


# ---------------------------------------------------------------------------
# metric_samples

METRIC_COLUMNS = ("Timestamp", "MetricName", "MetricType", "Unit", "Labels", "Value",
                  "Count", "Sum", "Bounds", "BucketCounts")


def metric_rows(families: Iterable, ts_ns: int) -> list[list]:
    """One metric_samples row per series of each Family (agent.metrics), all
    stamped with the window's time `ts_ns`."""
    from spanlet.metrics import HistogramSample

    out = []
    for fam in families:
        for s in fam.samples:
            labels: Mapping[str, str] = {k: str(v) for k, v in sorted(s.labels)}
            if isinstance(s, HistogramSample):
                out.append([ts_ns, fam.name, fam.type, fam.unit, labels, 0.0,
                            int(s.count), float(s.sum), [float(b) for b in s.bounds],
                            [int(c) for c in s.bucket_counts]])
            else:
                out.append([ts_ns, fam.name, fam.type, fam.unit, labels, float(s.value),
                            0, 0.0, [], []])
    return out


# The store's own form of metric_samples rows: each series as the metric
# engine holds it: its family's (time, name, type, unit), one tuple shared by
# the family's rows; its labels as the sample's (name, value) pairs; its value
# (0.0 for a histogram); and a histogram's (count, sum, bounds, bucket
# counts) as given, or None. Making one costs a tuple of attributes, made in
# C; the embedded store lays them out column by column (metric_native.py),
# any other backend through rows_from_metric_series.
METRIC_SERIES_COLUMNS = ("Family", "LabelPairs", "Value", "Histogram")
_HIST_FIELDS = attrgetter("count", "sum", "bounds", "bucket_counts")
_LABELS_FIELD = attrgetter("labels")
_VALUE_FIELD = attrgetter("value")


def metric_series_rows(families: Iterable, ts_ns: int) -> list[tuple]:
    """One METRIC_SERIES_COLUMNS row per series of each Family, all stamped
    with the window's time `ts_ns`."""
    from spanlet.metrics import HistogramSample

    out: list[tuple] = []
    for fam in families:
        samples = fam.samples
        head = (ts_ns, fam.name, fam.type, fam.unit)
        hist = list(map(isinstance, samples, repeat(HistogramSample)))
        if not any(hist):
            out.extend(zip(repeat(head), map(_LABELS_FIELD, samples), map(_VALUE_FIELD, samples), repeat(None)))
        elif all(hist):
            out.extend(zip(repeat(head), map(_LABELS_FIELD, samples), repeat(0.0), map(_HIST_FIELDS, samples)))
        else:
            out.extend((head, s.labels, 0.0, _HIST_FIELDS(s)) if h else (head, s.labels, s.value, None)
                       for s, h in zip(samples, hist))
    return out


def rows_from_metric_series(series_rows: Iterable[Sequence]) -> list[list]:
    """METRIC_SERIES_COLUMNS rows → the same series' METRIC_COLUMNS rows (as metric_rows makes them)."""
    out = []
    for (ts_ns, name, mtype, unit), pairs, value, hist in series_rows:
        labels = {k: str(v) for k, v in sorted(pairs)}
        if hist is None:
            out.append([ts_ns, name, mtype, unit, labels, float(value), 0, 0.0, [], []])
        else:
            count, total, bounds, buckets = hist
            out.append([ts_ns, name, mtype, unit, labels, 0.0, int(count), float(total),
                        [float(b) for b in bounds], [int(c) for c in buckets]])
    return out
