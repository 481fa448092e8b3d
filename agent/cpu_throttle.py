"""CFS quota throttling of each pod: the throttled time in the cpu.stat of
the pod's own cgroup (cgroup v2, or the cpu controller's v1 hierarchy), read
when asked (scrape or export time)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from spanlet.cgroups import _unescape_mountinfo, cgroup2_root, pod_directory

log = logging.getLogger(__name__)

MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class CpuHierarchy:
    """Where the cpu controller's cgroups are and how their cpu.stat says the
    throttled time; `ids_root` is the cgroup v2 mount, where a cgroup's id
    (the one the agent's pod names are found by) is read: `root` itself on
    cgroup v2, the unified hierarchy of a hybrid host, None on a v1-only one."""
    root: Path
    field: str                 # the cpu.stat field of the throttled time
    units_per_second: int      # µs on v2, ns on v1
    ids_root: Path | None


def _cpu_v1_mount(mountinfo: str) -> Path | None:
    """Mount point of the cgroup v1 hierarchy that has the cpu controller
    (alone or as cpu,cpuacct), from /proc/self/mountinfo text."""
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, fs = left.split(), right.split()
        if sep and len(fields) >= 5 and len(fs) >= 3 and fs[0] == "cgroup" \
                and "cpu" in fs[2].split(","):
            return Path(_unescape_mountinfo(fields[4]))
    return None


def find_hierarchy(mountinfo_path: str = MOUNTINFO) -> CpuHierarchy | None:
    """cgroup v2 where its root offers the cpu controller, else the cpu
    controller's v1 hierarchy (v1-only and hybrid hosts); None without either."""
    v2 = cgroup2_root(mountinfo_path)
    try:
        if v2 is not None and "cpu" in (v2 / "cgroup.controllers").read_text().split():
            return CpuHierarchy(v2, "throttled_usec", 10**6, v2)
        v1 = _cpu_v1_mount(Path(mountinfo_path).read_text())
    except OSError as e:
        log.warning("cpu throttling: cannot tell where the cpu controller is: %s", e)
        return None
    return CpuHierarchy(v1, "throttled_time", 10**9, v2) if v1 is not None else None


def throttled_seconds(cpu_stat: str, h: CpuHierarchy) -> float | None:
    """The throttled time of one cpu.stat text in seconds; None where it has
    none (the cpu controller is not enabled for that cgroup)."""
    for line in cpu_stat.splitlines():
        name, _, value = line.partition(" ")
        if name == h.field:
            return int(value) / h.units_per_second
    return None


def pod_cgroups(root: Path) -> list[str]:
    """Paths (relative to root, with a leading /) of the pods' own cgroups:
    the cgroups that the pod naming of agent/cgroups.py makes a pod's
    directory. Containers, below their pod, are not walked."""
    pods = []
    for dirpath, dirs, _files in os.walk(root):
        path = "/" + os.path.relpath(dirpath, root).lstrip(".")
        if pod_directory(path) == path:
            pods.append(path)
            dirs.clear()
    return sorted(pods)


def _cgroup_id(h: CpuHierarchy, path: str) -> int:
    """The pod cgroup's id in the cgroup v2 hierarchy; 0 where it has none."""
    try:
        return os.stat(h.ids_root / path.lstrip("/")).st_ino if h.ids_root is not None else 0
    except OSError:
        return 0


class PodCpuThrottle:
    """Each pod's throttled time, read from the files when asked. The pod's
    own cgroup holds the pod's quota (the sum of its containers' limits), so
    its own cpu.stat is the pod's throttling; the containers' cgroups, below
    it, are not added (that would count it again). A process in no pod (a
    service of the node, a bare process) has no pod cgroup and gives no
    sample. A pod gone between the walk and the read, or a cpu.stat that
    cannot be read or has no throttled time, is left out: the others are
    still read."""

    def __init__(self, hierarchy: CpuHierarchy | None = None, mountinfo_path: str = MOUNTINFO):
        self._hierarchy = hierarchy
        self._mountinfo_path = mountinfo_path
        self._looked = hierarchy is not None

    @property
    def hierarchy(self) -> CpuHierarchy | None:
        """Found at the first read, not when the engine is built."""
        if not self._looked:
            self._hierarchy, self._looked = find_hierarchy(self._mountinfo_path), True
        return self._hierarchy

    def throttled(self) -> dict[int, float]:
        """Throttled seconds by pod cgroup id (cgroup v2; 0 for pods without
        one, on a v1-only host: their times are added together)."""
        h = self.hierarchy
        out: dict[int, float] = {}
        if h is None:
            return out
        for path in pod_cgroups(h.root):
            try:
                seconds = throttled_seconds((h.root / path.lstrip("/") / "cpu.stat").read_text(), h)
            except (OSError, ValueError) as e:
                log.debug("cpu throttling: %s: %s", path, e)
                continue
            if seconds is not None:
                cid = _cgroup_id(h, path)
                out[cid] = out.get(cid, 0.0) + seconds
        return out
