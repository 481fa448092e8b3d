"""Loader of bpf/span_ctx.bpf.c (a CO-RE object built with the package, loaded
by libbpf): owns the span_ctx and span_facts maps that the other
process-context probes share (pinned by name in one folder) and their reader
(`facts`), and attaches the marker uprobe to every copy of the client's
marker (the libspanlet_marker extension) that discovery finds (containers included)."""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import mmap
import os
import shutil
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import Iterable

from spanlet import events, runtimes
from spanlet.discovery import LibraryFinder, MappedLibrary, MapsWatch
from spanlet.probes import libbpf
from spanlet.probes.base import EventSink, Probe, ProbeError
from spanlet.probes.maps import percpu_sum, read_batches
from spanlet.probes.sandbox.probe import tracepoint_exists
from spanlet.probes.span_facts import SpanFacts

log = logging.getLogger(__name__)

MARKER_LIBRARY = "libspanlet_marker"
MARKER_SYMBOL = "spanlet_mark"
# How old a mark of maps_changed_pids must be before discovery reads that
# process (its mapping made by then: a mapping takes microseconds).
MAPS_SETTLE_NS = 50_000_000
MAPS_CHANGED_CHUNK = 1024     # pids read a batch call
SPAN_CTX_PIN_ROOT = Path("/sys/fs/bpf/spanlet")
_instances = itertools.count()
# The OpenTelemetry shared context map's layout (DESIGN.md): what a map pinned
# by another tool must be for spanlet to write into it.
OTEL_MAP_LAYOUT = {"type": "lru_hash", "bytes_key": 8, "bytes_value": 24}
# Where the connecting process of each connection to the receiver is seen
# (kernels since 4.16 have it); without it senders are known by pod IP only.
SOCK_STATE_TRACEPOINT = "sock:inet_sock_set_state"
# The programs of the request anatomy (sched.enabled), of the senders
# (SOCK_STATE_TRACEPOINT), and the marker's uprobe (attached per library).
SCHED_PROGRAMS = ("sched_switch", "sched_wakeup", "sched_stat_runtime")
SOCK_PROGRAM = "inet_sock_set_state"
MARK_PROGRAM = "span_ctx_mark"
OTEL_MAP = "traces_ctx_v1"


def pinned_map_info(path: str) -> dict | None:
    """What bpftool says of the map pinned at `path` (type, bytes_key,
    bytes_value, max_entries, ...), None if unreadable."""
    try:
        out = subprocess.run(["bpftool", "-j", "map", "show", "pinned", path],
                             capture_output=True, text=True, timeout=10)
        return json.loads(out.stdout) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def pinned_map_layout(path: str) -> dict | None:
    """Type and key/value sizes of the map pinned at `path` (bpftool), None if unreadable."""
    info = pinned_map_info(path)
    return {k: info.get(k) for k in OTEL_MAP_LAYOUT} if info else None


def remove_stale_pins(root=SPAN_CTX_PIN_ROOT) -> list[str]:
    """Pin folders (<pid>-<n>) of agents that died without stopping."""
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for e in entries:
        pid = e.name.split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(e.path, ignore_errors=True)
            removed.append(e.path)
    return removed


_V4_MAPPED = bytes(10) + b"\xff\xff"


