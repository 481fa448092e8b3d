"""Test helpers for the span path: a stand-in upstream collector (a real OTLP
receiver that keeps what it gets) and a polling wait."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
from pathlib import Path

from spanlet import config
from spanlet.exporters.otlp.receiver import OtlpReceiver


class Upstream:
    """The collector the agent exports to."""

    def __init__(self):
        self.spans: dict[str, tuple] = {}     # span id hex → (span, resource)
        # (trace id hex, span id hex) → every span received with those ids, in order
        self.by_ids: dict[tuple[str, str], list] = {}
        self.lock = threading.Lock()
        self.rx = OtlpReceiver(config.OtlpConfig(grpc_port=0, http_port=0), self.on_request)

    def on_request(self, req, peer=None) -> int:
        n = 0
        with self.lock:
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        self.spans[sp.span_id.hex()] = (sp, rs.resource)
                        self.by_ids.setdefault((sp.trace_id.hex(), sp.span_id.hex()), []).append(sp)
                        n += 1
        return n

    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.rx.grpc_port}"


def agent_config(up: Upstream, *extra: str) -> config.Config:
    """An agent config for the span tests: GPU and span context probes only, no
    store, ports picked by the OS, spans exported to `up` in short batches."""
    return config.load(env={}, overrides=[
        "tc.enabled=false", "sandbox.enabled=false", "discovery.interval_s=0.2",
        "store.enabled=false", "otlp.grpc_port=0", "otlp.http_port=0", "otlp.upstream_protocol=grpc",
        f"otlp.upstream_endpoint={up.endpoint()}", "otlp.batch_interval_s=0.1", *extra])


def kernel_attrs(span) -> dict:
    return {kv.key: kv.value.int_value for kv in span.attributes if kv.key.startswith("kernel.")}


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def exporting_agent(*overrides: str):
    """A whole agent (agent_config's probes) exporting to an Upstream, its admin
    socket in a folder of its own: (daemon, upstream); both stopped after."""
    from spanlet.daemon import Daemon
    up = Upstream()
    up.rx.start()
    private = Path(tempfile.mkdtemp(prefix="spanlet-agent-"))
    d = Daemon(agent_config(up, "otlp.batch_interval_s=0.05", "http_port=0",
                            "http_address=127.0.0.1", f"admin_socket={private / 'admin.sock'}",
                            *overrides))
    d.check_node()
    d.start()
    try:
        yield d, up
    finally:
        d.stop()
        up.rx.stop()
        shutil.rmtree(private, ignore_errors=True)
