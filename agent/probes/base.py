"""Base of every probe loader: load its program (a CO-RE object built with the
package, through libbpf; or, for the programs not moved yet, bpf/*.bpf.c
compiled by BCC with its -D flags), attach, drain its ring buffer into the
decoder, report attached-or-why, detach."""

from __future__ import annotations

import importlib.resources
import logging
import mmap
import platform
import re
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from spanlet import events
from spanlet.config import Config
from spanlet.probes.maps import Totals, percpu_sum, read_batches
from spanlet.probes import compile_cache, libbpf, ringbuf

log = logging.getLogger(__name__)

# The C sources are package data of spanlet.bpf (the bpf/ folder of the checkout),
# and so are the CO-RE objects the package build makes (objects/<arch>/).
BPF_DIR = Path(str(importlib.resources.files("spanlet.bpf")))
OBJECT_ARCH = {"x86_64": "x86", "aarch64": "arm64"}.get(platform.machine())
_LOCAL_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_.-]+\.h)"\s*$', re.M)

EventSink = Callable[[events._Event], None]

# Passed to BCC before each probe's own flags. BCC compiles with -g so that
# LLVM emits BTF; no program or map of ours needs BTF (no spin locks, no
# kptrs; BCC builds the maps' ctypes types from its own rewriter), and the
# debug info costs LLVM 10-15% of each compile. Without it a verifier
# rejection is printed without source lines.
COMPILER_FLAGS = ["-g0"]

# One BCC compile at a time in a process, and no compile while a module is
# destroyed: libbcc keeps every module's map descriptions in one process-wide
# std::map with no lock (SharedTableStorage), and it chdir()s the process into
# the kernel headers' folder while it compiles (iovisor/bcc#4500: concurrent
# compiles fail to find headers or crash). Attaching, loading programs into
# the verifier and map updates go on beside a compile.
BCC_LOCK = threading.Lock()


class ProbeError(Exception):
    """A probe could not load or attach; the text says why."""


def expand_source(path: Path, _seen: set[str] | None = None) -> str:
    """The probe's C with our own headers (`#include "x.h"`, "x.bpf.h")
    inlined, each once (a header may include the headers it needs). BCC
    rewrites map calls only in the main file, so shared helpers that use
    maps must be part of it; #line keeps compiler messages pointing at the
    real files."""
    seen = {path.name} if _seen is None else _seen
    text = path.read_text()

    def inline(m: re.Match) -> str:
        if m.group(1) in seen:
            return ""  # inlined above already; the blank line keeps the numbering
        seen.add(m.group(1))
        header = path.parent / m.group(1)
        line = text[: m.start()].count("\n") + 2
        return (f'#line 1 "{header.name}"\n{expand_source(header, seen)}\n'
                f'#line {line} "{path.name}"')
    return _LOCAL_INCLUDE.sub(inline, text)


@dataclass
class ProbeStatus:
    name: str
    attached: bool = False
    reason: str = ""
    attachments: list[str] = field(default_factory=list)
    failed_attachments: list[str] = field(default_factory=list)
    compile_s: float = 0.0     # wall seconds of the last compile (BCC, maps created)
    cached: bool = False       # the last compile was the compile cache's (compile_cache)
    attach_s: float = 0.0      # of what followed it: programs loaded, attached, ring opened

_U64 = struct.Struct("<Q")
_BUDGET = struct.Struct("<3Q")     # struct spanlet_cgroup_budget_val (bpf/spanlet.h)


