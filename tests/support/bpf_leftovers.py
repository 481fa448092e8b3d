"""What a process holds of BPF and whether it is gone: the ids of the programs
and maps a process has open (its fdinfo), and which of them are still loaded
once the kernel had time to free them."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path


def bpf_ids(pid: int) -> tuple[set[int], set[int]]:
    """Ids of the BPF programs and maps process `pid` holds open."""
    progs, maps = set(), set()
    for f in Path(f"/proc/{pid}/fdinfo").iterdir():
        try:
            text = f.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("prog_id:"):
                progs.add(int(line.split()[1]))
            elif line.startswith("map_id:"):
                maps.add(int(line.split()[1]))
    return progs, maps


def bpftool_ids(kind: str) -> set[int]:
    out = subprocess.run(["bpftool", "-j", kind, "show"], capture_output=True, text=True,
                         check=True).stdout
    return {p["id"] for p in json.loads(out or "[]")}


def still_loaded(ids: set[int], kind: str, grace_s: float = 5.0) -> set[int]:
    """Which of `ids` are still loaded once the kernel has had `grace_s` to
    free them (it frees programs and maps from deferred work, late under load)."""
    deadline = time.monotonic() + grace_s
    left = ids & bpftool_ids(kind)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left &= bpftool_ids(kind)
    return left
