"""Upstream OTLP metric export: against a real gRPC MetricsService and an
OTLP/HTTP /v1/metrics endpoint made here, known Families arrive with exact
values, bounds, attributes, units and temporality; retries deliver once;
the METRICS_ forms of the OTEL_EXPORTER_OTLP_* variables resolve as specified."""

from __future__ import annotations

import gzip
import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import AGGREGATION_TEMPORALITY_CUMULATIVE

from spanlet.config import OtlpConfig
from spanlet.metrics import Family, HistogramSample, Sample, labels
from spanlet.exporters.otlp.upstream import GRPC, HTTP_PROTOBUF, resolve_metrics_upstream
from loopback_http import LoopbackHttp, QuietHandler
from spanlet.exporters.otlp.metric_exporter import OtlpMetricsExporter, families_to_request, otlp_unit

BACKOFF_S = 0.05
NOW_NS = 1_700_000_000_123_456_789
E = "OTEL_EXPORTER_OTLP_"


def families() -> list[Family]:
    return [
        Family("spanlet_network_bytes_total", "counter", "Bytes seen by the TC classifier", "bytes", [
            Sample(labels(direction="ingress", protocol="http2", modality="text"), 1500.0),
            Sample(labels(direction="egress", protocol="rtp", modality="audio"), 42.0)]),
        Family("spanlet_gpu_kernel_launches_total", "counter", "GPU kernel launches", "", [
            Sample(labels(pod="vllm-0", modality="text", api="driver"), 7)]),
        Family("spanlet_gpu_utilization_ratio", "gauge", "SM utilisation 0..1", "ratio", [
            Sample(labels(gpu="0"), 0.75)]),
        Family("spanlet_request_duration_seconds", "histogram", "Duration of server root spans",
               "seconds", [HistogramSample(labels(modality="text", slo_class="gold"),
                                           (0.1, 0.5, 1.0), (3, 2, 0, 1), 2.95, 6)]),
        Family("spanlet_modality_degradations_total", "counter", "Modality fallbacks", "", []),
    ]


POINTS = 5      # data points in families(): 2 + 1 + 1 + 1, the empty family has none


def attrs(kvs) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in kvs}


def metrics_by_name(request: ExportMetricsServiceRequest) -> dict:
    (rm,) = request.resource_metrics
    (sm,) = rm.scope_metrics
    return {m.name: m for m in sm.metrics}


# ---------------------------------------------------------------------------
# collectors made by the test: a script of answers, then OK

UNAVAILABLE, INVALID = "unavailable", "invalid"
_GRPC_ANSWER = {UNAVAILABLE: grpc.StatusCode.UNAVAILABLE, INVALID: grpc.StatusCode.INVALID_ARGUMENT}
_HTTP_ANSWER = {UNAVAILABLE: 503, INVALID: 400}


class _Collector:
    def __init__(self, script) -> None:
        self.script = list(script)        # UNAVAILABLE, INVALID or an ExportMetricsServiceResponse
        self.lock = threading.Lock()
        self.calls: list[float] = []
        self.accepted: list[ExportMetricsServiceRequest] = []
        self.headers: list[dict] = []

    def answer(self, request: ExportMetricsServiceRequest, headers: dict):
        """The scripted answer: a failure name, or the response of an accepted request."""
        with self.lock:
            self.calls.append(time.monotonic())
            self.headers.append(headers)
            step = self.script.pop(0) if self.script else ExportMetricsServiceResponse()
            if isinstance(step, ExportMetricsServiceResponse):
                self.accepted.append(request)
            return step


class GrpcCollector(_Collector):
    protocol = GRPC

    def __init__(self, script) -> None:
        super().__init__(script)
        outer = self

        class Servicer(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):   # noqa: N802 (gRPC name)
                step = outer.answer(request, dict(context.invocation_metadata()))
                if not isinstance(step, ExportMetricsServiceResponse):
                    context.abort(_GRPC_ANSWER[step], "scripted")
                return step

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def close(self) -> None:
        self.server.stop(0)


