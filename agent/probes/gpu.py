"""Loader of bpf/gpu_launch.bpf.c: finds the CUDA driver (and, with
gpu.runtime_hooks, runtime) libraries in every process (agent/discovery.py),
attaches the launch, graph and sync uprobes to each library file once (by
default one entry-only uprobe per driver launch entry point), and reads the
launch, graph launch and sync wait maps."""

from __future__ import annotations

import errno
import logging
import os
import re
from dataclasses import dataclass, field

from spanlet import events
from spanlet.config import Config
from spanlet.discovery import LibraryFinder, MappedLibrary
from spanlet.probes import uprobe_multi
from spanlet.probes.base import EventSink, Probe

log = logging.getLogger(__name__)

# Must match SPANLET_GPU_WAIT_BUCKETS in gpu_launch.bpf.c: bucket i < 2^i us.
WAIT_BUCKETS = 32


@dataclass(frozen=True)
class Hook:
    """One hooked function: its BPF entry program (gpu_<symbol>, or `fn` where
    several symbols share one) and the return program it needs, if any.
    `kind` says when the return probe is attached: "launch" (a driver launch:
    only when launches are timed, gpu.launch_timing), "call" (always: runtime
    launches, syncs, and the rare graph calls whose result is read at
    return), "entry" (never)."""

    symbol: str
    return_fn: str = ""
    kind: str = "entry"
    required: bool = False
    fn: str = ""

    @property
    def entry_fn(self) -> str:
        return self.fn or f"gpu_{self.symbol}"


def _twins(sym: str, return_fn: str = "", kind: str = "entry", required: bool = True,
           fn: str = "", twin_fn: str = "") -> tuple[Hook, Hook]:
    # CUDA also exports a per-thread-default-stream twin (_ptsz) of these
    # calls, with the same arguments; older releases lack some of them.
    return (Hook(sym, return_fn, kind, required, fn),
            Hook(sym + "_ptsz", return_fn, kind, False, twin_fn))


LAUNCH, SYNC, GRAPH = "gpu_launch_return", "gpu_sync_return", "gpu_graph_return"
BPF_KPROBE = 2   # BPF_PROG_TYPE_KPROBE (bcc.BPF.KPROBE), the type of uprobe programs
# Every driver entry point that launches (../shared/CUDA.md): one entry-only
# uprobe each, so that a launch is one trap however it was called.
DRIVER_LAUNCH_HOOKS = (
    *_twins("cuLaunchKernel", LAUNCH, "launch"),
    *_twins("cuLaunchKernelEx", LAUNCH, "launch"),
    *_twins("cuLaunchCooperativeKernel", LAUNCH, "launch"),
    Hook("cuLaunch", LAUNCH, "launch"),
    Hook("cuLaunchGrid", LAUNCH, "launch"),
    Hook("cuLaunchGridAsync", LAUNCH, "launch"),
)
# Graph replays (entry only), and how graphs are made: capture and
# instantiation read their result at return (rare calls); nodes added and
# graphs destroyed are entry only.
_BEGIN, _BEGIN_PTSZ, _INST = "gpu_cuStreamBeginCapture", "gpu_cuStreamBeginCapture_ptsz", \
    "gpu_cuGraphInstantiate"