def _packed(host: str) -> bytes | None:
    """An address as the kernel keeps it: 4 bytes for IPv4 (an IPv4-mapped
    IPv6 address included), 16 for IPv6; None if it is no address."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            raw = socket.inet_pton(family, host)
        except OSError:
            continue
        return raw[12:] if raw[:12] == _V4_MAPPED else raw
    return None


class SpanCtxProbe(Probe):
    name = "span_ctx"
    core = True

    def __init__(self, cfg, sink: EventSink | None = None,
                 clock: events.MonotonicClock | None = None, proc: str = "/proc"):
        super().__init__(cfg, sink, clock)
        self.finder = LibraryFinder([MARKER_LIBRARY], proc=proc,
                                    full_rescan_s=cfg.discovery.full_rescan_s)
        self.libraries: list[MappedLibrary] = []
        self.pin_dir = SPAN_CTX_PIN_ROOT / f"{os.getpid()}-{next(_instances)}"
        self.facts: SpanFacts | None = None   # the span facts reader, while compiled
        # the processes whose maps changed (execs, libraries loaded, exits),
        # for every library finder of the agent (daemon: subscribe()), while compiled
        self.maps_watch: MapsWatch | None = None
        # span_context.otel_map: the pin path while used, and what of it this
        # agent created (and so removes at stop): the pin, its folder
        self.otel_map: str | None = None
        self._otel_created: list[Path] = []
        self.sock_owners = False          # whether sock_owner is compiled in
        self._thread_only_said: dict[int, int] = {}   # pid -> follow flags logged

    def shared_pin_dir(self) -> str | None:
        """The folder the span context and span facts maps are pinned in while
        this probe is attached (what the other probes are started with), else None."""
        return str(self.pin_dir) if self.status.attached else None

    def setup_object(self, obj, pin_dir: str | None) -> None:
        cfg = self.cfg
        obj.set(sched_on=int(cfg.sched.enabled), otel_map_on=int(self.otel_map is not None),
                span_facts_max_per_cgroup=cfg.join.span_facts_max_per_cgroup)
        for prog in SCHED_PROGRAMS:
            obj.autoload(prog, cfg.sched.enabled)
        obj.resize("span_facts", cfg.join.span_facts_max).resize("span_facts_index", cfg.join.span_facts_max)
        obj.resize("events", self.ringbuf_pages() * mmap.PAGESIZE)
        if self.otel_map:
            # a map another tool pinned is reused only with the same size: take its
            info = pinned_map_info(self.otel_map) if Path(self.otel_map).exists() else None
            if info and info.get("max_entries"):
                obj.resize(OTEL_MAP, int(info["max_entries"]))
            obj.pin(OTEL_MAP, self.otel_map)
        else:
            obj.resize(OTEL_MAP, 1)
        self.sock_owners = tracepoint_exists(SOCK_STATE_TRACEPOINT)
        obj.autoload(SOCK_PROGRAM, self.sock_owners)
        if not self.sock_owners:
            obj.resize("sock_connecting", 1).resize("sock_owner", 1)
            log.warning("span_ctx: no %s tracepoint: OTLP senders are known by pod IP only",
                        SOCK_STATE_TRACEPOINT)

    def _prepare_otel_map(self) -> None:
        """Decide whether to write the OTel shared map: create it where nobody
        pinned one, share one of the standard layout, leave any other alone."""
        self.otel_map, self._otel_created = None, []
        if not self.cfg.span_context.otel_map:
            return
        path = Path(self.cfg.span_context.otel_map_path)
        if path.exists():
            layout = pinned_map_layout(str(path))
            if layout != OTEL_MAP_LAYOUT:
                log.error("span_ctx: %s is pinned by another tool with layout %s, not %s: "
                          "the OTel shared context map is not written", path, layout,
                          OTEL_MAP_LAYOUT)
                return
            log.info("span_ctx: sharing the OTel context map another tool pinned at %s", path)
        else:
            if not path.parent.exists():
                path.parent.mkdir(parents=True)
                self._otel_created.append(path.parent)
            self._otel_created.insert(0, path)
            log.info("span_ctx: creating the OTel shared context map at %s", path)
        self.otel_map = str(path)

    def _remove_otel_map(self) -> None:
        """What this agent created of the OTel map: the pin, then its folder if empty."""
        for p in self._otel_created:
            try:
                p.rmdir() if p.is_dir() else p.unlink()
            except OSError:
                pass
        self._otel_created = []

    def compile(self, pin_dir: str | None = None) -> None:
        for path in remove_stale_pins():
            log.info("span_ctx: removed the pins of a dead agent: %s", path)
        self.pin_dir.mkdir(parents=True, exist_ok=True)
        self._prepare_otel_map()
        try:
            super().compile(str(self.pin_dir))   # this probe makes the shared maps, pinned there
        except Exception:
            self._remove_otel_map()
            raise
        created = self.bpf["span_facts_created"]
        b = self.bpf
        self.facts = SpanFacts(b["span_facts"], lambda: percpu_sum(created, 0), self.clock,
                               index=b["span_facts_index"],
                               cg_created=b["span_facts_cg_created"],
                               cg_released=b["span_facts_cg_released"],
                               cg_refused=b["span_facts_cg_refused"],
                               refused=b["span_facts_refused"])
        self.maps_watch = MapsWatch(self._drain_maps_changed)
        self.finder.watch = self.maps_watch.subscribe()

    def _drain_maps_changed(self) -> list[int]:
        """The pids in maps_changed_pids marked at least MAPS_SETTLE_NS ago,
        each deleted before its maps are read. The kernel marks a process at
        the mmap call, before the mapping exists: a mark younger than that
        waits for the next refresh, so that the maps read show the mapping."""
        if self.bpf is None:
            return []
        table = self.bpf["maps_changed_pids"]
        settled = time.monotonic_ns() - MAPS_SETTLE_NS      # the kernel's clock (bpf_ktime_get_ns)
        # one batch read (a dozen pids a second on a busy node; BCC's items()
        # made two syscalls and two ctypes objects a pid)
        keys, marks = read_batches(table, chunk=MAPS_CHANGED_CHUNK)
        pids = [pid for (pid,), (at,) in zip(struct.iter_unpack("=I", keys), struct.iter_unpack("=Q", marks))
                if at <= settled]
        for pid in pids:
            try:
                del table[table.Key(pid)]
            except KeyError:
                pass
        return pids

    def _detach(self) -> None:
        if self.facts is not None:
            self.facts.close()
        self.finder.watch = None
        shutil.rmtree(self.pin_dir, ignore_errors=True)
        try:
            self.pin_dir.parent.rmdir()  # only when no other agent uses it
        except OSError:
            pass
        self._remove_otel_map()

    def ringbuf_pages(self) -> int:
        return 1  # no records of its own

    def sends_records(self) -> bool:
        return False

    def _attach(self) -> None:
        # Every program loaded but the marker's uprobe, which discovery attaches per library.
        for prog, section in self.bpf.programs().items():
            if prog == MARK_PROGRAM or self.bpf.program_fd(prog) < 0:
                continue
            try:
                self.bpf.attach(prog)
            except libbpf.LibbpfError as e:
                raise ProbeError(f"span_ctx: cannot attach {prog} ({section}): {e}") from None
            self.status.attachments.append(section)
        self.refresh()

    def refresh(self) -> None:
        self._say_thread_only()
        for lib in self.finder.refresh():
            label = f"{MARKER_SYMBOL}@{lib.path} (inode {lib.inode}, pid {lib.pid})"
            try:
                self.bpf.attach_uprobe(MARK_PROGRAM, lib.open_path, symbol=MARKER_SYMBOL)
            except libbpf.LibbpfError as e:
                self.status.failed_attachments.append(f"{label}: {e}")
                log.warning("span_ctx: cannot attach %s: %s", label, e)
                continue
            self.libraries.append(lib)
            self.status.attachments.append(label)
            log.info("span_ctx: attached %s", label)

    def marks(self) -> int:
        """Marker calls seen (span starts and ends of instrumented processes)."""
        return percpu_sum(self.bpf["spanlet_span_marks_total"], 0) if self.bpf else 0

    def _say_thread_only(self) -> None:
        """One log line for each process whose marks newly say that its spans
        are followed per thread only (and why)."""
        now = self.thread_only_processes()
        for pid, flags in now.items():
            if self._thread_only_said.get(pid) != flags:
                log.warning("span_ctx: pid %d runs its requests on %s: its spans are followed per thread "
                            "only (kernel facts of requests sharing a thread may land on each other's spans)",
                            pid, " and ".join(runtimes.names(flags)))
        self._thread_only_said = now

    def thread_only_processes(self) -> dict[int, int]:
        """pid -> follow flags (spanlet.runtimes.NotFollowed) of the processes
        whose marks say their spans are followed per thread only."""
        if self.bpf is None:
            return {}
        keys, vals = read_batches(self.bpf["spanlet_client_thread_only_processes"])
        return {pid: flags for (pid,), (flags,) in zip(struct.iter_unpack("=I", keys), struct.iter_unpack("=I", vals))}

    def invalid_marks(self) -> int:
        """Marks with an all-zero trace id and a span id: the thread left its span."""
        return percpu_sum(self.bpf["spanlet_span_marks_invalid_total"], 0) if self.bpf else 0

    def set(self, tid: int, trace_id: bytes, span_id: int, modality: events.Modality) -> None:
        """Write one thread's context as the marker uprobe would (tests, tools)."""
        table = self.bpf["span_ctx"]
        val = table.Leaf()
        for i, b in enumerate(trace_id[:16]):
            val.trace_id[i] = b
        val.span_id = span_id
        val.modality = int(modality)
        table[table.Key(tid)] = val

    def get(self, tid: int) -> tuple[bytes, int, events.Modality] | None:
        table = self.bpf["span_ctx"]
        try:
            v = table[table.Key(tid)]
        except KeyError:
            return None
        return bytes(v.trace_id), v.span_id, events.Modality(v.modality)

    def clear(self, tid: int) -> None:
        table = self.bpf["span_ctx"]
        try:
            del table[table.Key(tid)]
        except KeyError:
            pass

    # -- the senders of connections to the receiver (sock_owner) ----------------
    def watch_ports(self, ports: Iterable[int]) -> None:
        """The receiver's ports: connections made to them from now on get
        their sender (cgroup id, tgid) recorded in sock_owner."""
        if self.bpf is None or not self.sock_owners:
            return
        table = self.bpf["sock_owner_ports"]
        for port in ports:
            if 0 < port < 65536:
                table[table.Key(port)] = table.Leaf(1)

    def sock_owner(self, peer: tuple[str, int], local: tuple[str, int]) -> tuple[int, int] | None:
        """(cgroup id, tgid) of the process that opened the TCP connection
        from `peer` to `local` (host, port each, as the accepting side sees
        them), or None where the kernel saw no such connect, or saw two (in
        two network namespaces)."""
        if self.bpf is None or not self.sock_owners:
            return None
        src, dst = _packed(peer[0]), _packed(local[0])
        if src is None or dst is None or len(src) != len(dst):
            return None
        table = self.bpf["sock_owner"]
        key = table.Key()
        key.family = socket.AF_INET if len(src) == 4 else socket.AF_INET6
        key.sport, key.dport = peer[1], local[1]
        ctypes.memmove(key.saddr, src, len(src))
        ctypes.memmove(key.daddr, dst, len(dst))
        try:
            v = table[key]
        except KeyError:
            return None
        return (v.cgroup_id, v.tgid) if v.cgroup_id else None
