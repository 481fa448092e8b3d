"""What the GPU probe's tests share: where cgroup v2 is mounted, the cgroup id
the kernel stamps a process's records with, one cgroup's share of the probe's
counts, the workload's script lines, and spans to put it in."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

from spanlet.events import Modality


def cgroup2_root() -> Path:
    """Where cgroup v2 is mounted (/sys/fs/cgroup, or .../unified on hybrid hosts)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[fields.index("-") + 1] == "cgroup2":
            return Path(fields[4])
    raise AssertionError("cgroup v2 is not mounted")


def remove_cgroup(path: Path, tries: int = 50) -> None:
    """rmdir a test's cgroup, waiting for its last process to be on its way out."""
    for _ in range(tries):
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def cgroup_id(pid: int) -> int:
    """What bpf_get_current_cgroup_id() returns for that process (cgroup v2)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return os.stat(f"{cgroup2_root()}{line[3:]}").st_ino
    raise AssertionError(f"pid {pid} has no cgroup v2 entry")


def counts(table: dict, cg: int) -> dict:
    """The entries of launches()/sync_wait() for one cgroup."""
    return {k: v for k, v in table.items() if k[0] == cg}


def mine(libs, folder: Path) -> list:
    """The attached libraries under `folder` (other processes on the host may
    map a libcuda of their own)."""
    return [lib for lib in libs if lib.path.startswith(str(folder) + "/")]


def read_events(probe, pid: int, n: int, timeout_s: float = 10.0) -> list:
    """Poll until `n` records of `pid` arrived, then a little more to catch extras."""
    deadline = time.monotonic() + timeout_s
    of_pid = lambda: [e for e in probe.seen if e.hdr.pid == pid]  # noqa: E731
    while len(of_pid()) < n and time.monotonic() < deadline:
        probe.poll(50)
    probe.poll(50)
    probe.drain()
    return of_pid()


def launch_line(api: str, n: int, grid, block, shmem: int, stream: int, func: int | None = None) -> str:
    """A workload script line: `n` launches through entry point `api` (its real
    name, or the short cu, cuex, cuda), optionally naming another function."""
    tail = f" {func:#x}" if func is not None else ""
    return (f"{api} {n} {' '.join(map(str, grid))} {' '.join(map(str, block))} {shmem} "
            f"{stream:#x}{tail}")


def launches(api: str, n: int, stream: int = 0) -> str:
    """`n` launches through `api` with unit dims."""
    return launch_line(api, n, (1, 1, 1), (1, 1, 1), 0, stream)


def ids() -> tuple[bytes, int]:
    """A fresh (trace id, span id)."""
    return secrets.token_bytes(16), int.from_bytes(secrets.token_bytes(8), "big") | 1


def in_span(span, w, modality=Modality.text) -> tuple[bytes, int]:
    """Put workload `w`'s thread in a fresh span (the span context probe `span`)."""
    trace_id, span_id = ids()
    span.set(w.tid, trace_id, span_id, modality)
    return trace_id, span_id


MODES = {  # label → GPU probe settings
    "default": dict(timing=False, runtime_hooks=False),       # one entry-only driver probe
    "timed+runtime": dict(timing=True, runtime_hooks=True),   # both layers, return probes
}