DRIVER_GRAPH_HOOKS = (
    *_twins("cuGraphLaunch"),
    *_twins("cuStreamBeginCapture", GRAPH, "call", required=False),
    *_twins("cuStreamBeginCapture_v2", GRAPH, "call", fn=_BEGIN, twin_fn=_BEGIN_PTSZ),
    Hook("cuStreamBeginCaptureToGraph", GRAPH, "call"),
    *_twins("cuStreamEndCapture", GRAPH, "call"),
    Hook("cuGraphCreate", GRAPH, "call"),
    Hook("cuGraphInstantiate", GRAPH, "call", fn=_INST),
    Hook("cuGraphInstantiate_v2", GRAPH, "call", fn=_INST),
    Hook("cuGraphInstantiateWithFlags", GRAPH, "call", True, fn=_INST),
    *_twins("cuGraphInstantiateWithParams", GRAPH, "call", False, _INST, _INST),
    Hook("cuGraphAddKernelNode", fn="gpu_cuGraphAddKernelNode"),
    Hook("cuGraphAddKernelNode_v2", fn="gpu_cuGraphAddKernelNode"),
    Hook("cuGraphExecDestroy", required=True),
    Hook("cuGraphDestroy", required=True),
)
# The driver's waits: every runtime sync reaches one of them.
DRIVER_SYNC_HOOKS = (
    *_twins("cuStreamSynchronize", SYNC, "call"),
    Hook("cuCtxSynchronize", SYNC, "call", True),
    Hook("cuEventSynchronize", SYNC, "call", True),
)
DRIVER_HOOKS = DRIVER_LAUNCH_HOOKS + DRIVER_GRAPH_HOOKS + DRIVER_SYNC_HOOKS
# gpu.runtime_hooks: the runtime's launches and syncs too (api="runtime"); the
# driver call each makes is then nested and not counted again.
RUNTIME_HOOKS = (
    *_twins("cudaLaunchKernel", LAUNCH, "call"),
    *_twins("cudaLaunchKernelExC", LAUNCH, "call"),
    *_twins("cudaLaunchCooperativeKernel", LAUNCH, "call"),
    *_twins("cudaStreamSynchronize", SYNC, "call"),
    Hook("cudaDeviceSynchronize", SYNC, "call", True),
    Hook("cudaEventSynchronize", SYNC, "call", True),
)

CountKey = tuple[int, events.Modality, events.Api]


@dataclass
class AttachedLibrary:
    """A library file the probe is attached to (or tried to)."""

    library: MappedLibrary
    api: events.Api
    hooks: list[Hook] = field(default_factory=list)    # attached
    missing: list[str] = field(default_factory=list)   # required but absent, or refused
    probe_events: list[bytes] = field(default_factory=list)  # BCC's names of its uprobes
    links: list[int] = field(default_factory=list)     # its uprobe_multi link fds
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


