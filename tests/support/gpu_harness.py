"""What the GPU probe's tests share: where cgroup v2 is mounted, the cgroup id
the kernel stamps a process's records with, and one cgroup's share of the
probe's counts."""

from __future__ import annotations

import os
from pathlib import Path


def cgroup2_root() -> Path:
    """Where cgroup v2 is mounted (/sys/fs/cgroup, or .../unified on hybrid hosts)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[fields.index("-") + 1] == "cgroup2":
            return Path(fields[4])
    raise AssertionError("cgroup v2 is not mounted")


def cgroup_id(pid: int) -> int:
    """What bpf_get_current_cgroup_id() returns for that process (cgroup v2)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return os.stat(f"{cgroup2_root()}{line[3:]}").st_ino
    raise AssertionError(f"pid {pid} has no cgroup v2 entry")


def counts(table: dict, cg: int) -> dict:
    """The entries of launches()/sync_wait() for one cgroup."""
    return {k: v for k, v in table.items() if k[0] == cg}
