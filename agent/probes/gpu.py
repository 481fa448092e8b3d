"""Loader of bpf/gpu_launch.bpf.c: finds the CUDA driver and runtime libraries
in every process (agent/discovery.py), attaches the launch and sync uprobes to
each library file once (by default one entry-only uprobe per driver launch),
and reads the launch counts and sync wait maps."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field

from spanlet import events
from spanlet.config import Config
from spanlet.discovery import LibraryFinder, MappedLibrary
from spanlet.probes.base import EventSink, Probe

log = logging.getLogger(__name__)

# Must match SPANLET_GPU_WAIT_BUCKETS in gpu_launch.bpf.c: bucket i < 2^i us.
WAIT_BUCKETS = 32


@dataclass(frozen=True)
class Hook:
    """One hooked function: its BPF entry program and the return program of
    its family (launch or sync); `driver_launch` marks the hooks that need no
    return program unless launches are timed (gpu.launch_timing)."""

    symbol: str
    entry_fn: str
    return_fn: str
    required: bool = True

    @property
    def driver_launch(self) -> bool:
        return self.symbol.startswith("cuLaunch")


def _hooks(*base: tuple[str, str, str]) -> tuple[Hook, ...]:
    # CUDA also exports a per-thread-default-stream twin (_ptsz) of these
    # calls, with the same arguments; older releases lack some of them.
    out = []
    for sym, entry, ret in base:
        out.append(Hook(sym, entry, ret))
        out.append(Hook(sym + "_ptsz", entry, ret, required=False))
    return tuple(out)


DRIVER_HOOKS = _hooks(
    ("cuLaunchKernel", "gpu_cu_launch_kernel", "gpu_launch_return"),
    ("cuLaunchKernelEx", "gpu_cu_launch_kernel_ex", "gpu_launch_return"),
    ("cuStreamSynchronize", "gpu_cu_stream_sync", "gpu_sync_return"),
)
RUNTIME_LAUNCH_HOOKS = _hooks(
    ("cudaLaunchKernel", "gpu_cuda_launch_kernel", "gpu_launch_return"),
)
# Sync calls are hooked on both layers in every mode: a sync is a wait, and
# its entry and return are the fact (cudaDeviceSynchronize, for one, reaches
# no hooked driver call).
RUNTIME_SYNC_HOOKS = _hooks(
    ("cudaStreamSynchronize", "gpu_cuda_stream_sync", "gpu_sync_return"),
    ("cudaDeviceSynchronize", "gpu_cuda_device_sync", "gpu_sync_return"),
)
RUNTIME_HOOKS = RUNTIME_LAUNCH_HOOKS + RUNTIME_SYNC_HOOKS

CountKey = tuple[int, events.Modality, events.Api]


@dataclass
class AttachedLibrary:
    """A library file the probe is attached to (or tried to)."""

    library: MappedLibrary
    api: events.Api
    hooks: list[Hook] = field(default_factory=list)    # attached
    missing: list[str] = field(default_factory=list)   # required but absent, or refused
    probe_events: list[bytes] = field(default_factory=list)  # BCC's names of its uprobes
    report: str | None = None                          # its entry in failed_attachments
    settled: bool = False                              # every hook tried: nothing in flight

    @property
    def symbols(self) -> list[str]:
        return [h.symbol for h in self.hooks]

    @property
    def pid(self) -> int:
        return self.library.pid

    @property
    def path(self) -> str:
        return self.library.path


def _functions(path: str, hooks: tuple[Hook, ...]) -> dict[str, int]:
    """Address of each hooked symbol the library defines (one pass over its
    symbol tables)."""
    from bcc import BPF

    pattern = "^(" + "|".join(re.escape(h.symbol) for h in hooks) + ")$"
    return {name.decode(): addr for name, addr in
            BPF.get_user_functions_and_addresses(os.fsencode(path), pattern.encode())}


def _where(lib: MappedLibrary) -> str:
    return f"{lib.path} (inode {lib.inode}, pid {lib.pid})"


def _label(lib: MappedLibrary, hook: Hook) -> str:
    return f"{hook.symbol}@{_where(lib)}"


def _modality(v: int) -> events.Modality:
    try:
        return events.Modality(v)
    except ValueError:
        return events.Modality.other


class GpuProbe(Probe):
    name = "gpu_launch"

    def __init__(self, cfg: Config, sink: EventSink | None = None,
                 clock: events.MonotonicClock | None = None, proc: str = "/proc"):
        super().__init__(cfg, sink, clock)
        gpu = cfg.gpu
        self._api_of = {n: events.Api.runtime for n in gpu.runtime_libraries}
        self._api_of.update({n: events.Api.driver for n in gpu.driver_libraries})
        self.finder = LibraryFinder(self._api_of, proc=proc,
                                    full_rescan_s=cfg.discovery.full_rescan_s)
        self._libraries: dict[tuple[int, int], AttachedLibrary] = {}
        self._runtime_hooks = RUNTIME_HOOKS if gpu.runtime_hooks else RUNTIME_SYNC_HOOKS

    def cflags(self) -> list[str]:
        gpu = self.cfg.gpu
        flags = super().cflags()
        if gpu.launch_events == "all":
            flags.append("-DSPANLET_GPU_EVENTS_ALL")
        elif gpu.launch_events == "sampled":
            flags += ["-DSPANLET_GPU_EVENTS_SAMPLED",
                      f"-DSPANLET_GPU_SAMPLED_PER_SPAN={gpu.sampled_events_per_span}"]
        if gpu.launch_timing:
            flags.append("-DSPANLET_GPU_LAUNCH_TIMING")
        if gpu.runtime_hooks:
            flags.append("-DSPANLET_GPU_RUNTIME_HOOKS")
        return flags  # "off": counts and span facts only

    # -- attaching ---------------------------------------------------------------
    def _attach(self) -> None:
        """Attach to the libraries mapped now. None being mapped is not a
        failure: refresh() attaches to libraries as processes load them."""
        self._attach_new()
        if not self._libraries:
            log.info("%s: no process maps %s yet", self.name, ", ".join(self._api_of))

    def refresh(self) -> None:
        """New processes and libraries; libraries no process has mapped for
        discovery.unmapped_grace_s; call records of threads that died inside
        a call (their return probe never ran)."""
        with self._lock:
            if self.bpf is None or not self.status.attached:
                return
            self._attach_new()
            for lib in self.finder.unmapped(self.cfg.discovery.unmapped_grace_s):
                self._detach_library(self._libraries[lib.key])
                log.info("%s: detached from %s: no process maps it any more", self.name, lib.path)
            self._reap_calls()

    def _attach_new(self) -> None:
        for lib in self.finder.refresh():
            try:
                self._attach_library(lib)
            except Exception as e:  # one library must not stop the others
                log.exception("%s: %s", self.name, lib.path)
                self._libraries[lib.key] = att = AttachedLibrary(lib, self._api_of[lib.name])
                att.report = f"{_where(lib)}: {e}"
                att.settled = True
                self.status.failed_attachments.append(att.report)

    def _attach_library(self, lib: MappedLibrary) -> None:
        api = self._api_of[lib.name]
        hooks = DRIVER_HOOKS if api == events.Api.driver else self._runtime_hooks
        att = AttachedLibrary(lib, api)
        self._libraries[lib.key] = att
        try:
            present = _functions(lib.open_path, hooks)
        except Exception as e:  # BCC raises bare Exception
            present, att.missing = {}, [f"symbols unreadable: {e}"]
        hooked_at: set[int] = set()
        for hook in hooks:
            addr = present.get(hook.symbol)
            if addr is None:
                if hook.required:
                    att.missing.append(hook.symbol)
            elif addr not in hooked_at:  # an alias of a hooked function: one probe per address
                names, err = self._attach_hook(lib.open_path, hook)
                att.probe_events += names
                if err is None:
                    hooked_at.add(addr)
                    att.hooks.append(hook)
                    self.status.attachments.append(_label(lib, hook))
                else:
                    att.missing.append(f"{hook.symbol} ({err})")
        if att.missing and not os.path.exists(lib.open_path):
            # The process exited or unmapped it mid-way: not an error; the
            # file is found again if another process maps it.
            self._detach_library(att)
            return
        self._report(att, hooks)
        att.settled = True

    def _report(self, att: AttachedLibrary, hooks: tuple[Hook, ...]) -> None:
        where = _where(att.library)
        if not att.hooks:
            required = ", ".join(h.symbol for h in hooks if h.required)
            att.report = (f"{where}: no CUDA {att.api.name} symbol could be hooked "
                          f"(looked for {required}; missing: {', '.join(att.missing)})")
        elif att.missing:
            att.report = f"{where}: missing {', '.join(att.missing)}"
        else:
            log.info("%s: attached %s to %s", self.name, ", ".join(att.symbols), where)
            return
        self.status.failed_attachments.append(att.report)
        log.warning("%s: %s", self.name, att.report)

    def _needs_return(self, hook: Hook) -> bool:
        # Mirrors SPANLET_GPU_TRACK_LAUNCHES in the C: an untimed driver
        # launch is counted at entry and leaves nothing to clear.
        return not (hook.driver_launch and not self.cfg.gpu.launch_timing)

    def _attach_hook(self, path: str, hook: Hook) -> tuple[list[bytes], str | None]:
        """Attach one function's return then entry probe. Returns BCC's names
        of the probes attached (to detach them by name later, when the path
        may no longer resolve) and None, or why not. The return probe goes
        first so that every call whose entry is seen also has its return seen
        (an entry without a return would leave the thread "inside" a call)."""
        before = set(self.bpf.uprobe_fds)
        path_b, sym = os.fsencode(path), hook.symbol.encode()
        try:
            if self._needs_return(hook):
                self.bpf.attach_uretprobe(name=path_b, sym=sym, fn_name=hook.return_fn.encode())
            self.bpf.attach_uprobe(name=path_b, sym=sym, fn_name=hook.entry_fn.encode())
        except Exception as e:  # BCC raises bare Exception
            self._close_probes(set(self.bpf.uprobe_fds) - before)
            return [], str(e)
        return sorted(set(self.bpf.uprobe_fds) - before), None

    def _close_probes(self, names) -> None:
        for name in names:
            try:
                self.bpf.detach_uprobe_event(name)
            except Exception as e:
                log.debug("%s: detach %r: %s", self.name, name, e)

    def _detach_library(self, att: AttachedLibrary) -> None:
        self._close_probes(att.probe_events)
        for hook in att.hooks:
            self.status.attachments.remove(_label(att.library, hook))
        if att.report in self.status.failed_attachments:
            self.status.failed_attachments.remove(att.report)
        self._libraries.pop(att.library.key, None)
        self.finder.forget(att.library.key)

    def _reap_calls(self) -> None:
        """Delete the call records of threads that no longer exist: a thread
        killed inside a call never reaches its return probe."""
        for name in (b"gpu_launch_calls", b"gpu_sync_calls"):
            table = self.bpf[name]
            for key, call in list(table.items()):
                pid, tid = call.pid_tgid >> 32, call.pid_tgid & 0xFFFFFFFF
                if not os.path.exists(f"{self.finder.proc}/{pid}/task/{tid}"):
                    try:
                        del table[key]
                    except KeyError:
                        pass

    def _detach(self) -> None:
        # BCC's cleanup() closes every uprobe; what remains is our bookkeeping.
        self._libraries.clear()
        self.status.attachments.clear()

    # -- reading -----------------------------------------------------------------
    def libraries(self) -> list[AttachedLibrary]:
        """Every library file whose attaching is over (hooked, or reported),
        with the pid it was first seen in."""
        return [a for a in list(self._libraries.values()) if a.settled]

    def launches(self) -> dict[CountKey, int]:
        """Outermost launch calls per (cgroup id, modality, api)."""
        out: dict[CountKey, int] = {}
        if self.bpf is None:
            return out
        for k, per_cpu in self.bpf[b"spanlet_gpu_kernel_launches_total"].items():
            key = (k.cgroup_id, _modality(k.modality), events.Api(k.api))
            out[key] = out.get(key, 0) + sum(int(v) for v in per_cpu)
        return out

    def sync_wait(self) -> dict[CountKey, tuple[int, int]]:
        """Outermost sync calls per (cgroup id, modality, api): (count, total ns)."""
        return {k: (count, total) for k, (count, total, _) in self._sync_wait().items()}

    def sync_wait_buckets(self) -> dict[CountKey, list[int]]:
        """Sync calls per log2 bucket: index i counts waits shorter than 2^i
        microseconds (and at least 2^(i-1)); the last bucket is unbounded."""
        return {k: buckets for k, (_, _, buckets) in self._sync_wait().items()}

    def _sync_wait(self) -> dict[CountKey, tuple[int, int, list[int]]]:
        out: dict[CountKey, tuple[int, int, list[int]]] = {}
        if self.bpf is None:
            return out
        for k, per_cpu in self.bpf[b"spanlet_gpu_sync_wait_seconds"].items():
            key = (k.cgroup_id, _modality(k.modality), events.Api(k.api))
            count, total, buckets = out.get(key, (0, 0, [0] * WAIT_BUCKETS))
            for v in per_cpu:
                count += v.count
                total += v.sum_ns
                buckets = [b + int(x) for b, x in zip(buckets, v.bucket)]
            out[key] = (count, total, buckets)
        return out
