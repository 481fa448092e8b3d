"""Loader of bpf/gpu_launch.bpf.c: finds the CUDA driver (and, with
gpu.runtime_hooks, runtime) libraries in every process (agent/discovery.py),
attaches the launch, graph and sync uprobes to each library file once (by
default one entry-only uprobe per driver launch entry point), and reads the
launch, graph launch and sync wait maps."""

from __future__ import annotations

import ctypes as C
import errno
import logging
import operator
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Iterator

from spanlet import events
from spanlet.config import Config
from spanlet.discovery import LibraryFinder, MappedLibrary
from spanlet.probes import bpf_sys, uprobe_multi
from spanlet.probes.base import EventSink, Probe
from spanlet.probes.maps import read_batches

log = logging.getLogger(__name__)

# Must match SPANLET_GPU_WAIT_BUCKETS in gpu_launch.bpf.c: bucket i < 2^i us.
WAIT_BUCKETS = 32
# struct gpu_count_key: cgroup id, modality, api
COUNT_KEY = struct.Struct("=QBB6x")


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
    Hook("cuCtxSynchronize_v2", SYNC, "call"),   # CUDA 13's cudaDeviceSynchronize; not in 535
    Hook("cuEventSynchronize", SYNC, "call", True),
)
COPY = "gpu_copy_return"


def _copy(sym: str, fn: str) -> tuple[Hook, Hook]:
    # A copy or allocation call and its per-thread-default-stream twin
    # (_ptds for a synchronous call, _ptsz for an Async one, as cuda.h names
    # them), one entry program for both; a synchronous copy's return probe
    # times it (memcpy_ns).
    sync = fn.startswith("gpu_copy") and not fn.endswith("_async")
    ret, kind = (COPY, "call") if sync else ("", "entry")
    return Hook(sym, ret, kind, fn=fn), Hook(sym + ("_ptds" if sync else "_ptsz"), ret, kind, fn=fn)


# GPU memory traffic: every copy the runtime makes reaches one of these once
# (the runtime is never hooked for copies: nothing nests). The unversioned
# cuMemcpyHtoD & co. are the 32-bit-pointer ABI that cuda.h has not named
# since CUDA 3.2; the array copies (HtoA, AtoH, ...) and CUDA 12.8's batch
# copies are not hooked.
DRIVER_COPY_HOOKS = (
    *_copy("cuMemcpyHtoD_v2", "gpu_copy_h2d"),
    *_copy("cuMemcpyDtoH_v2", "gpu_copy_d2h"),
    *_copy("cuMemcpyDtoD_v2", "gpu_copy_d2d"),
    *_copy("cuMemcpyHtoDAsync_v2", "gpu_copy_h2d_async"),
    *_copy("cuMemcpyDtoHAsync_v2", "gpu_copy_d2h_async"),
    *_copy("cuMemcpyDtoDAsync_v2", "gpu_copy_d2d_async"),
    *_copy("cuMemcpy", "gpu_copy_unified"),
    *_copy("cuMemcpyAsync", "gpu_copy_unified_async"),
    *_copy("cuMemcpyPeer", "gpu_copy_peer"),
    *_copy("cuMemcpyPeerAsync", "gpu_copy_peer_async"),
    *_copy("cuMemcpy2D_v2", "gpu_copy_2d"),
    *_copy("cuMemcpy2DUnaligned_v2", "gpu_copy_2d"),
    *_copy("cuMemcpy2DAsync_v2", "gpu_copy_2d_async"),
    *_copy("cuMemcpy3D_v2", "gpu_copy_3d"),
    *_copy("cuMemcpy3DAsync_v2", "gpu_copy_3d_async"),
    Hook("cuMemAlloc_v2", fn="gpu_alloc_bytes"),
    *_copy("cuMemAllocAsync", "gpu_alloc_bytes"),
    Hook("cuMemAllocPitch_v2", fn="gpu_alloc_pitch"),
)
# gpu_copy_* in gpu_launch.bpf.c (GPU_COPY_*): the direction label of each key
COPY_DIRECTIONS = ("h2d", "d2h", "d2d", "other")
# struct gpu_copy_key: cgroup id, direction
COPY_KEY = struct.Struct("=QB7x")
DRIVER_HOOKS = DRIVER_LAUNCH_HOOKS + DRIVER_GRAPH_HOOKS + DRIVER_SYNC_HOOKS + DRIVER_COPY_HOOKS
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