class HttpCollector(_Collector, LoopbackHttp):
    protocol = HTTP_PROTOBUF

    def __init__(self, script) -> None:
        _Collector.__init__(self, script)
        outer = self

        class Handler(QuietHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path != "/v1/metrics":
                    return self.reply(404)
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportMetricsServiceRequest.FromString(body)
                step = outer.answer(request, {k.lower(): v for k, v in self.headers.items()})
                if isinstance(step, ExportMetricsServiceResponse):
                    self.reply(200, step.SerializeToString())
                else:
                    self.reply(_HTTP_ANSWER[step])

        LoopbackHttp.__init__(self, Handler)


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    # requests and grpc read proxies from the process environment.
    monkeypatch.setenv("NO_PROXY", "*")
    monkeypatch.setenv("no_proxy", "*")


@pytest.fixture
def collector():
    made = []

    def make(protocol: str, script=()) -> _Collector:
        c = GrpcCollector(script) if protocol == GRPC else HttpCollector(script)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()


@pytest.fixture
def exporter():
    """exporter(collector_or_None, environ=..., cfg=..., **kw) -> OtlpMetricsExporter, shut down after.
    The collector's base URL goes in OTEL_EXPORTER_OTLP_ENDPOINT with its METRICS_PROTOCOL."""
    made = []

    def make(col: _Collector | None = None, environ: dict | None = None, cfg: dict | None = None,
             **kw) -> OtlpMetricsExporter:
        env = {}
        if col is not None:
            env = {E + "ENDPOINT": f"http://127.0.0.1:{col.port}", E + "METRICS_PROTOCOL": col.protocol}
        kw.setdefault("initial_backoff_s", BACKOFF_S)
        kw.setdefault("interval_s", 60.0)
        e = OtlpMetricsExporter(OtlpConfig(**(cfg or {})), environ={**env, **(environ or {})}, **kw)
        made.append(e)
        return e

    try:
        yield make
    finally:
        for e in made:
            e.shutdown(timeout_millis=2000)


def wait_until(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# ---------------------------------------------------------------------------
# what arrives

@pytest.mark.parametrize("protocol,compression", [(GRPC, "none"), (GRPC, "gzip"),
                                                  (HTTP_PROTOBUF, "none"), (HTTP_PROTOBUF, "gzip")])
def test_families_arrive_with_exact_values(collector, exporter, protocol, compression):
    col = collector(protocol)
    e = exporter(col, node="node-a", environ={
        E + "METRICS_COMPRESSION": compression,
        E + "HEADERS": "x-tenant=red,other=1", E + "METRICS_HEADERS": "x-tenant=blue",
        E + "TRACES_ENDPOINT": "http://127.0.0.1:1/v1/traces", E + "TRACES_PROTOCOL": "grpc"})
    assert e.upstream.protocol == protocol
    assert e.export(families(), now_ns=NOW_NS) is True

    (request,) = col.accepted
    assert len(col.calls) == 1
    assert col.headers[0]["x-tenant"] == "blue" and "other" not in col.headers[0]
    (rm,) = request.resource_metrics
    assert attrs(rm.resource.attributes) == {
        "service.name": "spanlet", "service.instance.id": "node-a",
        "host.name": "node-a", "k8s.node.name": "node-a"}
    assert rm.scope_metrics[0].scope.name == "spanlet"
    m = metrics_by_name(request)
    assert list(m) == ["spanlet_network_bytes_total", "spanlet_gpu_kernel_launches_total",
                       "spanlet_gpu_utilization_ratio", "spanlet_request_duration_seconds"]
    start = e.start_time_unix_nano
    assert 0 < start < time.time_ns()

    net = m["spanlet_network_bytes_total"]
    assert (net.unit, net.description) == ("By", "Bytes seen by the TC classifier")
    assert net.WhichOneof("data") == "sum"
    assert net.sum.is_monotonic is True
    assert net.sum.aggregation_temporality == AGGREGATION_TEMPORALITY_CUMULATIVE
    assert [(attrs(p.attributes), p.as_double, p.start_time_unix_nano, p.time_unix_nano)
            for p in net.sum.data_points] == [
        ({"direction": "ingress", "modality": "text", "node": "node-a", "protocol": "http2"},
         1500.0, start, NOW_NS),
        ({"direction": "egress", "modality": "audio", "node": "node-a", "protocol": "rtp"},
         42.0, start, NOW_NS)]

    launches = m["spanlet_gpu_kernel_launches_total"]
    assert launches.unit == "" and launches.sum.is_monotonic
    (p,) = launches.sum.data_points
    assert (p.as_double, attrs(p.attributes)) == (
        7.0, {"api": "driver", "modality": "text", "node": "node-a", "pod": "vllm-0"})

    util = m["spanlet_gpu_utilization_ratio"]
    assert (util.unit, util.WhichOneof("data")) == ("1", "gauge")
    (p,) = util.gauge.data_points
    assert (p.as_double, p.time_unix_nano, p.start_time_unix_nano) == (0.75, NOW_NS, 0)
    assert attrs(p.attributes) == {"gpu": "0", "node": "node-a"}

    dur = m["spanlet_request_duration_seconds"]
    assert (dur.unit, dur.WhichOneof("data")) == ("s", "histogram")
    assert dur.histogram.aggregation_temporality == AGGREGATION_TEMPORALITY_CUMULATIVE
    (p,) = dur.histogram.data_points
    assert list(p.explicit_bounds) == [0.1, 0.5, 1.0]
    assert list(p.bucket_counts) == [3, 2, 0, 1]           # per bucket, the last is > 1.0
    assert (p.count, p.sum) == (6, 2.95)
    assert (p.start_time_unix_nano, p.time_unix_nano) == (start, NOW_NS)
    assert attrs(p.attributes) == {"modality": "text", "node": "node-a", "slo_class": "gold"}

    st = e.stats()
    assert (st["exported"], st["failed"], st["retries"], st["requests_exported"]) == (POINTS, 0, 0, 1)


def test_periodic_export_reads_the_source_each_interval(collector, exporter):
    col = collector(GRPC)
    reads = []

    def source() -> list[Family]:
        reads.append(len(reads) + 1)
        return [Family("spanlet_events_read_total", "counter", "Records", "",
                       [Sample(labels(probe="tc"), 100 * len(reads))])]

    e = exporter(col, source=source, interval_s=0.2)
    wait_until(lambda: len(col.accepted) >= 3)
    e.shutdown(timeout_millis=5000)
    values, starts, times = [], set(), []
    for request in col.accepted:
        (p,) = metrics_by_name(request)["spanlet_events_read_total"].sum.data_points
        values.append(p.as_double)
        starts.add(p.start_time_unix_nano)
        times.append(p.time_unix_nano)
    # every read was exported once, in order (the last one at shutdown)
    assert values == [100.0 * k for k in reads]
    assert starts == {e.start_time_unix_nano}              # one cumulative stream
    assert times == sorted(times) and len(set(times)) == len(times)
    (p,) = metrics_by_name(col.accepted[0])["spanlet_events_read_total"].sum.data_points
    assert attrs(p.attributes) == {"probe": "tc"}           # no node known: none added


def test_force_flush_collects_and_exports_now(collector, exporter):
    col = collector(HTTP_PROTOBUF)
    e = exporter(col, source=families, node="n1")          # the interval is a minute away
    assert col.calls == []
    assert e.force_flush(10000) is True
    assert len(col.accepted) == 1
    assert e.force_flush(10000) is True
    assert len(col.accepted) == 2 and e.stats()["exported"] == 2 * POINTS


# ---------------------------------------------------------------------------
# retries and final answers

@pytest.mark.parametrize("protocol", [GRPC, HTTP_PROTOBUF])
def test_unavailable_twice_then_ok_is_delivered_once(collector, exporter, protocol):
    col = collector(protocol, [UNAVAILABLE, UNAVAILABLE])
    e = exporter(col)
    assert e.export(families(), now_ns=NOW_NS) is True
    assert len(col.calls) == 3 and len(col.accepted) == 1
    assert metrics_by_name(col.accepted[0])["spanlet_gpu_utilization_ratio"] \
        .gauge.data_points[0].as_double == 0.75
    st = e.stats()
    assert (st["exported"], st["failed"], st["retries"]) == (POINTS, 0, 2)
    assert (st["requests_exported"], st["requests_failed"]) == (1, 0)
    for k, (delay, gap) in enumerate(zip(e.retry_delays, [b - a for a, b in zip(col.calls, col.calls[1:])])):
        nominal = BACKOFF_S * 2 ** k                       # the span exporter's backoff plan
        assert 0.8 * nominal <= delay <= 1.2 * nominal, (k, delay)
        assert gap >= 0.8 * delay, (k, gap, delay)


@pytest.mark.parametrize("protocol", [GRPC, HTTP_PROTOBUF])
def test_a_final_refusal_is_not_retried(collector, exporter, protocol):
    col = collector(protocol, [INVALID])
    e = exporter(col)
    assert e.export(families()) is False
    assert len(col.calls) == 1 and col.accepted == []
    st = e.stats()
    assert (st["exported"], st["failed"], st["retries"], st["requests_failed"]) == (0, POINTS, 0, 1)


@pytest.mark.parametrize("protocol", [GRPC, HTTP_PROTOBUF])
def test_partial_success_counts_the_rejected_points(collector, exporter, protocol):
    partial = ExportMetricsServiceResponse()
    partial.partial_success.rejected_data_points = 2
    partial.partial_success.error_message = "2 points too old"
    col = collector(protocol, [partial])
    e = exporter(col)
    assert e.export(families()) is True
    st = e.stats()
    assert len(col.calls) == 1
    assert (st["exported"], st["rejected_upstream"], st["retries"]) == (POINTS - 2, 2, 0)


def test_retries_of_one_snapshot_end_at_the_next_interval(collector, exporter):
    col = collector(GRPC, [UNAVAILABLE] * 100)
    e = exporter(col, interval_s=0.5, cfg={"max_retry_s": 60})
    t0 = time.monotonic()
    assert e.export(families()) is False
    assert time.monotonic() - t0 < 5
    assert col.calls[-1] - col.calls[0] < 0.5
    st = e.stats()
    assert (st["failed"], st["exported"]) == (POINTS, 0)
    assert st["retries"] == len(col.calls) - 1 >= 1


def test_a_failing_source_costs_one_export_not_the_worker(collector, exporter):
    col = collector(GRPC)
    calls = []

    def source():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("probe map gone")
        return families()

    e = exporter(col, source=source)
    assert e.force_flush(10000) is True
    assert col.calls == [] and e.stats()["source_errors"] == 1
    assert e.force_flush(10000) is True
    assert len(col.accepted) == 1 and e.stats()["exported"] == POINTS


# ---------------------------------------------------------------------------
# shutdown, disabled

def test_shutdown_exports_once_more_and_is_safe_twice(collector, exporter):
    col = collector(HTTP_PROTOBUF)
    e = exporter(col, source=families)
    e.shutdown(timeout_millis=10000)
    assert len(col.accepted) == 1                         # the last collection went out
    assert not e._worker.thread.is_alive()
    e.shutdown(timeout_millis=10000)
    assert len(col.calls) == 1
    assert e.export(families()) is False                   # after shutdown: refused
    assert e.force_flush(100) is True
    assert e.stats()["exported"] == POINTS


def test_shutdown_deadline_bounds_retrying(collector, exporter):
    col = collector(GRPC, [UNAVAILABLE] * 1000)
    e = exporter(col, source=families)
    t0 = time.monotonic()
    e.shutdown(timeout_millis=500)
    assert time.monotonic() - t0 < 2.5
    assert not e._worker.thread.is_alive() and len(col.calls) >= 1
    st = e.stats()
    assert (st["exported"], st["failed"], st["dropped_shutdown"]) == (0, 0, POINTS)


def test_no_endpoint_means_disabled_without_a_thread(exporter):
    before = {t.name for t in threading.enumerate()}
    read = []
    e = exporter(environ={E + "TRACES_ENDPOINT": "http://col:4318"},    # not a metrics endpoint
                 source=lambda: read.append(1) or families())
    assert e.enabled is False and e.upstream is None and e._worker is None
    assert "otlp-metrics-export" not in {t.name for t in threading.enumerate()} - before
    assert e.export(families()) is True
    assert e.force_flush(10) is True
    e.shutdown()
    e.shutdown()
    assert read == []
    st = e.stats()
    assert st["enabled"] is False and st["exported"] == st["failed"] == 0


def test_nothing_to_send_sends_nothing(collector, exporter):
    col = collector(GRPC)
    e = exporter(col)
    assert e.export([Family("spanlet_x_total", "counter", "x", "", [])]) is True
    assert e.export([]) is True
    assert col.calls == []


# ---------------------------------------------------------------------------
# conversion details

def test_units_names_and_node_from_labels():
    assert [otlp_unit(u) for u in ("seconds", "bytes", "ratio", "", "bytes_per_seconds", "packets")] \
        == ["s", "By", "1", "", "By/s", "packets"]
    fams = [Family("spanlet_a_total", "counter", "a", "", [Sample(labels(node="n7", pod="p"), 1)]),
            Family("spanlet_h_seconds", "histogram", "h", "seconds", [
                HistogramSample((), (1.0, 2.0), (1, 1), 1.5, 2),          # one bucket short
                HistogramSample((), (1.0,), (0, 2), 5.0, 2),
                Sample((), 3.0)]),                                         # not a histogram
            Family("spanlet_g_ratio", "gauge", "g", "ratio", [HistogramSample((), (), (1,), 1.0, 1)]),
            Family("spanlet_s", "summary", "s", "", [Sample((), 1.0)])]
    request, points = families_to_request(fams, start_ns=10, now_ns=20)
    assert points == 2
    assert attrs(request.resource_metrics[0].resource.attributes)["k8s.node.name"] == "n7"
    m = metrics_by_name(request)
    assert list(m) == ["spanlet_a_total", "spanlet_h_seconds"]       # _total kept (spec default)
    assert attrs(m["spanlet_a_total"].sum.data_points[0].attributes) == {"node": "n7", "pod": "p"}
    (p,) = m["spanlet_h_seconds"].histogram.data_points                # the malformed ones left out
    assert (list(p.bucket_counts), p.sum) == ([0, 2], 5.0)


# ---------------------------------------------------------------------------
# where to send: config, then the METRICS_ forms, then the generic variables

@pytest.mark.parametrize("cfg,env,expected", [
    ({}, {}, None),
    ({}, {E + "ENDPOINT": " "}, None),                                        # empty is unset
    ({}, {E + "TRACES_ENDPOINT": "http://col:4318/v1/traces"}, None),         # not for metrics
    ({}, {E + "ENDPOINT": "http://col:4318"},
     dict(protocol=HTTP_PROTOBUF, endpoint="http://col:4318/v1/metrics", insecure=True)),
    ({}, {E + "ENDPOINT": "https://col:4318/base/"},
     dict(endpoint="https://col:4318/base/v1/metrics", insecure=False)),
    ({}, {E + "ENDPOINT": "http://col:4318/v1/traces"},
     dict(endpoint="http://col:4318/v1/traces/v1/metrics")),                 # generic: always appended
    ({}, {E + "ENDPOINT": "http://a:1", E + "METRICS_ENDPOINT": "http://col:4318/custom"},
     dict(endpoint="http://col:4318/custom")),                               # METRICS form as-is
    ({}, {E + "METRICS_ENDPOINT": "http://col:4318/v1/traces"},
     dict(endpoint="http://col:4318/v1/traces")),                            # ... even this
    ({}, {E + "ENDPOINT": "http://a:4318", E + "TRACES_ENDPOINT": "http://t:4318/v1/traces"},
     dict(endpoint="http://a:4318/v1/metrics")),
    ({}, {E + "PROTOCOL": "http/protobuf", E + "METRICS_PROTOCOL": "grpc", E + "ENDPOINT": "http://col:4317/"},
     dict(protocol=GRPC, endpoint="col:4317", insecure=True)),
    ({}, {E + "TRACES_PROTOCOL": "grpc", E + "ENDPOINT": "http://col:4318"},
     dict(protocol=HTTP_PROTOBUF, endpoint="http://col:4318/v1/metrics")),   # TRACES_ ignored
    ({}, {E + "METRICS_PROTOCOL": "grpc", E + "METRICS_ENDPOINT": "col:4317", E + "METRICS_INSECURE": "true",
          E + "INSECURE": "false"}, dict(endpoint="col:4317", insecure=True)),
    ({}, {E + "METRICS_PROTOCOL": "grpc", E + "ENDPOINT": "col:4317", E + "TRACES_INSECURE": "true"},
     dict(insecure=False)),
    ({}, {E + "ENDPOINT": "http://c:1", E + "HEADERS": "a=1,b=2", E + "METRICS_HEADERS": "Only=Metrics%20x",
          E + "TRACES_HEADERS": "t=1"}, dict(headers=(("only", "Metrics x"),))),
    ({"upstream_headers": {"X": "cfg"}}, {E + "ENDPOINT": "http://c:1", E + "METRICS_HEADERS": "x=env,y=2"},
     dict(headers=(("x", "cfg"), ("y", "2")))),
    ({}, {E + "ENDPOINT": "http://c:1", E + "TIMEOUT": "500", E + "METRICS_TIMEOUT": "750",
          E + "TRACES_TIMEOUT": "100"}, dict(timeout_s=0.75)),
    ({"upstream_timeout_s": 7}, {E + "ENDPOINT": "http://c:1", E + "METRICS_TIMEOUT": "2500"},
     dict(timeout_s=7)),
    ({}, {E + "ENDPOINT": "http://c:1", E + "METRICS_COMPRESSION": "gzip", E + "COMPRESSION": "none"},
     dict(compression="gzip")),
    ({}, {E + "ENDPOINT": "https://c:1", E + "METRICS_CERTIFICATE": "/etc/m.pem",
          E + "TRACES_CERTIFICATE": "/etc/t.pem", E + "CLIENT_KEY": "/etc/k.pem"},
     dict(certificate="/etc/m.pem", client_key="/etc/k.pem")),
    ({"upstream_endpoint": "http://cfg:4317", "upstream_protocol": "grpc"},
     {E + "METRICS_ENDPOINT": "http://env:4318", E + "METRICS_PROTOCOL": "http/protobuf"},
     dict(protocol=GRPC, endpoint="cfg:4317")),                              # config wins
    ({"upstream_endpoint": "http://cfg:4318"}, {E + "METRICS_ENDPOINT": "http://env:4318/m"},
     dict(endpoint="http://cfg:4318/v1/metrics")),
    ({"upstream_endpoint": "https://cfg/otlp/v1/traces"}, {}, dict(endpoint="https://cfg/otlp/v1/metrics")),
    ({"upstream_endpoint": "https://cfg/otlp/ingest"}, {}, dict(endpoint="https://cfg/otlp/ingest")),
    ({"upstream_endpoint": "cfg:4318"}, {E + "METRICS_INSECURE": "true"},
     dict(endpoint="http://cfg:4318/v1/metrics")),
])
def test_endpoint_resolution_metrics_forms(cfg, env, expected):
    up = resolve_metrics_upstream(OtlpConfig(**cfg), env)
    if expected is None:
        assert up is None
        return
    for key, value in expected.items():
        assert getattr(up, key) == value, key
