"""A pod-shaped cgroup with a CFS quota for the kernel tests, made where this
machine has its cpu controller (cgroup v2, or the v1 cpu hierarchy of a hybrid
host) and in the cgroup v2 hierarchy (where the agent finds a cgroup's pod),
all of it removed at the end; and its cpu.stat as the test reads it itself."""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from gpu_harness import cgroup2_root, remove_cgroup
from require import cannot_run


@dataclass(frozen=True)
class QuotaPod:
    uid: str
    path: str              # relative to the hierarchies' roots, as the agent walks them
    cpu: Path              # the pod's cgroup in the cpu controller's hierarchy
    v2: bool               # the cpu controller is cgroup v2's (else v1's)

    def cpu_stat(self) -> dict[str, int]:
        """Every field of the pod's cpu.stat."""
        return {k: int(v) for k, v in (line.split() for line in (self.cpu / "cpu.stat").read_text().splitlines())}

    def throttled_ns(self, cpu_stat: dict[str, int]) -> int:
        """The throttled time of a cpu.stat reading, in ns (v2 says µs)."""
        return cpu_stat["throttled_usec"] * 1000 if self.v2 else cpu_stat["throttled_time"]


def _v1_cpu_mount() -> Path | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _source, options = (right.split() + ["", "", ""])[:3]
        if fstype == "cgroup" and "cpu" in options.split(","):
            return Path(left.split()[4])
    return None


def _cpu_root() -> tuple[Path, bool]:
    """(root of the hierarchy with the cpu controller, whether it is cgroup v2)."""
    try:
        v2 = cgroup2_root()
    except AssertionError:
        v2 = None
    if v2 is not None and "cpu" in (v2 / "cgroup.controllers").read_text().split():
        return v2, True
    v1 = _v1_cpu_mount()
    if v1 is None:
        cannot_run("no cpu controller: neither cgroup v2's nor a v1 cpu hierarchy")
    if v2 is None:
        cannot_run("no cgroup v2 hierarchy: the agent names pods by their cgroup v2 id")
    return v1, False


@contextlib.contextmanager
def _root_cpu_enabled(root: Path, v2: bool):
    """+cpu in the v2 root's subtree_control while the block runs, taken back
    after if it was not there before (systemd hosts have it already)."""
    control = root / "cgroup.subtree_control"
    had = not v2 or "cpu" in control.read_text().split()
    if not had:
        control.write_text("+cpu")
    try:
        yield
    finally:
        if not had:
            with contextlib.suppress(OSError):
                control.write_text("-cpu")


@contextlib.contextmanager
def quota_pod(quota_us: int, period_us: int):
    """A cgroup named as the cgroupfs driver names a pod (top/pod<uid>) with
    quota_us of CPU every period_us, in the cpu controller's hierarchy and in
    cgroup v2's (the same on a v2 host); the test's processes go in `cpu` and
    are gone (exited) before the block ends."""
    if os.geteuid() != 0:
        cannot_run("making cgroups needs root")
    root, v2 = _cpu_root()
    uid = str(uuid.uuid4())
    top = f"spanlet-quota-test-{os.getpid()}-{os.urandom(3).hex()}"
    made: list[Path] = []
    with _root_cpu_enabled(root, v2):
        try:
            for hierarchy in dict.fromkeys([root, cgroup2_root()]):     # one on v2, two on hybrid
                made.append(hierarchy / top)
                made[-1].mkdir()
                if v2:
                    (hierarchy / top / "cgroup.subtree_control").write_text("+cpu")
                made.append(hierarchy / top / f"pod{uid}")
                made[-1].mkdir()
            pod = QuotaPod(uid, f"/{top}/pod{uid}", root / top / f"pod{uid}", v2)
            if v2:
                (pod.cpu / "cpu.max").write_text(f"{quota_us} {period_us}")
            else:
                (pod.cpu / "cpu.cfs_period_us").write_text(str(period_us))
                (pod.cpu / "cpu.cfs_quota_us").write_text(str(quota_us))
            yield pod
        finally:
            for d in reversed(made):
                remove_cgroup(d, tries=100)