def _close_links(att: AttachedLibrary) -> None:
    while att.links:
        try:
            os.close(att.links.pop())
        except OSError as e:
            log.debug("gpu_launch: close link: %s", e)


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
        # The runtime's files are looked for only when it is hooked: every
        # runtime call reaches the driver's exported functions.
        self._api_of = {n: events.Api.runtime for n in gpu.runtime_libraries} \
            if gpu.runtime_hooks else {}
        self._api_of.update({n: events.Api.driver for n in gpu.driver_libraries})
        self.finder = LibraryFinder(self._api_of, proc=proc,
                                    full_rescan_s=cfg.discovery.full_rescan_s)
        self._libraries: dict[tuple[int, int], AttachedLibrary] = {}
        self._multi = False   # uprobe_multi links (decided at attach)
        self._perf_funcs: dict[bytes, object] = {}   # perf-event copies of programs (fallback)

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
        self._multi = self.cfg.gpu.uprobe_multi and self._multi_supported()
        self._attach_new()
        if not self._libraries:
            log.info("%s: no process maps %s yet", self.name, ", ".join(self._api_of))

    def _multi_supported(self) -> bool:
        """Whether this kernel loads programs for uprobe_multi links (Linux 6.6+)."""
        try:
            self.bpf.load_func(b"gpu_cuLaunchKernel", BPF_KPROBE,
                               attach_type=uprobe_multi.BPF_TRACE_UPROBE_MULTI)
            return True
        except Exception as e:  # BCC raises bare Exception
            log.info("%s: no uprobe_multi links (%s): one perf-event uprobe per hook", self.name, e)
            return False

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
            self._reap_captures()

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
        hooks = DRIVER_HOOKS if api == events.Api.driver else RUNTIME_HOOKS
        att = AttachedLibrary(lib, api)
        self._libraries[lib.key] = att
        try:
            present = _functions(lib.open_path, hooks)
        except Exception as e:  # BCC raises bare Exception
            present, att.missing = {}, [f"symbols unreadable: {e}"]
        hooked_at: set[int] = set()
        todo = []
        for hook in hooks:
            addr = present.get(hook.symbol)
            if addr is None:
                if hook.required:
                    att.missing.append(hook.symbol)
            elif addr not in hooked_at:  # an alias of a hooked function: one probe per address
                hooked_at.add(addr)
                todo.append((hook, addr))
        if self._multi:
            self._attach_links(att, todo)
        else:
            for hook, _ in todo:
                names, err = self._attach_hook(lib.open_path, hook)
                att.probe_events += names
                if err is None:
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

    def _attach_links(self, att: AttachedLibrary, todo: list[tuple[Hook, int]]) -> None:
        """uprobe_multi: one link per program and direction for the whole file
        (the return links first, as _attach_hook orders its probes)."""
        path = att.library.open_path
        try:
            offsets = dict(zip((h.symbol for h, _ in todo),
                               uprobe_multi.file_offsets(path, [a for _, a in todo])))
        except OSError as e:
            att.missing += [f"{h.symbol} ({e})" for h, _ in todo]
            return
        groups: dict[tuple[str, bool], list[Hook]] = {}
        for hook, _ in todo:
            groups.setdefault((hook.entry_fn, False), []).append(hook)
            if self._needs_return(hook):
                groups.setdefault((hook.return_fn, True), []).append(hook)
        failed: dict[str, str] = {}
        for (fn, ret), members in sorted(groups.items(), key=lambda g: not g[0][1]):
            members = [h for h in members if h.symbol not in failed]
            if not members:
                continue
            try:
                prog = self.bpf.load_func(fn.encode(), BPF_KPROBE,
                                          attach_type=uprobe_multi.BPF_TRACE_UPROBE_MULTI)
                att.links.append(uprobe_multi.link(prog.fd, path, [offsets[h.symbol] for h in members], ret))
                continue
            except OSError as e:
                if e.errno != errno.EINVAL:
                    failed.update((h.symbol, str(e)) for h in members)
                    continue
            except Exception as e:  # BCC raises bare Exception
                failed.update((h.symbol, str(e)) for h in members)
                continue
            # EINVAL: another tool's perf-event uprobe is at one of these
            # functions (the kernel then refuses a multi link there): one
            # perf-event uprobe per function instead
            for h in members:
                names, err = self._attach_perf(path, h.symbol, fn, ret)
                att.probe_events += names
                if err is not None:
                    failed[h.symbol] = err
        for hook, _ in todo:
            if hook.symbol in failed:
                att.missing.append(f"{hook.symbol} ({failed[hook.symbol]})")
            else:
                att.hooks.append(hook)
                self.status.attachments.append(_label(att.library, hook))

    def _attach_perf(self, path: str, sym: str, fn: str, ret: bool) -> tuple[list[bytes], str | None]:
        """One perf-event uprobe of `fn`, a program loaded for perf events (BCC
        caches one program per name: the uprobe_multi one is set aside while
        BCC attaches this one)."""
        name = fn.encode()
        multi = self.bpf.funcs.pop(name, None)
        if name in self._perf_funcs:
            self.bpf.funcs[name] = self._perf_funcs[name]
        before = set(self.bpf.uprobe_fds)
        try:
            attach = self.bpf.attach_uretprobe if ret else self.bpf.attach_uprobe
            attach(name=os.fsencode(path), sym=sym.encode(), fn_name=name)
            err = None
        except Exception as e:  # BCC raises bare Exception
            err = str(e)
        finally:
            if name in self.bpf.funcs:
                self._perf_funcs[name] = self.bpf.funcs[name]
            if multi is not None:
                self.bpf.funcs[name] = multi
        return sorted(set(self.bpf.uprobe_fds) - before), err

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
        if hook.kind == "launch":
            return self.cfg.gpu.launch_timing
        return hook.kind == "call"

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

    def _close_perf_funcs(self) -> None:
        """Close the perf-event copies of programs (BCC's cleanup closes only
        its own); a program stays loaded while a uprobe still holds it."""
        for fn in self._perf_funcs.values():
            try:
                os.close(fn.fd)
            except OSError:
                pass
        self._perf_funcs.clear()

    def _close_probes(self, names) -> None:
        for name in names:
            try:
                self.bpf.detach_uprobe_event(name)
            except Exception as e:
                log.debug("%s: detach %r: %s", self.name, name, e)

    def _detach_library(self, att: AttachedLibrary) -> None:
        self._close_probes(att.probe_events)
        _close_links(att)
        for hook in att.hooks:
            self.status.attachments.remove(_label(att.library, hook))
        if att.report in self.status.failed_attachments:
            self.status.failed_attachments.remove(att.report)
        self._libraries.pop(att.library.key, None)
        self.finder.forget(att.library.key)

    def _reap_captures(self) -> None:
        """Delete the stream captures of processes that no longer exist (a
        process that died capturing never ends its capture) and count them in
        gpu_captures_reaped, which only the agent writes: while the kernel's
        open-capture count equals it, launches skip the capture lookup."""
        table, reaped = self.bpf[b"gpu_captures"], self.bpf[b"gpu_captures_reaped"]
        gone = 0
        for key in list(table.keys()):
            if not os.path.exists(f"{self.finder.proc}/{key.tgid}"):
                try:
                    del table[key]
                    gone += 1
                except KeyError:
                    pass   # ended (or evicted) meanwhile
        if gone:
            zero = reaped.Key(0)
            reaped[zero] = reaped.Leaf(reaped[zero].value + gone)

    def _reap_calls(self) -> None:
        """Delete the call records of threads that no longer exist: a thread
        killed inside a call never reaches its return probe."""
        for name in (b"gpu_launch_calls", b"gpu_sync_calls", b"gpu_graph_calls"):
            table = self.bpf[name]
            for key, call in list(table.items()):
                pid, tid = call.pid_tgid >> 32, call.pid_tgid & 0xFFFFFFFF
                if not os.path.exists(f"{self.finder.proc}/{pid}/task/{tid}"):
                    try:
                        del table[key]
                    except KeyError:
                        pass

    def _detach(self) -> None:
        # BCC's cleanup() closes every perf-event uprobe; the links are ours.
        for att in self._libraries.values():
            _close_links(att)
        self._libraries.clear()
        self._close_perf_funcs()
        self.status.attachments.clear()

    # -- reading -----------------------------------------------------------------
    def libraries(self) -> list[AttachedLibrary]:
        """Every library file whose attaching is over (hooked, or reported),
        with the pid it was first seen in."""
        return [a for a in list(self._libraries.values()) if a.settled]

    def launches(self) -> dict[CountKey, int]:
        """Kernel launches per (cgroup id, modality, api): outermost launch
        calls (api driver or runtime; attempts, counted at entry, whether
        they succeed or not), and kernels run by replays of known graphs
        (api graph). Launches recorded during a stream capture are not here."""
        return self._per_cpu_counts(b"spanlet_gpu_kernel_launches_total")

    def _per_cpu_counts(self, name: bytes) -> dict[CountKey, int]:
        out: dict[CountKey, int] = {}
        if self.bpf is None:
            return out
        for k, per_cpu in self.bpf[name].items():
            key = (k.cgroup_id, _modality(k.modality), events.Api(k.api))
            out[key] = out.get(key, 0) + sum(int(v) for v in per_cpu)
        return out

    def graph_launches(self) -> dict[CountKey, int]:
        """Graph replays (cuGraphLaunch*) per (cgroup id, modality, api graph)."""
        return self._per_cpu_counts(b"spanlet_gpu_graph_launches_total")

    def unknown_graph_launches(self) -> dict[CountKey, int]:
        """Replays of executable graphs whose making the agent did not see
        (made before it attached, or pushed out of its bounded maps), per
        (cgroup id, modality, api graph): counted as graph launches, their
        kernels unknown."""
        return self._per_cpu_counts(b"spanlet_gpu_unknown_graph_launches_total")

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