# uprobe_multi: one entry program per library link, gpu_entry, generated by
# GpuProbe.source_text; the attach cookie of each offset names the entry
# program (of the C file) that handles it.
ENTRY = "gpu_entry"
ENTRY_FNS = sorted({h.entry_fn for h in DRIVER_HOOKS + RUNTIME_HOOKS})
COOKIE = {fn: i + 1 for i, fn in enumerate(ENTRY_FNS)}
_WRAPPER = re.compile(r"^int (gpu_\w+)\(struct pt_regs \*ctx\)\n\{", re.M)


def with_dispatcher(text: str, entry_fns: list[str] = ENTRY_FNS, programs: bool = True) -> str:
    """The C source with every entry program made an inline function (NAME_impl)
    called, for those of `entry_fns` (the hooks attached), from gpu_entry,
    which dispatches on the attach cookie, and from a program of that name
    for BCC's perf-event uprobes, which have no cookie. With `programs` (no
    uprobe_multi links: every hook a perf-event uprobe) that program runs
    the function's code itself; without, it is small (a function where the
    kernel refuses a link is rare): it names its function for gpu_entry and
    tail-calls it. The others are never called, so never compiled past the
    parser: the optimiser's time grows with the code, and a copy of each
    entry program's code in a program of its own was a fifth of the probe's
    compile."""
    text = _WRAPPER.sub(lambda m: (f"static __always_inline int {m.group(1)}_impl(struct pt_regs *ctx)\n{{"
                                   if m.group(1) in COOKIE else m.group(0)), text)
    call = "{fn}_impl(ctx)" if programs else "gpu_by_entry(ctx, {cookie})"
    wrappers = "".join(f"int {fn}(struct pt_regs *ctx)\n{{\n    return "
                       + call.format(fn=fn, cookie=COOKIE[fn]) + ";\n}\n\n" for fn in entry_fns)
    cases = "".join(f"    case {COOKIE[fn]}:\n        return {fn}_impl(ctx);\n" for fn in entry_fns)
    left_out = [fn for fn in ENTRY_FNS if fn not in entry_fns]
    if left_out:   # named as in the C file (whose every line a dump shows)
        wrappers += ("/* Not compiled with this configuration (no hook of it attached):\n"
                     + "".join(f"int {fn}(struct pt_regs *ctx)\n" for fn in left_out) + " */\n\n")
    return (f"{text}\n/* Generated by GpuProbe.source_text: gpu_entry, the one entry program of a\n"
            " * library's uprobe_multi link, which tells the hooked function by the attach\n"
            " * cookie the agent gave its offset, and the entry programs of perf-event\n"
            " * uprobes. */\n"
            "static __u64 (*gpu_attach_cookie)(void *ctx) = (void *)174;   /* BPF_FUNC_get_attach_cookie */\n\n"
            + ("" if programs else GPU_BY_ENTRY) + wrappers +
            "int gpu_entry(struct pt_regs *ctx)\n{\n    __u64 cookie = gpu_attach_cookie(ctx);\n"
            + ("" if programs else
               "    if (!cookie) {   /* tail-called by gpu_by_entry */\n"
               "        __u64 id = bpf_get_current_pid_tgid();\n"
               "        __u64 *named = gpu_perf_hooks.lookup(&id);\n"
               "        if (!named)\n            return 0;\n"
               "        cookie = *named;\n"
               "        gpu_perf_hooks.delete(&id);\n    }\n")
            + f"    switch (cookie) {{\n{cases}    }}\n    return 0;\n}}\n")


# With uprobe_multi links, the entry program of a function's perf-event uprobe
# (where the kernel refuses a link: another tool's BCC uprobe at the same
# offset): the function's cookie for gpu_entry (per thread: a uprobe program
# can be preempted), then gpu_entry itself, loaded for perf events.
GPU_BY_ENTRY = """\
BPF_HASH(gpu_perf_hooks, __u64, __u64, 1024);
BPF_PROG_ARRAY(gpu_entry_perf, 1);

static __always_inline int gpu_by_entry(struct pt_regs *ctx, __u64 cookie)
{
    __u64 id = bpf_get_current_pid_tgid();
    gpu_perf_hooks.update(&id, &cookie);
    gpu_entry_perf.call(ctx, 0);
    gpu_perf_hooks.delete(&id);   /* gpu_entry not set: nothing done */
    return 0;
}

"""


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


