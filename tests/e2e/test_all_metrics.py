"""All 17 metrics of METRICS.md through their real paths, read back from a
real Prometheus server: kernel traffic (GPU stand-in launches, UDP media in a
test namespace, a sandbox violation), NVML (a stand-in libnvidia-ml built
here), and OTLP spans sent to the agent's receiver, over several windows."""

from __future__ import annotations

import json
import random
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1 import trace_pb2

import cuda_standin
from spanlet import config
from spanlet.daemon import Daemon
from spanlet.demo.standin import build_nvml
from netns import linked, socket_in
from otlp_upstream import wait_for
from processes import free_port
from prometheus_server import Prometheus

pytestmark = pytest.mark.kernel
METRICS = [
    "spanlet_gpu_kernel_launches_total", "spanlet_gpu_sync_wait_seconds_count",
    "spanlet_network_bytes_total", "spanlet_jitter_sensitivity_score",
    "spanlet_sandbox_violations_total", "spanlet_gpu_utilization_ratio",
    "spanlet_gpu_memory_peak_ratio", "spanlet_gpu_pcie_utilization_ratio",
    "spanlet_request_duration_seconds_count", "spanlet_time_to_first_token_seconds_count",
    "spanlet_p99_latency_volatility_ratio", "spanlet_slo_compliance_ratio",
    "spanlet_throughput_decay_ratio", "spanlet_modality_alignment_delay_seconds_count",
    "spanlet_modality_degradations_total", "spanlet_embedding_drift_score",
    "spanlet_span_kernel_coverage_ratio",
]


def attr(span, key, value):
    kv = span.attributes.add(key=key)
    if isinstance(value, str):
        kv.value.string_value = value
    elif isinstance(value, float):
        kv.value.double_value = value
    elif isinstance(value, list):
        for x in value:
            kv.value.array_value.values.add().double_value = x
    else:
        kv.value.int_value = value


def window_spans(rnd: random.Random, durations_ms: list[float], embed_shift: float):
    req = ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    now = time.time_ns()
    for ms in durations_ms:                              # requests (#9 #10 #12 #13)
        s = ss.spans.add(name="infer", trace_id=rnd.randbytes(16), span_id=rnd.randbytes(8),
                         kind=trace_pb2.Span.SPAN_KIND_SERVER,
                         start_time_unix_nano=now - int(ms * 1e6), end_time_unix_nano=now)
        s.events.add(name="first_token", time_unix_nano=now - int(ms * 1e6) + 50_000_000)
        attr(s, "mm.modality", "audio")
        attr(s, "slo.class", "gold")
        attr(s, "gen_ai.request.model", "model-a")
        attr(s, "gen_ai.usage.output_tokens", 100)
    trace = rnd.randbytes(16)                            # audio/video pair (#14)
    for modality, pts in (("audio", 1_000_000_000), ("video", 1_050_000_000)):
        s = ss.spans.add(name="decode", trace_id=trace, span_id=rnd.randbytes(8),
                         kind=trace_pb2.Span.SPAN_KIND_INTERNAL,
                         parent_span_id=rnd.randbytes(8), start_time_unix_nano=now - 1000,
                         end_time_unix_nano=now)
        attr(s, "mm.modality", modality)
        attr(s, "mm.pts_ns", pts)
    s = ss.spans.add(name="ocr", trace_id=rnd.randbytes(16), span_id=rnd.randbytes(8),
                     kind=trace_pb2.Span.SPAN_KIND_INTERNAL, start_time_unix_nano=now - 1000,
                     end_time_unix_nano=now)
    attr(s, "mm.degraded_from", "vision")                # (#15)
    attr(s, "mm.degraded_to", "ocr_text")
    for modality, vec in (("image", [1.0, embed_shift, 0.0]), ("text", [1.0, 0.0, 0.2])):
        s = ss.spans.add(name="embed", trace_id=rnd.randbytes(16), span_id=rnd.randbytes(8),
                         kind=trace_pb2.Span.SPAN_KIND_INTERNAL, start_time_unix_nano=now - 1000,
                         end_time_unix_nano=now)
        attr(s, "mm.modality", modality)                 # (#16)
        attr(s, "mm.embedding", vec)
    return req


@pytest.fixture
def nets():
    with linked("spanlet-am", "ama0", "169.254.97.1", "amb0", "169.254.97.2") as pair:
        yield pair