class Probe:
    """One kernel program: bpf/<name>.bpf.c and the code that drives it."""

    name = ""
    # Loaded from the CO-RE object the package ships (libbpf), not compiled by BCC.
    core = False
    # The ring walked in C, each record handed on undecoded (spanlet._ring)
    # where the module is built; False: the Python walk, a struct per record.
    native_ring = ringbuf.NATIVE

    def __init__(self, cfg: Config, sink: EventSink | None = None,
                 clock: events.MonotonicClock | None = None):
        self.cfg = cfg
        self.sink = sink
        self.clock = clock or events.MonotonicClock()
        self.bpf = None
        self.status = ProbeStatus(self.name)
        self.events_read = 0
        self.decode_errors = 0
        self.sink_errors = 0
        self._ring = None   # ringbuf.open_reader()
        # One reader of the ring at a time: the read loop, or the span path
        # draining it before a join (drain()); the ring is closed under it.
        self._read_lock = threading.Lock()
        self._lock = threading.Lock()
        self._limited = Totals()

    # -- what subclasses provide -------------------------------------------------
    @property
    def source_path(self) -> Path:
        return BPF_DIR / f"{self.name}.bpf.c"

    @property
    def object_path(self) -> Path:
        """The CO-RE object of this machine's architecture (core probes)."""
        return BPF_DIR / "objects" / (OBJECT_ARCH or platform.machine()) / f"{self.name}.bpf.o"

    def setup_object(self, obj: libbpf.Object, pin_dir: str | None) -> None:
        """Before load (core probes): settings, programs left out, map sizes, pins."""

    def cflags(self) -> list[str]:
        """-D flags that switch this probe's behaviour."""
        return [f"-DSPANLET_RINGBUF_PAGES={self.ringbuf_pages()}",
                f"-DSPANLET_RECORDS_PER_CGROUP_S={self.cfg.ringbuf_records_per_cgroup_s}"]

    def ringbuf_pages(self) -> int:
        return self.cfg.ringbuf_pages

    def sends_records(self) -> bool:
        """Whether the program can put records in its ring buffer as configured
        (no reader thread is started for one that cannot)."""
        return True

    def _attach(self) -> None:
        """Attach the compiled programs; raise ProbeError if none could be."""
        raise NotImplementedError

    def _detach(self) -> None:
        """Undo what BCC's cleanup does not (TC filters, for example)."""

    def refresh(self) -> None:
        """Periodic work (new processes, new interfaces); called by the daemon."""

    # -- shared machinery --------------------------------------------------------
    def source_text(self) -> str:
        return expand_source(self.source_path)

    def compile_flags(self, pin_dir: str | None = None) -> list[str]:
        """Everything passed to the compiler besides the text; with pin_dir,
        the program uses the span context and span facts maps pinned there."""
        flags = [*COMPILER_FLAGS, *self.cflags()]
        if pin_dir is not None:
            flags.append(f'-DSPANLET_PIN_DIR="{pin_dir}"')
            flags.append(f"-DSPANLET_SPAN_FACTS_MAX={self.cfg.join.span_facts_max}")
            flags.append("-DSPANLET_SPAN_FACTS_MAX_PER_CGROUP="
                         f"{self.cfg.join.span_facts_max_per_cgroup}")
        return flags

    def compile(self, pin_dir: str | None = None) -> None:
        if self.core:
            self.bpf = self._load_object(pin_dir)
            return
        from bcc import BPF  # imported late: unit tiers run without BCC

        flags = self.compile_flags(pin_dir)
        text = self.source_text()
        try:
            with BCC_LOCK:
                if self.cfg.compile_cache:
                    self.bpf, self.status.cached = compile_cache.cache_of(self.cfg).compile(
                        text, flags, compile_cache.pin_templates(flags))
                else:
                    self.bpf = BPF(text=text, cflags=flags)
        except Exception as e:  # BCC raises bare Exception with the reason
            raise ProbeError(f"compile/load of {self.source_path.name} failed: {e}") from None

    def describe_object(self, pin_dir: str | None = None) -> list[str]:
        """The CO-RE object as this probe would load it (opened and set up, not
        loaded): its settings, programs and maps, a line each."""
        with libbpf.Object.open_file(self.object_path, pin_root=pin_dir) as obj:
            self.setup_object(obj, pin_dir)
            return [str(self.object_path.name), *obj.describe()]

    def _load_object(self, pin_dir: str | None) -> libbpf.Object:
        """The CO-RE object opened, set up and loaded (nothing compiled)."""
        path = self.object_path
        if not path.is_file():
            raise ProbeError(f"the package has no BPF object {path.parent.name}/{path.name} "
                             f"(built without clang, or not for {platform.machine()})")
        obj = None
        try:
            btf = libbpf.kernel_btf(self.cfg.btf_path or None)
            obj = libbpf.Object.open_file(path, btf_path=btf if self.cfg.btf_path else None, pin_root=pin_dir)
            self.setup_object(obj, pin_dir)
            return obj.load()
        except (libbpf.LibbpfError, KeyError, ValueError) as e:
            if obj is not None:
                obj.close()
            raise ProbeError(f"load of {path.name} failed: {e}") from None

    def start(self, pin_dir: str | None = None) -> ProbeStatus:
        """Compile, attach and open the ring buffer; never raises. With
        pin_dir (SpanCtxProbe.shared_pin_dir() of the span_ctx probe started
        before it) the program shares that probe's span context and span
        facts maps, else it has private, empty ones."""
        if self.start_compile(pin_dir):
            self.finish_start()
        return self.status

    def start_compile(self, pin_dir: str | None = None) -> bool:
        """start()'s first half: the compile; never raises. False (the
        reason in status) if it failed."""
        t0 = time.monotonic()
        try:
            self.compile(pin_dir)
            return True
        except ProbeError as e:
            self._start_failed(e)
            return False
        finally:
            self.status.compile_s = time.monotonic() - t0

    def finish_start(self) -> ProbeStatus:
        """start()'s second half, after start_compile: attach and open the
        ring buffer (may run while another probe compiles); never raises."""
        t0 = time.monotonic()
        try:
            self._attach()
            ring = self.bpf["events"]
            self._ring = ringbuf.open_reader(ring.map_fd, self.ringbuf_pages() * mmap.PAGESIZE,
                                             native=self.native_ring)
            self.status.attached = True
            self.status.reason = ""
        except ProbeError as e:
            self._start_failed(e)
        self.status.attach_s = time.monotonic() - t0
        return self.status

    def _start_failed(self, e: ProbeError) -> None:
        self.status.attached = False
        self.status.reason = str(e)
        self.stop()

    def _on_record(self, buf, offset: int, size: int) -> None:
        """The Python reader's way: one record decoded into its struct."""
        try:
            ev = events.decode_from(buf, offset, size, self.clock)
        except events.DecodeError:
            self.decode_errors += 1
            return
        self.events_read += 1
        if self.sink is not None:
            try:
                self.sink(ev)
            except Exception:  # one bad consumer call must not stall the ring
                self._sink_failed()

    def _sink_failed(self) -> None:
        self.sink_errors += 1
        if self.sink_errors == 1:
            log.exception("%s: the event consumer failed (logged once)", self.name)

    def _consume(self, ring) -> int:
        """Hand the ring's committed records to the sink; returns how many
        records were read (decode errors included)."""
        if not ring.native:
            return ring.consume(self._on_record)
        records, errors = ring.read(events.RECORD_LAYOUT, self.clock)
        self.decode_errors += errors
        self.events_read += len(records)
        sink = self.sink
        if sink is not None:
            for ev in records:          # spanlet._ring.Record: decoded when read
                try:
                    sink(ev)
                except Exception:  # one bad consumer call must not stall the ring
                    self._sink_failed()
        return len(records) + errors

    def poll(self, timeout_ms: int = 100) -> int:
        """Wait up to `timeout_ms` for a wake-up, then decode every record that
        is there (programs may wake the reader only once per batch, so a wait
        that times out is followed by a read too). Returns records read."""
        ring = self._ring
        if ring is None:
            return 0
        if not ring.pending():
            ring.wait(timeout_ms)
        with self._read_lock:
            return self._consume(ring) if ring is self._ring else 0

    def drain(self) -> int:
        """Hand on every record committed so far, now, from the calling
        thread (the span path, before it joins spans whose records may wait
        in the ring for the read loop's next wake-up)."""
        with self._read_lock:
            ring = self._ring
            return self._consume(ring) if ring is not None else 0

    def events_dropped(self) -> int:
        if self.bpf is None:
            return 0
        return percpu_sum(self.bpf["spanlet_events_dropped_total"], 0)

    def cgroup_limited(self) -> dict[int, int]:
        """cgroup id → records refused by the per-cgroup bound
        (SPANLET_RECORDS_PER_CGROUP_S), totals since start."""
        with self._lock:
            if self.bpf is None or not self.sends_records():
                return self._limited.update({})
            keys, vals = read_batches(self.bpf["cgroup_record_budget"])
            return self._limited.update({cg: limited for (cg,), (_, _, limited) in
                                         zip(_U64.iter_unpack(keys), _BUDGET.iter_unpack(vals))
                                         if limited})

    def stop(self) -> None:
        """Detach everything this probe attached; safe to call twice."""
        with self._lock:
            try:
                self._detach()
            except Exception as e:  # keep detaching the rest
                log.warning("%s: detach: %s", self.name, e)
            with self._read_lock:
                if self._ring is not None:
                    self._ring.close()
                    self._ring = None
            if isinstance(self.bpf, libbpf.Object):
                self.bpf.close()         # its links, programs and maps (pins stay: _detach)
                self.bpf = None
            if self.bpf is not None:
                try:
                    _cleanup(self.bpf)
                except Exception as e:
                    log.warning("%s: cleanup: %s", self.name, e)
                self.bpf = None
            self.status.attached = False


def _cleanup(bpf) -> None:
    """bpf.cleanup(), the module destroyed under BCC_LOCK (BPF.close() is its
    last step); the detaching before it, which waits for the kernel's grace
    periods, is not held up by a compile nor holds one up."""
    close = bpf.close

    def locked_close() -> None:
        with BCC_LOCK:
            close()
    bpf.close = locked_close
    bpf.cleanup()
