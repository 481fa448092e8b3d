"""cgroup v2 ids as the kernel reports them (bpf_get_current_cgroup_id) →
cgroup paths → container id and pod UID, for the cgroupfs and systemd
drivers with containerd, CRI-O and Docker naming."""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_HEX64 = r"[0-9a-f]{64}"
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"

# Container leaf of a cgroup path, most specific first.
_CONTAINER = [
    ("containerd", re.compile(rf"(?:^|/)cri-containerd-({_HEX64})\.scope$")),
    ("cri-o", re.compile(rf"(?:^|/)crio-(?:conmon-)?({_HEX64})\.scope$")),
    ("cri-o", re.compile(rf"(?:^|/)crio-({_HEX64})$")),
    ("docker", re.compile(rf"(?:^|/)docker-({_HEX64})\.scope$")),
    ("docker", re.compile(rf"^/docker/({_HEX64})$")),
    # cgroupfs driver under kubepods: the bare id (containerd, or docker via cri-dockerd)
    ("containerd", re.compile(rf"/pod{_UID}/({_HEX64})$")),
]
_POD = re.compile(rf"(?:/kubepods[^/]*-pod|/pod)({_UID})(?:\.slice)?(?:/|$)")


@dataclass(frozen=True)
class Container:
    runtime: str = ""
    container_id: str = ""
    pod_uid: str = ""


def parse_cgroup_path(path: str) -> Container:
    """Container and pod of a cgroup v2 path (relative to the cgroup2 root);
    empty fields where the path names none (a host service, say)."""
    path = "/" + path.strip("/")
    runtime = cid = ""
    for name, pattern in _CONTAINER:
        m = pattern.search(path)
        if m:
            runtime, cid = name, m.group(1)
            break
    m = _POD.search(path)
    pod_uid = m.group(1).replace("_", "-") if m else ""
    return Container(runtime, cid, pod_uid)


def pod_directory(path: str) -> str | None:
    """The pod's own cgroup (the slice or directory every container of the
    pod is under) of a cgroup path, or None where the path names no pod."""
    path = "/" + path.strip("/")
    m = _POD.search(path)
    return path[:m.end()].rstrip("/") if m else None


def cgroups_under(root: Path, path: str) -> frozenset[int]:
    """The ids of the cgroup at `path` (relative to root) and of every cgroup
    below it, as the file system shows them now; empty if it is gone."""
    ids = set()
    for dirpath, _dirs, _files in os.walk(root / path.lstrip("/")):
        try:
            ids.add(os.stat(dirpath).st_ino)
        except OSError:
            continue
    return frozenset(ids)


class CgroupError(Exception):
    """A cgroup named in the config does not exist, or there is no cgroup v2."""


# -- cgroup paths of the config ----------------------------------------------------------------------
def _unescape_mountinfo(field_: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field_)


def cgroup2_mount(mountinfo: str) -> str:
    """Mount point of the cgroup v2 hierarchy from /proc/self/mountinfo text."""
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields = left.split()
        if right.split()[:1] == ["cgroup2"] and len(fields) >= 5:
            return _unescape_mountinfo(fields[4])
    raise CgroupError("no cgroup2 file system is mounted (/proc/self/mountinfo); "
                     "grants by cgroup need cgroup v2")


class CgroupResolver:
    """cgroup v2 paths of the config → cgroup ids (the directory's inode
    number, which is what bpf_get_current_cgroup_id returns)."""

    def __init__(self, mount: str | None = None):
        self._mount = mount

    @property
    def mount(self) -> str:
        if self._mount is None:
            self._mount = cgroup2_mount(Path("/proc/self/mountinfo").read_text())
        return self._mount

    def directory(self, path: str) -> Path:
        """Absolute paths inside the mount are used as they are; other absolute
        paths are cgroup paths as /proc/<pid>/cgroup shows them; relative
        paths are relative to the mount."""
        mount = Path(self.mount)
        p = Path(path)
        if p.is_absolute() and (p == mount or mount in p.parents):
            return p
        return mount / path.lstrip("/")

    def id(self, path: str) -> int:
        d = self.directory(path)
        try:
            st = os.stat(d)
        except FileNotFoundError:
            raise CgroupError(f"cgroup {path!r} does not exist ({d})") from None
        except OSError as e:
            raise CgroupError(f"cgroup {path!r}: {d}: {e.strerror}") from None
        if not os.path.isfile(d / "cgroup.procs"):
            raise CgroupError(f"cgroup {path!r}: {d} is not a cgroup v2 directory")
        return st.st_ino


def cgroup2_root(mountinfo_path: str = "/proc/self/mountinfo") -> Path | None:
    """Mount point of the cgroup v2 hierarchy, or None."""
    try:
        return Path(cgroup2_mount(Path(mountinfo_path).read_text()))
    except (OSError, CgroupError):
        return None


def cgroup_id(path: str | os.PathLike) -> int:
    """The id the kernel gives a cgroup v2 directory: its inode number."""
    return os.stat(path).st_ino


class CgroupIndex:
    """cgroup id → path relative to the cgroup2 root. Built by walking the
    hierarchy; an unknown id triggers a rescan at most every `rescan_s`."""

    def __init__(self, root: Path | None = None, rescan_s: float = 2.0):
        self.root = root if root is not None else cgroup2_root()
        self.rescan_s = rescan_s
        self._paths: dict[int, str] = {}
        self._pod_dirs: dict[str, str] = {}       # pod uid -> the pod's cgroup path
        self._scanned_at = float("-inf")
        self._lock = threading.Lock()

    def _scan(self) -> None:
        paths: dict[int, str] = {}
        if self.root is not None:
            for dirpath, _dirs, _files in os.walk(self.root):
                try:
                    paths[os.stat(dirpath).st_ino] = "/" + os.path.relpath(dirpath, self.root).lstrip(".")
                except OSError:
                    continue
        pod_dirs: dict[str, str] = {}
        for p in paths.values():
            uid = parse_cgroup_path(p).pod_uid
            if uid and uid not in pod_dirs:
                pod_dirs[uid] = pod_directory(p)
        self._paths, self._pod_dirs = paths, pod_dirs
        self._scanned_at = time.monotonic()

    def path(self, cid: int) -> str | None:
        with self._lock:
            p = self._paths.get(cid)
            if p is None and time.monotonic() - self._scanned_at >= self.rescan_s:
                self._scan()
                p = self._paths.get(cid)
            return p

    def pod_cgroups(self, pod_uid: str) -> frozenset[int]:
        """Every cgroup of the pod (its own and its containers', as they are
        now); empty where the pod has no cgroup on this node. An unknown pod
        triggers a rescan, at most every `rescan_s`."""
        with self._lock:
            d = self._pod_dirs.get(pod_uid)
            if d is None and time.monotonic() - self._scanned_at >= self.rescan_s:
                self._scan()
                d = self._pod_dirs.get(pod_uid)
        return cgroups_under(self.root, d) if d and self.root is not None else frozenset()

    def same_pod(self, cid: int) -> frozenset[int]:
        """The cgroups that count as the same sender as cgroup `cid`: every
        cgroup of its pod when it is a pod's (or a pod container's) cgroup,
        else the cgroup alone."""
        p = self.path(cid)
        d = pod_directory(p) if p else None
        if d is None or self.root is None:
            return frozenset({cid})
        return cgroups_under(self.root, d) | {cid}

    def container(self, cid: int) -> Container:
        p = self.path(cid)
        return parse_cgroup_path(p) if p else Container()