def probe_skip(code: bytes) -> int:
    """Bytes from a function's entry to where its uprobe goes: past a leading
    compare of a RIP-relative operand with an immediate, when a conditional
    jump follows; else 0. The driver's exports are trampolines of that shape
    (`cmpl $imm32, disp32(%rip); je <return 4>; jmp *disp32(%rip)`): the
    kernel runs a probed instruction with a RIP-relative operand out of line
    and single-steps it, a second trap per call (17 µs a call on the
    development VM; within the noise on an H200 VM's kernel), while it
    emulates a conditional jump in the first (0.45 µs on that VM). The
    compare writes only the flags, so on the jump the arguments, the stack
    and the return address are the entry's."""
    i = 1 if code[:1] == b"\x48" else 0                       # REX.W
    op, modrm = code[i:i + 1], code[i + 1:i + 2]
    if modrm != b"\x3d" or op not in (b"\x80", b"\x81", b"\x83"):   # cmp /7, [rip + disp32]
        return 0
    n = i + 2 + 4 + (4 if op == b"\x81" else 1)
    jump = code[n:n + 2]
    if len(jump) == 2 and (0x70 <= jump[0] <= 0x7F or (jump[0] == 0x0F and 0x80 <= jump[1] <= 0x8F)):
        return n
    return 0


