"""A running agent writes enriched spans, kernel events and metric samples into
its embedded ClickHouse (real chdb); read back exactly after it stops."""

from __future__ import annotations

import random
import time

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1 import trace_pb2

import cuda_standin
from spanlet import config
from spanlet.daemon import Daemon
from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend
from otlp_upstream import wait_for

pytestmark = pytest.mark.kernel


def test_agent_writes_spans_events_and_metrics_to_chdb(tmp_path):
    standin = cuda_standin.build(tmp_path / "cuda")
    data = tmp_path / "data"
    cfg = config.load(env={}, overrides=[
        f"data_dir={data}", "tc.enabled=false", "sandbox.enabled=false",
        "gpu.launch_events=all", "window_s=1", "discovery.interval_s=0.2",
        "http_port=0", "otlp.grpc_port=0", "otlp.http_port=0", "store.batch_interval_s=0.2"])
    rnd = random.Random(3)
    now = time.time_ns()
    spans = [(rnd.randbytes(16), rnd.randbytes(8), now - 7_123_456_789 + i) for i in range(5)]
    with cuda_standin.Workload(standin.workload) as w:
        w.load(standin.lib_dir)
        agent = Daemon(cfg)
        agent.check_node()
        agent.start()
        try:
            gpu = next(p for p in agent.probes if p.name == "gpu_launch")
            wait_for(lambda: sum(l.pid == w.pid for l in gpu.libraries()) == 1, 5, "GPU probe")
            w.run("cu 6 2 1 1 32 1 1 0 0")
            req = ExportTraceServiceRequest()
            ss = req.resource_spans.add().scope_spans.add()
            for trace, sid, start in spans:
                s = ss.spans.add(trace_id=trace, span_id=sid, name="infer",
                                 kind=trace_pb2.Span.SPAN_KIND_SERVER,
                                 start_time_unix_nano=start, end_time_unix_nano=start + 1_000_003)
                s.attributes.add(key="mm.modality").value.string_value = "text"
            stub = trace_service_pb2_grpc.TraceServiceStub(
                grpc.insecure_channel(f"127.0.0.1:{agent.spans.receiver.grpc_port}"))
            # Merges stopped, reads plain (no FINAL, no OPTIMIZE): a merge of the
            # ReplacingMergeTree would remove a duplicate by itself and hide a
            # store whose insert deduplication is broken.
            store = agent.store.sink.backend
            store.ensure_schema()                     # the sink's own start may not have run yet
            store.query("SYSTEM STOP MERGES spanlet.otel_traces")
            stored = lambda: store.query("SELECT count() FROM spanlet.otel_traces")[0][0]  # noqa: E731
            stub.Export(req)
            wait_for(lambda: stored() == len(spans), 20, "the first export stored")
            stub.Export(req)                          # a retried export, its own insert
            wait_for(lambda: agent.store.sink.stats()["rows_written"] >= 2 * len(spans) + 6, 20,
                     "the retried export's rows sent to the store")
            assert stored() == len(spans)             # one copy: the engine dropped the retried block
            time.sleep(1.5)                           # a window closes: metric samples
        finally:
            agent.stop()
    db = ChdbBackend(str(data / "chdb"))
    try:
        db.query("SYSTEM STOP MERGES spanlet.otel_traces")
        got = db.query("SELECT TraceId, SpanId, toUnixTimestamp64Nano(Timestamp), Duration, "
                       "SpanKind, SpanAttributes['mm.modality'] FROM spanlet.otel_traces "
                       "ORDER BY Timestamp")
        assert got == [(t.hex(), s.hex(), start, 1_000_003, "Server", "text")
                       for t, s, start in spans]
        launches = db.query("SELECT count(), min(Grid[1]), max(Block[1]) FROM spanlet.kernel_events "
                            f"WHERE Kind = 'GPU_LAUNCH' AND Pid = {w.pid}")
        assert launches == [(6, 2, 32)]
        samples = db.query("SELECT max(Value) FROM spanlet.metric_samples "
                           "WHERE MetricName = 'spanlet_gpu_kernel_launches_total' "
                           "AND Labels['api'] = 'driver'")
        assert samples[0][0] >= 6
    finally:
        db.close()
