"""Per-coroutine spans on the stack production servers run: FastAPI under
uvicorn on uvloop, with the real OpenTelemetry FastAPI instrumentation, zero
code (`opentelemetry-instrument`) and explicit. Eight requests at a time
interleave on the one event loop, each launching its own number of stand-in
kernels one per step, while a thread of the same process launches outside any
span all along: every request's server span reaches the agent's upstream with
exactly its own launches, round after round."""

from __future__ import annotations

import contextlib
import http.client
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from otlp_upstream import Upstream, exporting_agent, kernel_attrs, wait_for
from processes import free_port, stop_process

pytestmark = pytest.mark.kernel
ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"
BIN = Path(sys.executable).parent
TOGETHER = 8            # requests in flight at once on the loop
ROUNDS = 20


@pytest.fixture(scope="module")
def agent():
    with exporting_agent("sched.enabled=true") as a:
        yield a


class Server:
    """asgi_app.py in MODE, its "served" lines collected."""

    def __init__(self, mode: str, agent_port: int, libcuda: Path):
        self.port = free_port()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OTEL_", "SPANLET_")) and k != "PYTHONPATH"}
        env.update({"OTEL_SERVICE_NAME": f"asgi-{mode}", "OTEL_TRACES_EXPORTER": "otlp",
                    "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
                    "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                    "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{agent_port}",
                    "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "50", "FLOOD": "1"})
        prefix = [str(BIN / "opentelemetry-instrument")] if mode == "zero-code" else []
        self.proc = subprocess.Popen([*prefix, sys.executable, str(SUPPORT / "asgi_app.py"), mode,
                                      str(self.port), str(libcuda)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.lines.get(timeout=60).startswith("listening")
        wait_for(self._accepts, 60, "uvicorn listening")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def _accepts(self) -> bool:
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            c.connect()
            c.close()
            return True
        except OSError:
            return False

    def round(self, number: int) -> dict[tuple[str, str], int]:
        """TOGETHER requests at once (request i launches 2 + i kernels):
        (trace hex, span hex) of each server span -> its launches."""
        errors = []

        def get(i: int) -> None:
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
                c.request("GET", f"/infer/{2 + i}?together={TOGETHER}&round={number}")
                r = c.getresponse()
                r.read()
                c.close()
                assert r.status == 200, r.status
            except Exception as e:       # noqa: BLE001 (reported below)
                errors.append(e)
        threads = [threading.Thread(target=get, args=(i,)) for i in range(TOGETHER)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors, errors
        served = [self.lines.get(timeout=30).split() for _ in range(TOGETHER)]
        assert all(w[0] == "served" for w in served), served
        return {(w[1], w[2]): int(w[3]) for w in served}

    def close(self) -> None:
        stop_process(self.proc, 10)


def launches_upstream(up: Upstream, expected: dict) -> dict:
    wait_for(lambda: all(k in up.by_ids for k in expected), 30, "the server spans upstream")
    with up.lock:
        return {k: [kernel_attrs(s).get("kernel.gpu.launches", 0) for s in up.by_ids[k]] for k in expected}


@contextlib.contextmanager
def server(mode: str, agent, standin, tmp_path):
    d, up = agent
    libcuda = standin.copy_libs(tmp_path / "lib") / "libcuda.so.1"
    s = Server(mode, d.spans.receiver.grpc_port, libcuda)
    try:
        yield s, up
    finally:
        s.close()


@pytest.mark.parametrize("mode", ["zero-code", "explicit"])
def test_each_request_on_uvloop_gets_exactly_its_own_launches(agent, standin, tmp_path, mode):
    with server(mode, agent, standin, tmp_path) as (s, up):
        rounds = iter(range(10_000))

        def exact_round() -> bool:      # until the agent attached to this process's libraries
            expected = s.round(next(rounds))
            return launches_upstream(up, expected) == {k: [n] for k, n in expected.items()}
        wait_for(exact_round, 60, "a round with every span's launches")
        wrong = []
        for _ in range(ROUNDS):
            expected = s.round(next(rounds))
            got = launches_upstream(up, expected)
            assert len(expected) == TOGETHER and sorted(expected.values()) == list(range(2, 2 + TOGETHER))
            wrong += [(k, n, got[k]) for k, n in expected.items() if got[k] != [n]]
        assert not wrong, wrong
        with up.lock:   # the server spans are FastAPI's: SERVER kind, the route's name
            span, _ = up.spans[next(iter(expected))[1]]
            anatomy = [kernel_attrs(up.spans[k[1]][0]) for k in expected]
        assert span.kind == 2 and span.name == "GET /infer/{n}"
        # each request's own steps ran on a CPU (request anatomy)
        assert all(a.get("kernel.sched.cpu_ns", 0) > 0 for a in anatomy), anatomy
