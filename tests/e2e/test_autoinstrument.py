"""Zero-code instrumentation: apps that never name spanlet, run under the real
`opentelemetry-instrument` (opentelemetry-distro), get the spanlet processor on
the tracer provider the OTEL_* settings made (spanlet's entry point); their
spans reach the agent with exactly their kernel facts, and a WSGI server behind
the real WSGI instrumentation, called by an instrumented urllib3 client, gets
its requests' wire bytes too. OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=spanlet and
SPANLET_AUTOINSTRUMENT=off turn it off."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netns import Capture, http_request_bytes, linked
from otlp_upstream import Upstream, exporting_agent, kernel_attrs, wait_for

pytestmark = pytest.mark.kernel
ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"
BIN = Path(sys.executable).parent
SERVER, CLIENT, PORT = "169.254.95.2", "169.254.95.1", 8082
RESPONSE_BYTES = 4000


def otel_env(agent_grpc_port: int, service: str, **extra: str) -> dict:
    """The environment of an app run under opentelemetry-instrument: OTLP/gRPC to
    the agent, short batches; no metrics or logs export."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "SPANLET_")) and k != "PYTHONPATH"}
    env.update({"OTEL_SERVICE_NAME": service, "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{agent_grpc_port}",
                "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "50"})
    env.update(extra)
    return env


def instrumented(script: str, *args: str, prefix: tuple[str, ...] = ()) -> list[str]:
    return [*prefix, str(BIN / "opentelemetry-instrument"), sys.executable, str(SUPPORT / script),
            *args]


@pytest.fixture(scope="module")
def nets():
    with linked("spanlet-ai", "aic0", CLIENT, "ais0", SERVER) as pair:
        yield pair


@pytest.fixture(scope="module")
def gpu_agent(nets):
    """One agent for the module (two in one process cannot both attach BCC
    uprobes): GPU and span context probes, TC in the server's namespace."""
    _, server = nets
    with exporting_agent("tc.enabled=true", f"tc.netns={server.name}", "tc.interfaces=ais0") as a:
        yield a


def run_plain(port: int, libcuda: Path, linger_s: float = 0.0, **env: str) -> dict:
    """The plain app once (3 threads x 4 spans, after `linger_s`): (trace, span) -> its launches."""
    out = subprocess.run(instrumented("plain_otel_app.py", str(libcuda), "3", "4", str(linger_s)),
                         env=otel_env(port, "plain-app", **env), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [l.split() for l in out.stdout.splitlines()]
    assert lines[-1] == ["done"], out.stdout
    return {(w[1], w[2]): int(w[3]) for w in lines if w[0] == "span"}


def launches_upstream(up: Upstream, expected: dict) -> dict:
    wait_for(lambda: all(k in up.by_ids for k in expected), 30, "the app's spans upstream")
    with up.lock:
        return {k: [kernel_attrs(s).get("kernel.gpu.launches", 0) for s in up.by_ids[k]]
                for k in expected}


def wait_traced(up: Upstream, port: int, libcuda: Path) -> None:
    """Until the agent has attached to this copy of libcuda and to the marker,
    spans come without facts: plain runs until one has every span's facts.
    Each run waits a discovery round (1 s) before its spans, libraries loaded:
    a run of a fraction of a second can end before discovery reads its maps."""
    def traced() -> bool:
        exp = run_plain(port, libcuda, linger_s=1.2)
        got = launches_upstream(up, exp)
        return all(got[k] == [n] for k, n in exp.items())
    wait_for(traced, 60, "a run with every span's facts")


@pytest.mark.parametrize("run", range(3))
def test_a_plain_app_gets_kernel_facts_without_a_line_of_code(gpu_agent, standin, tmp_path, run):
    d, up = gpu_agent
    # a new copy of the library each run: the GPU probe attaches to it as it appears
    libcuda = standin.copy_libs(tmp_path / "lib") / "libcuda.so.1"
    port = d.spans.receiver.grpc_port
    wait_traced(up, port, libcuda)
    expected = run_plain(port, libcuda)
    assert launches_upstream(up, expected) == {k: [n] for k, n in expected.items()}
    with up.lock:     # OTEL_SERVICE_NAME went to the resource as usual
        _, resource = up.spans[next(iter(expected))[1]]
    assert {kv.key: kv.value.string_value for kv in resource.attributes}["service.name"] == "plain-app"


@pytest.mark.parametrize("off", [{"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "spanlet"},
                                 {"SPANLET_AUTOINSTRUMENT": "off"}], ids=["otel-disabled", "spanlet-off"])
def test_zero_code_can_be_turned_off(gpu_agent, standin, tmp_path, off):
    d, up = gpu_agent
    libcuda = standin.copy_libs(tmp_path / "lib") / "libcuda.so.1"
    port = d.spans.receiver.grpc_port
    wait_traced(up, port, libcuda)
    expected = run_plain(port, libcuda, **off)
    got = launches_upstream(up, expected)
    assert got == {k: [0] for k in expected}, got     # exported, but no processor marked them


def test_the_processor_is_added_to_the_configured_provider_once():
    code = ("from opentelemetry import trace; from spanlet import SpanletSpanProcessor\n"
            "p = trace.get_tracer_provider()\n"
            "print(type(p).__name__, sum(isinstance(x, SpanletSpanProcessor) "
            "for x in p._active_span_processor._span_processors))")
    env = otel_env(1, "x", OTEL_TRACES_EXPORTER="none")
    out = subprocess.run([str(BIN / "opentelemetry-instrument"), sys.executable, "-c", code],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["TracerProvider", "1"], out.stderr
    out = subprocess.run([str(BIN / "opentelemetry-instrument"), sys.executable, "-c", code],
                         env={**env, "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "spanlet"},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["TracerProvider", "0"], out.stderr


@pytest.mark.parametrize("run", range(2))
def test_wsgi_server_spans_from_an_instrumented_urllib3_client_carry_facts_and_wire_bytes(
        nets, gpu_agent, standin, tmp_path, run):
    client, server = nets
    libcuda = standin.copy_libs(tmp_path / "lib") / "libcuda.so.1"
    d, up = gpu_agent
    tc = next(p for p in d.probes if p.name == "tc_classify")
    assert tc.status.attached, tc.status.reason
    port = d.spans.receiver.grpc_port
    srv = subprocess.Popen(
        instrumented("wsgi_app.py", server.name, SERVER, str(PORT), str(libcuda),
                     str(RESPONSE_BYTES)),
        env=otel_env(port, "wsgi-model"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    cap = Capture(server, "ais0")
    try:
        assert srv.stdout.readline().strip() == "listening", srv.stderr.read()
        # the server process is traced (marker and libcuda attached) once
        # a warm-up request's span arrives with its launch
        def client_run(*counts: int) -> str:
            out = subprocess.run(
                instrumented("urllib3_client.py", f"http://{SERVER}:{PORT}", "700",
                             *map(str, counts),
                             prefix=("nsenter", f"--net=/run/netns/{client.name}")),
                env=otel_env(port, "client", OTEL_TRACES_EXPORTER="none"),
                capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            return out.stdout.split()[1]

        def warm() -> bool:
            client_run(1)
            sid = srv.stdout.readline().split()[1]
            srv.stdin.write("flush\n")
            srv.stdin.flush()
            assert srv.stdout.readline().strip() == "flushed"
            wait_for(lambda: sid in up.spans, 10, "the warm-up span")
            return kernel_attrs(up.spans[sid][0]).get("kernel.gpu.launches") == 1
        wait_for(warm, 60, "the agent to trace the WSGI server")
        cap.drain()
        cap.frames.clear()

        counts = (3, 5)
        trace_hex = client_run(*counts)
        served = [srv.stdout.readline().split() for _ in counts]
        time.sleep(0.3)   # the last frames to the capture and the reader
        cap.drain()
        expected = http_request_bytes(cap.frames, PORT)
        assert len(expected) == 2
        srv.stdin.write("flush\n")
        srv.stdin.flush()
        assert srv.stdout.readline().strip() == "flushed"
        wait_for(lambda: all(s[1] in up.spans for s in served), 15, "the server spans upstream")
        for (_, sid, n), (rx, tx) in zip(served, expected):
            span, resource = up.spans[sid]
            assert span.trace_id.hex() == trace_hex      # the client's traceparent
            assert span.kind == span.SPAN_KIND_SERVER
            a = kernel_attrs(span)
            assert a.get("kernel.gpu.launches") == int(n), a
            assert (a["kernel.net.rx_bytes"], a["kernel.net.tx_bytes"]) == (rx, tx), a
    finally:
        srv.kill()
        srv.wait(5)
        cap.close()
