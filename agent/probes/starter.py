"""The probes' start, begun as early as the agent can: the node checked, then
every probe compiled and attached in a thread of its own while the rest of
the agent is imported and built (a BCC compile runs in libbcc without the
GIL). The span-context owner is started first and whole (the others share
its pinned maps); the others' compiles that the compile cache does not hold
begin first, each in a process of its own, beside the owner's (BCC compiles
one module at a time in a process: base.BCC_LOCK), and each is then loaded
in the order those processes end and attached by whoever takes it
(finish()), beside the next one's load. compiles_done is set when no compile runs in this process any more."""

from __future__ import annotations

import importlib
import logging
import queue
import threading
import time

from spanlet import events
from spanlet.config import Config
from spanlet.probes import compile_cache, node_check, privileges
from spanlet.probes.base import Probe, ProbeStatus

log = logging.getLogger("spanlet")
ASIDE_POLL_S = 0.005   # how often the compile thread looks for an ended compiling process

# (config section, module, class): the order is the start order; the span
# context owner comes first so the others can share its map.
PROBES = [
    ("tc", "spanlet.probes.tc.probe", "TcProbe"),
    ("sandbox", "spanlet.probes.sandbox.probe", "SandboxProbe"),
    ("gpu", "spanlet.probes.gpu", "GpuProbe"),
]


def probe_classes(cfg: Config) -> list[type[Probe]]:
    """The probe classes enabled in the config, the span-context owner first."""
    from spanlet.probes.span_ctx import SpanCtxProbe

    classes: list[type[Probe]] = [SpanCtxProbe]
    for section, module, cls in PROBES:
        if getattr(cfg, section).enabled:
            classes.append(getattr(importlib.import_module(module), cls))
    return classes


def check_node(cfg: Config) -> node_check.Headers:
    """Root, mounts and headers; raises node_check.EnvironmentProblem."""
    node_check.require_root()
    node_check.require_mounts()
    headers = node_check.find_headers(cfg.kernel_headers, cfg.image_kernel_headers)
    node_check.apply_headers(headers)
    log.info("kernel headers: compiling against the %s", headers.describe())
    privs = privileges.check(tc_enabled=cfg.tc.enabled)
    log.info("%s", privs.summary())
    for line in privs.missing_lines():
        log.error("%s", line)
    return headers


class ProbeStarter:
    """The enabled probes, made and started by begin() in a thread and taken,
    attached, by finish(), in start order. Their events go to the sink given
    to finish() (no record is read before the daemon's readers start)."""

    def __init__(self, cfg: Config, clock: events.MonotonicClock | None = None) -> None:
        self.cfg = cfg
        self.clock = clock or events.MonotonicClock()
        self.probes: list[Probe] = []      # made so far, in start order
        self._compiled: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._taken: list[Probe] | None = None
        # set when no compile runs in this process any more: BCC chdir()s the
        # process into the headers folder while it compiles, and what else
        # the process starts meanwhile must not depend on its directory
        self.compiles_done = threading.Event()
        # set once the compiles in processes of their own are begun (or none
        # is): the agent's imports wait for it, so that those processes start
        # while the second core is still idle, not behind the imports (GIL)
        self.aside_begun = threading.Event()
        self._aside_jobs: dict[Probe, tuple] = {}   # probe → its job in compile_aside
        self._aside_at = 0.0                         # when compile_aside began them

    def begin(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._compile_all, name="compile", daemon=True)
            self._thread.start()

    def _compile_all(self) -> None:
        # this thread's compiles read two lines of /proc/kallsyms, not the node's table
        if not compile_cache.own_kallsyms_in_this_thread():
            log.debug("the compiles read the node's /proc/kallsyms")
        try:
            from spanlet.probes.span_ctx import SpanCtxProbe

            owner = SpanCtxProbe(self.cfg, clock=self.clock)   # its module first: the first compile
            self.probes.append(owner)
            rest = [cls(self.cfg, clock=self.clock) for cls in probe_classes(self.cfg)[1:]]
            self._compile_aside(owner, rest)
            self.aside_begun.set()
            self._run(owner, owner.start)   # compiled and attached here (finish() skips it)
            self.probes += rest
            for probe in rest:
                finder = getattr(probe, "finder", None)
                if finder is not None and owner.maps_watch is not None:
                    finder.watch = owner.maps_watch.subscribe()   # discovery from the kernel's changes
            pin_dir = owner.shared_pin_dir()
            pending = list(rest)
            while pending:
                probe = self._next_compiled(pending)
                pending.remove(probe)
                self._run(probe, lambda: probe.start_compile(pin_dir=pin_dir))
        except BaseException as e:  # a probe that could not be made: finish() raises it
            self._error = e
        finally:
            if self.cfg.compile_cache:
                compile_cache.cache_of(self.cfg).abandon_aside()
            self.aside_begun.set()
            self.compiles_done.set()
            self._compiled.put(None)

    def _next_compiled(self, pending: list[Probe]) -> Probe:
        """The first of `pending` (in start order) whose compile no longer runs
        in a process of its own: each is loaded and attached as soon as it can
        be, not behind a longer compile (TC's, on a node with the cores to run
        them all side by side)."""
        if not self._aside_jobs:
            return pending[0]
        cache = compile_cache.cache_of(self.cfg)
        deadline = self._aside_at + compile_cache.ASIDE_TIMEOUT_S   # then its compile() ends it
        while time.monotonic() < deadline:
            for probe in pending:
                job = self._aside_jobs.get(probe)
                if job is None or not cache.aside_running(*job):
                    return probe
            time.sleep(ASIDE_POLL_S)
        return pending[0]

    def _compile_aside(self, owner, rest: list[Probe]) -> None:
        """The compiles of the probes after the owner that the compile cache
        does not hold, begun in processes of their own while the owner
        compiles here (compile_cache.compile_aside): with the flags they
        will have once the owner is attached, its pin folder among them."""
        if not self.cfg.compile_cache or not rest:
            return
        try:
            jobs = {}
            for probe in rest:
                flags = probe.compile_flags(str(owner.pin_dir))
                jobs[probe] = (probe.source_text(), flags, compile_cache.pin_templates(flags))
            begun = compile_cache.cache_of(self.cfg).compile_aside(list(jobs.values()), owner.pin_dir.parent)
            self._aside_jobs, self._aside_at = jobs, time.monotonic()
        except Exception:        # each probe still compiles as without it
            log.exception("compiles in processes of their own: not begun")
            return
        if begun:
            log.info("%d probe compile(s) begun in processes of their own", begun)

    def _run(self, probe: Probe, step) -> None:
        try:
            ok = bool(step())
        except Exception as e:   # a bug in one probe's start: that probe only
            log.exception("probe %s: start", probe.name)
            probe.status.attached, probe.status.reason = False, f"start: {e}"
            ok = False
        self._compiled.put((probe, ok))

    def finish(self, sink=None) -> list[Probe]:
        """Every probe, in start order, each attached here once compiled
        (the owner in the thread already) or reported. Raises only what kept
        a probe from being made at all (after the others were taken)."""
        if self._taken is None:
            self.begin()
            self._taken = []
            while (item := self._compiled.get()) is not None:
                probe, ok = item
                probe.sink = sink
                if ok and self._taken:
                    probe.finish_start()
                self._taken.append(probe)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._taken

    def abandon(self) -> None:
        """For a start that fails before finish(): every probe stopped once
        its compile has ended (TC filters and pins removed)."""
        try:
            self.finish()
        finally:
            for probe in self.probes:
                probe.stop()

    def statuses(self) -> list[ProbeStatus]:
        return [p.status for p in self.probes]
