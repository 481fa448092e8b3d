"""An agent (a Daemon in the test's process) exporting to a stand-in upstream,
attached to the stand-in libcuda, for the span-facts and batched-steps e2e
tests: its children, its self-metrics, a settle of what is late."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from pathlib import Path

from facts_child import FactsChild
from otlp_upstream import Upstream, agent_config, kernel_attrs, wait_for
from spanlet.daemon import Daemon

LATE_SPAN_NAME = "spanlet.kernel.late_events"
SETTLE_S = 0.3


class Agent:
    """The agent (a Daemon in this process) and the upstream it exports to."""

    def __init__(self, daemon: Daemon, upstream: Upstream, libcuda: Path):
        self.daemon, self.upstream, self.libcuda = daemon, upstream, libcuda
        self.endpoint = f"127.0.0.1:{daemon.spans.receiver.grpc_port}"

    @property
    def facts(self):
        """The reader of the kernel's span facts map."""
        return self.daemon.probes.span_ctx.facts

    def child(self, processor: str = "batch") -> FactsChild:
        return FactsChild(self.endpoint, self.libcuda, processor)

    def wait_attached(self) -> None:
        """The probes attach once per library file (a uprobe is on the inode, for
        every process): once the marker is attached and the GPU probe has seen
        this child's libcuda (self.libcuda, maybe a new copy), every child is traced."""
        span_ctx, gpu = self.daemon.probes.span_ctx, self.daemon.probes.gpu
        with self.child() as first:
            wait_for(lambda: span_ctx.libraries and any(l.pid == first.pid for l in gpu.libraries()), 30,
                     "the agent to attach to a child")

    def metric(self, pred) -> float | None:
        """The sum of the agent's self-metric samples that pred(name, labels) picks, None if none."""
        found = None
        for fam in self.daemon.registry.collect():
            for sample in fam.samples:
                if pred(sample.name, sample.labels):
                    found = (found or 0.0) + sample.value
        return found

    def settle(self) -> None:
        """What is late goes out now, and everything queued reaches the upstream. The
        wait first lets the readers (100 ms polls) and the refresh loop (every
        discovery.interval_s) pass at least once after the spans came; then one
        sweep of the span facts map, forced, finds every row that came late."""
        time.sleep(SETTLE_S)
        self.daemon.spans.join.sweep(force=True)
        self.daemon.spans.tick()
        assert self.daemon.spans.exporter.force_flush(10_000)

    def arrived(self, expected: dict) -> dict:
        """(trace, span) → the kernel.gpu.launches of each span received with those ids,
        once every expected span arrived."""
        up = self.upstream
        wait_for(lambda: all(k in up.by_ids for k in expected), 30, "the spans upstream")
        with up.lock:
            return {k: [kernel_attrs(s).get("kernel.gpu.launches", 0) for s in up.by_ids[k]]
                    for k in expected}

    def late_records(self, expected: dict) -> list:
        """(ids, kernel attributes) of the late records received for any of these spans."""
        with self.upstream.lock:
            return [(k, kernel_attrs(s)) for k, spans in self.upstream.by_ids.items() for s in spans
                    if s.name == LATE_SPAN_NAME and (k[0], s.parent_span_id.hex()) in expected]


@contextlib.contextmanager
def running_agent(libcuda: Path, *overrides: str):
    """An agent in this process exporting to a fresh upstream, attached to `libcuda`;
    stopped at the end, and its pin folder removed whatever its stop did."""
    up = Upstream()
    up.rx.start()
    private = Path(tempfile.mkdtemp(prefix="spanlet-facts-e2e-"))   # its admin socket: not the node's
    d = Daemon(agent_config(up, "otlp.batch_interval_s=0.05", "http_port=0", "http_address=127.0.0.1",
                            f"admin_socket={private / 'admin.sock'}", *overrides))
    d.check_node()
    d.start()
    a = Agent(d, up, libcuda)
    pin_dir = d.probes[0].pin_dir            # the span context owner starts first
    try:
        a.wait_attached()
        yield a
    finally:
        try:
            d.stop()
            a.pins_left = pin_dir.exists()
        finally:
            shutil.rmtree(pin_dir, ignore_errors=True)
            shutil.rmtree(private, ignore_errors=True)
            up.rx.stop()
