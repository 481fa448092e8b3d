"""The capabilities the agent needs, checked at start-up: one line for each that
is missing, saying what fails without it.

CAP_SYS_ADMIN, not CAP_BPF and CAP_PERFMON: BCC (0.26) opens the maps that
span_ctx pins for the other probes by their id (BPF_MAP_GET_FD_BY_ID), which the
kernel allows only with CAP_SYS_ADMIN; and CAP_SYS_ADMIN allows all that CAP_BPF
and CAP_PERFMON do, so those two would add nothing. CAP_SYS_RESOURCE is needed
only where the kernel still charges BPF memory to RLIMIT_MEMLOCK (before 5.11):
that is checked on the running kernel by creating a map under a zero limit, not
assumed from the release."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

from spanlet.probes import bpf_sys

# Capability numbers (linux/capability.h).
CAP_NUMBERS = {"NET_ADMIN": 12, "SYS_PTRACE": 19, "SYS_ADMIN": 21, "SYS_RESOURCE": 24,
               "PERFMON": 38, "BPF": 39}

WHAT_FAILS = {
    # With CAP_BPF and CAP_PERFMON held: programs load and attach, but the maps
    # span_ctx pins for the other probes are opened by BCC by their id.
    "SYS_ADMIN": "BPF_MAP_GET_FD_BY_ID is refused: the probes cannot open the span context maps "
                 "that span_ctx pins (BCC opens a pinned map by its id), so gpu_launch and "
                 "mmap_sandbox fail to load",
    # Without CAP_BPF/CAP_PERFMON either.
    "SYS_ADMIN-alone": "bpf() and perf_event_open are refused (no CAP_BPF or CAP_PERFMON either): "
                       "no probe loads",
    "NET_ADMIN": "no clsact qdisc or TC filter can be added: the tc probe fails "
                 "(no network metrics, no wire bytes on spans)",
    "SYS_PTRACE": "/proc/<pid>/maps and /proc/<pid>/root of other users' processes are "
                  "unreadable: their GPU and span marker libraries are neither found nor attached",
    "SYS_RESOURCE": "this kernel charges BPF maps to RLIMIT_MEMLOCK and the limit cannot be "
                    "raised: maps larger than the limit are refused",
}

# Run in a child (the limit is lowered there only): a one-entry array map is
# created under the limit the agent has, then again under RLIMIT_MEMLOCK 0.
# Exit 0: both made (BPF memory is charged to the memory cgroup); 1: the second
# refused with EPERM (charged to RLIMIT_MEMLOCK); 2: not even the first (no bpf()).
_MEMCG_PROBE = r"""
import ctypes, os, resource, sys
libc = ctypes.CDLL(None, use_errno=True)
NR, MAP_CREATE, MAP_TYPE_ARRAY = map(int, sys.argv[1:4])     # bpf_sys's, as arguments
attr = (ctypes.c_uint32 * 18)(MAP_TYPE_ARRAY, 4, 8, 1)      # key 4, value 8, 1 entry
def make():
    fd = libc.syscall(NR, MAP_CREATE, ctypes.byref(attr), ctypes.sizeof(attr))
    if fd >= 0:
        os.close(fd)
        return 0
    return ctypes.get_errno()
if make():
    sys.exit(2)
resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))
err = make()
sys.exit(0 if err == 0 else 1 if err == 1 else 2)
"""


def memcg_charged() -> bool | None:
    """True where BPF maps are charged to the memory cgroup (no RLIMIT_MEMLOCK
    needed), False where to RLIMIT_MEMLOCK, None when bpf() itself is refused."""
    if bpf_sys.NR is None:
        return None
    try:
        rc = subprocess.run([sys.executable, "-I", "-S", "-c", _MEMCG_PROBE, str(bpf_sys.NR),
                             str(bpf_sys.MAP_CREATE), str(bpf_sys.MAP_TYPE_ARRAY)],
                            timeout=30, capture_output=True).returncode
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {0: True, 1: False}.get(rc)


def effective_capabilities(status_text: str | None = None) -> set[str]:
    """The named capabilities in this process's effective set (/proc/self/status)."""
    if status_text is None:
        with open("/proc/self/status") as f:
            status_text = f.read()
    mask = 0
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            mask = int(line.split()[1], 16)
    return {name for name, bit in CAP_NUMBERS.items() if mask >> bit & 1}


@dataclass
class Privileges:
    needed: list[str]
    missing: list[str]
    memcg: bool | None
    held: set[str] = field(default_factory=set)

    def missing_lines(self) -> list[str]:
        lines = []
        for cap in self.missing:
            why = WHAT_FAILS[cap]
            if cap == "SYS_ADMIN" and not {"BPF", "PERFMON"} <= self.held:
                why = WHAT_FAILS["SYS_ADMIN-alone"]
            lines.append(f"capability CAP_{cap} missing: {why}")
        return lines

    def summary(self) -> str:
        text = "capabilities needed: " + " ".join(self.needed)
        text += f"; held: {' '.join(c for c in self.needed if c in self.held) or 'none'}"
        if self.memcg:
            text += "; SYS_RESOURCE not needed: BPF memory is charged to the memory cgroup (checked)"
        elif self.memcg is False:
            text += "; BPF memory is charged to RLIMIT_MEMLOCK on this kernel (checked)"
        return text


def check(tc_enabled: bool, caps: set[str] | None = None,
          memcg: bool | None | str = "probe") -> Privileges:
    """What the agent needs on this kernel and what of it this process lacks.
    CAP_SYS_ADMIN covers what CAP_BPF and CAP_PERFMON allow (bpf(),
    perf_event_open) and BPF_MAP_GET_FD_BY_ID besides, which BCC needs to open
    a pinned map: so it alone is needed for those, on any kernel from 4.x on."""
    caps = effective_capabilities() if caps is None else caps
    memcg = memcg_charged() if memcg == "probe" else memcg
    needed = ["SYS_ADMIN"] + (["NET_ADMIN"] if tc_enabled else []) + ["SYS_PTRACE"]
    if memcg is False:
        needed.append("SYS_RESOURCE")
    return Privileges(needed, [c for c in needed if c not in caps], memcg, set(caps))
