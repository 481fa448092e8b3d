"""Checks of the node before any program is compiled: root, tracefs and bpffs
mounted, kernel headers for BCC. Each failure says what to do about it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TRACEFS = Path("/sys/kernel/tracing")
BPFFS = Path("/sys/fs/bpf")
MODULES = Path("/lib/modules")


class EnvironmentProblem(Exception):
    """The node cannot run the agent as configured; the text says why and how to fix it."""


@dataclass(frozen=True)
class Headers:
    path: Path          # what BCC compiles against
    resolved: str       # the same, links followed, for the start-up line
    via_env: bool       # given to BCC through BCC_KERNEL_SOURCE
    origin: str = "host"    # "configured", "host" or "image"

    def describe(self) -> str:
        """The start-up line's text: whose headers, where, of which kernel."""
        release = _uts_release(Path(self.resolved.split(" (")[0]))
        of = f" (headers of {release}; running {os.uname().release})" if release else ""
        return f"{self.origin}'s {self.resolved}{of}" if self.origin != "configured" \
            else f"kernel_headers {self.resolved}{of}"


def _uts_release(tree: Path) -> str:
    """The release a header tree was made for (include/generated/utsrelease.h)."""
    try:
        text = (tree / "include" / "generated" / "utsrelease.h").read_text()
    except OSError:
        return ""
    return text.split('"')[1] if text.count('"') >= 2 else ""


def _complete_tree(path: Path) -> bool:
    """One folder holding a whole header tree, generated headers included."""
    return (path / "include" / "linux" / "kconfig.h").is_file() \
        and (path / "include" / "generated" / "autoconf.h").is_file() \
        and (path / "arch" / "x86" / "include" / "generated").is_dir()


def require_root() -> None:
    if os.geteuid() != 0:
        raise EnvironmentProblem(
            "spanlet run needs root (with CAP_BPF, CAP_PERFMON, CAP_NET_ADMIN, CAP_SYS_PTRACE, "
            "and CAP_SYS_RESOURCE where BPF memory is not charged to the memory cgroup) to load "
            "eBPF programs; run it with sudo or as the DaemonSet")


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


def find_headers(configured: str, image: str = "") -> Headers:
    """The kernel headers BCC will use. `configured` is a complete header tree
    (a kernel build folder); empty means the host's /lib/modules/<release>/build
    when it is there and complete, else `image`, a complete tree carried by the
    container image (the probes use UAPI types, tracepoint arguments and helpers
    only, so another kernel series' headers serve)."""
    release = os.uname().release
    if configured:
        path = Path(configured)
        if not (path / "include" / "linux" / "kconfig.h").is_file():
            raise EnvironmentProblem(
                f"kernel_headers={configured}: no include/linux/kconfig.h there; it must be a "
                "complete kernel header tree (a kernel build folder). For split packages such as "
                "Debian's, leave kernel_headers empty and link /lib/modules/<release>/build and "
                "source instead (scripts/setup.sh does)")
        return Headers(path, str(path.resolve()), via_env=True, origin="configured")
    build = MODULES / release / "build"
    source = MODULES / release / "source"
    tree = source if (source / "include" / "linux" / "kconfig.h").is_file() else build
    if (build / "include" / "generated" / "autoconf.h").is_file() \
            and (tree / "include" / "linux" / "kconfig.h").is_file():
        resolved = str(build.resolve())
        if source.exists():
            resolved += f" (source {source.resolve()})"
        return Headers(build, resolved, via_env=False, origin="host")
    if image and _complete_tree(Path(image)):
        return Headers(Path(image), str(Path(image).resolve()), via_env=True, origin="image")
    raise EnvironmentProblem(
        f"no kernel headers for kernel {release}: {build} is missing or incomplete"
        + (f" and the image's {image} is not a complete header tree" if image else "")
        + ". Install the headers package of the running kernel (Debian: "
        f"linux-headers-{release}, or linux-headers-cloud-amd64 and run scripts/setup.sh to "
        "link it), or set kernel_headers (SPANLET_KERNEL_HEADERS) to a complete kernel header "
        "tree")


def apply_headers(headers: Headers) -> None:
    """Point BCC at the headers; must run before the first compile."""
    if headers.via_env:
        os.environ["BCC_KERNEL_SOURCE"] = str(headers.path)
