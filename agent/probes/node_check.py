"""Checks of the node before any program is compiled: root, tracefs and bpffs
mounted, kernel headers for BCC. Each failure says what to do about it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TRACEFS = Path("/sys/kernel/tracing")
BPFFS = Path("/sys/fs/bpf")


class EnvironmentProblem(Exception):
    """The node cannot run the agent as configured; the text says why and how to fix it."""


@dataclass(frozen=True)
class Headers:
    path: Path          # what BCC compiles against
    resolved: str       # the same, links followed, for the start-up line
    via_env: bool       # given to BCC through BCC_KERNEL_SOURCE


def require_root() -> None:
    if os.geteuid() != 0:
        raise EnvironmentProblem(
            "spanlet run needs root (or CAP_BPF, CAP_PERFMON, CAP_NET_ADMIN, CAP_SYS_RESOURCE, "
            "CAP_SYS_PTRACE) to load eBPF programs; run it with sudo or as the DaemonSet")


def _mounted(path: Path) -> bool:
    try:
        return os.path.ismount(path)
    except OSError:
        return False


def require_mounts() -> None:
    missing = []
    if not _mounted(TRACEFS) and not (TRACEFS / "events").is_dir():
        missing.append(f"tracefs at {TRACEFS} (mount -t tracefs tracefs {TRACEFS})")
    if not _mounted(BPFFS):
        missing.append(f"bpffs at {BPFFS} (mount -t bpf bpf {BPFFS})")
    if missing:
        raise EnvironmentProblem("not mounted: " + "; ".join(missing)
                                 + " — scripts/setup.sh mounts both")


def find_headers(configured: str) -> Headers:
    """The kernel headers BCC will use. `configured` is a complete header tree
    (a kernel build folder); empty means BCC's own /lib/modules/<release>/build."""
    release = os.uname().release
    if configured:
        path = Path(configured)
        if not (path / "include" / "linux" / "kconfig.h").is_file():
            raise EnvironmentProblem(
                f"kernel_headers={configured}: no include/linux/kconfig.h there; it must be a "
                "complete kernel header tree (a kernel build folder). For split packages such as "
                "Debian's, leave kernel_headers empty and link /lib/modules/<release>/build and "
                "source instead (scripts/setup.sh does)")
        return Headers(path, str(path.resolve()), via_env=True)
    build = Path("/lib/modules") / release / "build"
    source = Path("/lib/modules") / release / "source"
    tree = source if (source / "include" / "linux" / "kconfig.h").is_file() else build
    if not (build / "include").is_dir() or not (tree / "include" / "linux" / "kconfig.h").is_file():
        raise EnvironmentProblem(
            f"no kernel headers for kernel {release}: {build} is missing or incomplete. Install the "
            f"headers package of the running kernel (Debian: linux-headers-{release}, or "
            "linux-headers-cloud-amd64 and run scripts/setup.sh to link it), or set kernel_headers "
            "(SPANLET_KERNEL_HEADERS) to a complete kernel header tree")
    resolved = str(build.resolve())
    if source.exists():
        resolved += f" (source {source.resolve()})"
    return Headers(build, resolved, via_env=False)


def apply_headers(headers: Headers) -> None:
    """Point BCC at the headers; must run before the first compile."""
    if headers.via_env:
        os.environ["BCC_KERNEL_SOURCE"] = str(headers.path)