def probe_sites(path: str, todo: list[tuple[Hook, int]]) -> list[tuple[Hook, int]]:
    """Each (hook, function address) with the address of its probe site
    (probe_skip past the entry) in its place."""
    try:
        offsets = uprobe_multi.file_offsets(path, [a for _, a in todo])
        with open(path, "rb") as f:
            skips = []
            for off in offsets:
                f.seek(off)
                skips.append(probe_skip(f.read(16)))
    except OSError:
        return todo          # unreadable: attaching there fails and says so
    return [(h, a + skip) for (h, a), skip in zip(todo, skips)]


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
        self._multi: bool | None = None   # uprobe_multi links (uses_multi())
        self._perf_funcs: dict[bytes, object] = {}   # perf-event copies of programs (fallback)

    def source_text(self) -> str:
        hooks = DRIVER_HOOKS + (RUNTIME_HOOKS if self.cfg.gpu.runtime_hooks else ())
        return with_dispatcher(super().source_text(), sorted({h.entry_fn for h in hooks}),
                               programs=not self.uses_multi())

    def uses_multi(self) -> bool:
        """Whether the hooks are attached as uprobe_multi links (gpu.uprobe_multi
        and a kernel that makes them, Linux 6.6+), decided once, before the
        compile: the entry programs are then compiled only inside gpu_entry."""
        if self._multi is None:
            self._multi = self.cfg.gpu.uprobe_multi and uprobe_multi.supported()
            if self.cfg.gpu.uprobe_multi and not self._multi:
                log.info("%s: this kernel makes no uprobe_multi links: one perf-event uprobe per hook",
                         self.name)
        return self._multi

    def sends_records(self) -> bool:
        return self.cfg.gpu.launch_events != "off"

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
        todo = probe_sites(lib.open_path, todo)
        if self.uses_multi():
            self._attach_links(att, todo)
        else:
            for hook, addr in todo:
                names, err = self._attach_hook(lib.open_path, hook, addr)
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
        (the return links first, as _attach_hook orders its probes), at the
        probe sites of `todo`."""
        path = att.library.open_path
        try:
            offsets = dict(zip((h.symbol for h, _ in todo),
                               uprobe_multi.file_offsets(path, [a for _, a in todo])))
        except OSError as e:
            att.missing += [f"{h.symbol} ({e})" for h, _ in todo]
            return
        sites = {h.symbol: a for h, a in todo}
        groups: dict[tuple[str, bool], list[Hook]] = {}
        for hook, _ in todo:
            groups.setdefault((ENTRY, False), []).append(hook)
            if self._needs_return(hook):
                groups.setdefault((hook.return_fn, True), []).append(hook)
        failed: dict[str, str] = {}
        for (fn, ret), members in sorted(groups.items(), key=lambda g: not g[0][1]):
            members = [h for h in members if h.symbol not in failed]
            if not members:
                continue
            try:
                prog = self.bpf.load_func(fn.encode(), BPF_KPROBE,
                                          attach_type=bpf_sys.TRACE_UPROBE_MULTI)
            except Exception as e:  # BCC raises bare Exception
                failed.update((h.symbol, str(e)) for h in members)
                continue
            err = self._link(att, prog.fd, path, members, offsets, fn, ret)
            if err is None:
                continue
            if err.errno != errno.EINVAL:
                failed.update((h.symbol, str(err)) for h in members)
                continue
            # EINVAL: another tool's perf-event uprobe is at one of these
            # functions (the kernel then refuses a link there): a link per
            # function, and a perf-event uprobe where that is refused too
            # (of the function's small entry program, which hands it to gpu_entry)
            for h in members:
                if self._link(att, prog.fd, path, [h], offsets, fn, ret) is None:
                    continue
                if fn == ENTRY:
                    perr = self._entry_for_perf()
                if fn != ENTRY or perr is None:
                    names, perr = self._attach_perf(path, sites[h.symbol],
                                                    h.entry_fn if fn == ENTRY else fn, ret)
                    att.probe_events += names
                if perr is not None:
                    failed[h.symbol] = perr
        for hook, _ in todo:
            if hook.symbol in failed:
                att.missing.append(f"{hook.symbol} ({failed[hook.symbol]})")
            else:
                att.hooks.append(hook)
                self.status.attachments.append(_label(att.library, hook))

    def _link(self, att: AttachedLibrary, prog_fd: int, path: str, members: list[Hook],
              offsets: dict[str, int], fn: str, ret: bool) -> OSError | None:
        cookies = [COOKIE[h.entry_fn] for h in members] if fn == ENTRY else None
        try:
            att.links.append(uprobe_multi.link(prog_fd, path, [offsets[h.symbol] for h in members],
                                               ret, cookies))
            return None
        except OSError as e:
            return e

    def _attach_perf(self, path: str, addr: int, fn: str, ret: bool) -> tuple[list[bytes], str | None]:
        """One perf-event uprobe of `fn` at `addr`, a program loaded for perf events (BCC
        caches one program per name: the uprobe_multi one is set aside while
        BCC attaches this one)."""
        name = fn.encode()
        multi = self.bpf.funcs.pop(name, None)
        if name in self._perf_funcs:
            self.bpf.funcs[name] = self._perf_funcs[name]
        before = set(self.bpf.uprobe_fds)
        try:
            attach = self.bpf.attach_uretprobe if ret else self.bpf.attach_uprobe
            attach(name=os.fsencode(path), addr=addr, fn_name=name)
            err = None
        except Exception as e:  # BCC raises bare Exception
            err = str(e)
        finally:
            if name in self.bpf.funcs:   # ours to close (_close_perf_funcs), not BCC's
                self._perf_funcs[name] = self.bpf.funcs.pop(name)
            if multi is not None:
                self.bpf.funcs[name] = multi
        return sorted(set(self.bpf.uprobe_fds) - before), err

    def _entry_for_perf(self) -> str | None:
        """gpu_entry loaded for perf events and set where the small entry
        programs of the perf-event uprobes tail-call it (gpu_entry_perf),
        once. None, or why not."""
        name = ENTRY.encode()
        if name in self._perf_funcs:
            return None
        multi = self.bpf.funcs.pop(name, None)
        try:
            fn = self.bpf.load_func(name, BPF_KPROBE)
            self.bpf[b"gpu_entry_perf"][C.c_int(0)] = C.c_int(fn.fd)
        except Exception as e:  # BCC raises bare Exception
            return str(e)
        finally:
            if name in self.bpf.funcs:   # ours to close (_close_perf_funcs), not BCC's
                self._perf_funcs[name] = self.bpf.funcs.pop(name)
            if multi is not None:
                self.bpf.funcs[name] = multi
        return None

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

    def _attach_hook(self, path: str, hook: Hook, addr: int) -> tuple[list[bytes], str | None]:
        """Attach one function's return then entry probe at its probe site
        `addr`. Returns BCC's names of the probes attached (to detach them by
        name later, when the path may no longer resolve) and None, or why
        not. The return probe goes
        first so that every call whose entry is seen also has its return seen
        (an entry without a return would leave the thread "inside" a call)."""
        before = set(self.bpf.uprobe_fds)
        path_b = os.fsencode(path)
        try:
            if self._needs_return(hook):
                self.bpf.attach_uretprobe(name=path_b, addr=addr, fn_name=hook.return_fn.encode())
            self.bpf.attach_uprobe(name=path_b, addr=addr, fn_name=hook.entry_fn.encode())
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
        zero = reaped.Key(0)
        if self.bpf[b"gpu_captures_active"][zero].value == reaped[zero].value:
            return              # none open: nothing to walk (an empty map's walk reads every bucket)
        gone = 0
        for key in list(table.keys()):
            if not os.path.exists(f"{self.finder.proc}/{key.tgid}"):
                try:
                    del table[key]
                    gone += 1
                except KeyError:
                    pass   # ended (or evicted) meanwhile
        if gone:
            reaped[zero] = reaped.Leaf(reaped[zero].value + gone)

    def _reap_calls(self) -> None:
        """Delete the call records of threads that no longer exist: a thread
        killed inside a call never reaches its return probe."""
        for name in (b"gpu_launch_calls", b"gpu_sync_calls", b"gpu_graph_calls", b"gpu_copy_calls"):
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

    def _per_cpu_sums(self, name: bytes, key: struct.Struct) -> Iterator[tuple[tuple, list[int]]]:
        """(key's fields, the value's u64 fields summed over the CPUs) of a
        per-CPU hash, read in batches and unpacked whole (a scrape with 100
        pods reads these maps: no ctypes object per field)."""
        table = self.bpf[name]
        fields = C.sizeof(table.sLeaf) // 8
        keys, values = read_batches(table)
        n = len(keys) // key.size
        ncpu = len(values) // (n * fields * 8) if n else 0
        rows = struct.iter_unpack(f"={fields}Q", values)
        for k in key.iter_unpack(keys):
            acc = list(next(rows))
            for _ in range(ncpu - 1):
                acc = list(map(operator.add, acc, next(rows)))
            yield k, acc

    def _per_cpu_rows(self, name: bytes) -> Iterator[tuple[CountKey, list[int]]]:
        """The sums of a per-CPU hash keyed by gpu_count_key."""
        for (cgroup, modality, api), acc in self._per_cpu_sums(name, COUNT_KEY):
            yield (cgroup, _modality(modality), events.Api(api)), acc

    def memcpy_bytes(self) -> dict[tuple[int, str], int]:
        """Bytes the driver's copy calls were asked to copy, per (cgroup id,
        direction: COPY_DIRECTIONS), counted at entry."""
        out: dict[tuple[int, str], int] = {}
        if self.bpf is None:
            return out
        for (cgroup, direction), (n,) in self._per_cpu_sums(b"spanlet_gpu_memcpy_bytes_total", COPY_KEY):
            key = (cgroup, COPY_DIRECTIONS[direction] if direction < len(COPY_DIRECTIONS) else "other")
            out[key] = out.get(key, 0) + n
        return out

    def _per_cpu_counts(self, name: bytes) -> dict[CountKey, int]:
        out: dict[CountKey, int] = {}
        if self.bpf is None:
            return out
        for key, (n,) in self._per_cpu_rows(name):
            out[key] = out.get(key, 0) + n
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
        return {k: (count, total) for k, (count, total, _) in self.sync_waits().items()}

    def sync_waits(self) -> dict[CountKey, tuple[int, int, list[int]]]:
        """Outermost sync calls per (cgroup id, modality, api): (count, total
        ns, buckets), the map read once; bucket i counts waits shorter than
        2^i microseconds (and at least 2^(i-1)); the last bucket is unbounded."""
        out: dict[CountKey, tuple[int, int, list[int]]] = {}
        if self.bpf is None:
            return out
        for key, (count, total, *buckets) in self._per_cpu_rows(b"spanlet_gpu_sync_wait_seconds"):
            prev = out.get(key)
            if prev is not None:
                count, total = count + prev[0], total + prev[1]
                buckets = [a + b for a, b in zip(buckets, prev[2])]
            out[key] = (count, total, buckets)
        return out
