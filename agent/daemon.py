"""The `spanlet run` daemon: checks the node, starts every probe (one that fails
is reported while the others run), reads their ring buffers, refreshes
discovery, and on SIGTERM/SIGINT detaches everything within the deadline."""

from __future__ import annotations

import importlib
import logging
import signal
import threading
import time
from typing import Callable

from agent import events, kernel
from agent.config import Config
from agent.probes.base import Probe, ProbeStatus

log = logging.getLogger("spanlet")

# (config section, module, class): the order is the start order; the span
# context owner comes first so the others can share its map.
PROBES = [
    ("tc", "agent.probes.tc", "TcProbe"),
    ("sandbox", "agent.probes.sandbox", "SandboxProbe"),
    ("gpu", "agent.probes.gpu", "GpuProbe"),
]


def probe_classes(cfg: Config) -> list[type[Probe]]:
    """The probe classes enabled in the config, the span-context owner first."""
    from agent.probes.span_ctx import SpanCtxProbe

    classes: list[type[Probe]] = [SpanCtxProbe]
    for section, module, cls in PROBES:
        if getattr(cfg, section).enabled:
            classes.append(getattr(importlib.import_module(module), cls))
    return classes


class Daemon:
    def __init__(self, cfg: Config, sink: Callable[[events._Event], None] | None = None):
        self.cfg = cfg
        self.clock = events.MonotonicClock()
        self.sink = sink or (lambda ev: None)
        self.probes: list[Probe] = []
        self.stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stopped = False

    # -- start-up ----------------------------------------------------------------
    def check_node(self) -> kernel.Headers:
        """Root, mounts and headers; raises kernel.EnvironmentProblem."""
        kernel.require_root()
        kernel.require_mounts()
        headers = kernel.find_headers(self.cfg.kernel_headers)
        kernel.apply_headers(headers)
        log.info("kernel headers: %s", headers.resolved)
        return headers

    def start(self) -> list[ProbeStatus]:
        owner, *rest = [cls(self.cfg, sink=self.sink, clock=self.clock)
                        for cls in probe_classes(self.cfg)]
        statuses = [owner.start()]
        self.probes.append(owner)
        for probe in rest:
            statuses.append(probe.start(shared_span_ctx=owner.status.attached))
            self.probes.append(probe)
        for st in statuses:
            if st.attached:
                extra = f" ({len(st.failed_attachments)} failed: " \
                        f"{'; '.join(st.failed_attachments)})" if st.failed_attachments else ""
                log.info("probe %s attached: %d attachment(s)%s", st.name, len(st.attachments), extra)
            else:
                log.error("probe %s NOT attached: %s", st.name, st.reason)
        for probe in self.probes:
            if probe.status.attached:
                t = threading.Thread(target=self._read_loop, args=(probe,),
                                     name=f"reader-{probe.name}", daemon=True)
                t.start()
                self._threads.append(t)
        t = threading.Thread(target=self._refresh_loop, name="refresh", daemon=True)
        t.start()
        self._threads.append(t)
        return statuses

    # -- loops -------------------------------------------------------------------
    def _read_loop(self, probe: Probe) -> None:
        while not self.stopping.is_set():
            try:
                probe.poll(100)
            except Exception:
                log.exception("probe %s: reading its ring buffer failed", probe.name)
                self.stopping.wait(1.0)

    def _refresh_loop(self) -> None:
        interval = self.cfg.discovery.interval_s
        last_stats = time.monotonic()
        while not self.stopping.wait(interval):
            for probe in self.probes:
                if probe.status.attached:
                    try:
                        probe.refresh()
                    except Exception:
                        log.exception("probe %s: refresh failed", probe.name)
            if time.monotonic() - last_stats >= 60:
                last_stats = time.monotonic()
                self.log_stats()

    def log_stats(self) -> None:
        for p in self.probes:
            if p.status.attached:
                log.info("probe %s: %d events read, %d dropped, %d undecodable",
                         p.name, p.events_read, p.events_dropped(), p.decode_errors)

    # -- shutdown ----------------------------------------------------------------
    def stop(self) -> None:
        """Stop polling, detach every probe (span-context owner last); safe twice."""
        if self._stopped:
            return
        self._stopped = True
        self.stopping.set()
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        for probe in reversed(self.probes):
            probe.stop()
        log.info("all probes detached")

    def run_until_signal(self) -> None:
        def on_signal(signum, _frame):
            log.info("received %s, shutting down", signal.Signals(signum).name)
            self.stopping.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        while not self.stopping.wait(0.5):
            pass
        self.stop()