def test_all_17_metrics_reach_prometheus(tmp_path, nets):
    a, b = nets
    pool_dir = Path(f"/dev/shm/tensor_pool_all_{secrets.token_hex(4)}")
    pool_dir.mkdir()
    standin = cuda_standin.build(tmp_path / "cuda")
    nvml = build_nvml(tmp_path / "nvml")
    port = free_port()
    cfg = config.load(env={}, overrides=[
        f"tc.netns={b.name}", "tc.interfaces=amb0", "tc.port_modality={5004: audio}",
        "tc.jss_window_s=30", f"sandbox.prefixes=[{pool_dir}/]", f"nvml.library={nvml}",
        "nvml.poll_interval_s=0.2", "window_s=1", "discovery.interval_s=0.2",
        "serving.peak_tokens_per_s={model-a: 1000}", "http_address=127.0.0.1",
        f"http_port={port}", "store.enabled=false", "otlp.grpc_port=0", "otlp.http_port=0"])
    agent = prom = None
    try:
        with cuda_standin.Workload(standin.workload) as w:
            w.load(standin.lib_dir)
            agent = Daemon(cfg)
            agent.check_node()
            agent.start()
            prom = Prometheus(tmp_path, f"127.0.0.1:{port}")
            # the window gauges (#11-#13, #16) show the last window only: every
            # window must fall after Prometheus began to scrape
            prom.wait_scraped()
            gpu = next(p for p in agent.probes if p.name == "gpu_launch")
            # the driver only: the runtime is looked for only with gpu.runtime_hooks
            wait_for(lambda: sum(l.pid == w.pid for l in gpu.libraries()) == 1, 5, "GPU probe")
            # the span marker is not in this test: launches are counted without spans
            w.run("cu 4 1 1 1 1 1 1 0 0", "cusync 2000")
            tx = socket_in(a.name, socket.AF_INET, socket.SOCK_DGRAM)
            for i in range(30):                          # audio by port: media jitter (#4)
                tx.sendto(b"a" * 160, ("169.254.97.2", 5004))
                time.sleep(0.02 if i != 15 else 0.1)
            tx.close()
            (pool_dir / "kv0").write_bytes(b"\0" * 4096)   # a mapping without a grant (#5)
            subprocess.run([sys.executable, "-c", "import mmap, os; fd = os.open(%r, os.O_RDONLY);"
                            " mmap.mmap(fd, 4096, prot=mmap.PROT_READ)" % str(pool_dir / "kv0")],
                           check=True)
            stub = trace_service_pb2_grpc.TraceServiceStub(
                grpc.insecure_channel(f"127.0.0.1:{agent.spans.receiver.grpc_port}"))
            rnd = random.Random(7)
            windows = [[100, 150, 180], [120, 300, 250], [90, 110, 400], [100, 200, 150]]
            for i, durations in enumerate(windows):      # one batch per window
                stub.Export(window_spans(rnd, durations, embed_shift=0.1 * i))
                time.sleep(1.2)
            missing = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                missing = [m for m in METRICS if not prom.query(m)]
                if not missing:
                    break
                time.sleep(0.5)
            assert not missing, f"no series in Prometheus for {missing}"
            # a few exact values through the whole path
            assert prom.value("sum(spanlet_request_duration_seconds_count)") == 12
            assert prom.value("sum(spanlet_modality_degradations_total)") == 4
            assert prom.value("sum(spanlet_modality_alignment_delay_seconds_count)") == 4
            delay = prom.value("sum(spanlet_modality_alignment_delay_seconds_sum)")
            assert abs(delay - 4 * (0.050 - cfg.serving.delta_sync_s)) < 1e-9
            assert prom.value('sum(spanlet_gpu_kernel_launches_total{api="driver"})') == 4
            assert prom.value("sum(spanlet_sandbox_violations_total)") == 1
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                check = subprocess.run(["promtool", "check", "metrics"], input=r.read(),
                                       capture_output=True)
            assert check.returncode == 0 and not (check.stdout + check.stderr).strip(), \
                check.stdout + check.stderr
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/hints", timeout=5) as r:
                served = json.load(r)
            assert set(served["hints"]) == {"audio", "text", "image", "video"}
            hints = agent.scheduler.hints()
            assert set(hints["hints"]) == {"audio", "text", "image", "video"}
            assert prom.query("spanlet_scheduler_batch_size_hint")
    finally:
        if prom is not None:
            prom.stop()
        if agent is not None:
            agent.stop()
        shutil.rmtree(pool_dir, ignore_errors=True)
