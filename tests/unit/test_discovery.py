"""Library discovery against fake /proc trees: what is matched, what is read
when, containers, vanished processes and files, and the cost of a scan."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from spanlet.discovery import PF_KTHREAD, LibraryFinder, MapsWatch, library_pattern

NAMES = ["libcuda.so", "libcudart.so"]


class FakeProc:
    """A /proc with processes whose root folders hold their library files."""

    def __init__(self, root: Path):
        self.root = root
        self.root.mkdir(exist_ok=True)
        self.files = root.parent / "files"
        self.files.mkdir(exist_ok=True)

    def lib_file(self, name: str, content: bytes = b"\x7fELF") -> Path:
        f = self.files / name
        if not f.exists():
            f.write_bytes(content + name.encode())
        return f

    def add(self, pid: int, libs: dict[str, Path] = {}, starttime: int = 1000, vsize: int = 4096,
            flags: int = 0x400000, comm: str = "worker (1) x", deleted: set[str] = frozenset(),
            filler: int = 0) -> None:
        """Process `pid` mapping each file `libs[path]` at `path` inside its root."""
        d = self.root / str(pid)
        (d / "root").mkdir(parents=True, exist_ok=True)
        (d / "map_files").mkdir(exist_ok=True)
        self.set_stat(pid, starttime, vsize, flags, comm)
        lines = [f"{0x5000 + i:08x}-{0x6000 + i:08x} r--p 00000000 00:00 0 " for i in range(filler)]
        lines += ["55d0c0000000-55d0c0021000 r-xp 00000000 fd:01 131 /usr/bin/python3.11"]
        for n, (path, f) in enumerate(libs.items()):
            inside = d / "root" / path.lstrip("/")
            inside.parent.mkdir(parents=True, exist_ok=True)
            if path not in deleted and not inside.exists():
                os.link(f, inside)
            st = os.stat(f)
            start, end = 0x7F0000000000 + n * 0x100000, 0x7F0000000000 + n * 0x100000 + 0x2000
            os.link(f, d / "map_files" / f"{start:x}-{end:x}")
            dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
            for seg, perms in enumerate(("r--p", "r-xp", "rw-p")):
                suffix = " (deleted)" if path in deleted else ""
                lines.append(f"{start:012x}-{end:012x} {perms} {seg * 0x1000:08x} {dev} {st.st_ino}"
                             f"                     {path}{suffix}")
        lines.append("7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]")
        (d / "maps").write_text("\n".join(lines) + "\n")

    def set_stat(self, pid: int, starttime: int, vsize: int, flags: int = 0x400000,
                 comm: str = "worker (1) x") -> None:
        rest = ["S", "1", "1", "1", "0", "-1", str(flags)] + ["0"] * 12 + [str(starttime), str(vsize)]
        rest += ["100"] * 20
        (self.root / str(pid) / "stat").write_text(f"{pid} ({comm}) {' '.join(rest)}\n")

    def add_map(self, pid: int, path: str, f: Path, vsize: int) -> None:
        """The process dlopen()s one more library."""
        d = self.root / str(pid)
        inside = d / "root" / path.lstrip("/")
        inside.parent.mkdir(parents=True, exist_ok=True)
        os.link(f, inside)
        st = os.stat(f)
        dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
        with open(d / "maps", "a") as m:
            m.write(f"7f1000000000-7f1000002000 r-xp 00000000 {dev} {st.st_ino} {path}\n")
        fields = (d / "stat").read_text().rpartition(")")[2].split()
        self.set_stat(pid, int(fields[19]), vsize)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def proc(tmp_path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


def finder(proc: FakeProc, clock=None, full_rescan_s: float = 30.0) -> LibraryFinder:
    return LibraryFinder(NAMES, proc=proc.root, full_rescan_s=full_rescan_s,
                         clock=clock or time.monotonic)


def test_names_match_whole_file_names_and_their_versions():
    p = library_pattern(["libcuda.so"])
    line = "7f0000000000-7f0000001000 r-xp 00000000 08:01 12 {}"
    match = lambda path: bool(p.search(line.format(path)))  # noqa: E731
    assert match("/usr/lib/x86_64-linux-gnu/libcuda.so.1")
    assert match("/usr/lib64/libcuda.so.535.104.05")
    assert match("/opt/with space/libcuda.so")
    assert match("/usr/lib/libcuda.so.1 (deleted)")
    assert not match("/usr/lib/libcudart.so.12")
    assert not match("/usr/lib/libcuda.sox")
    assert not match("/usr/lib/libcuda.so.d/libfoo.so")
    assert not match("/usr/lib/mylibcuda.so")


def test_wheel_layouts_and_hash_renamed_copies_match_under_the_configured_name(proc):
    p = library_pattern(["libcudart.so"])
    line = "7f0000000000-7f0000001000 r-xp 00000000 08:01 12 {}"
    match = lambda path: bool(p.search(line.format(path)))  # noqa: E731
    site = "/usr/local/lib/python3.11/site-packages/nvidia"
    assert match(f"{site}/cuda_runtime/lib/libcudart.so.12")   # nvidia-cuda-runtime-cu12
    assert match(f"{site}/cu13/lib/libcudart.so.13")            # the CUDA 13 wheel
    assert match("/opt/venv/lib/python3.12/site-packages/somepkg.libs/libcudart-1a2b3c4d.so.12")
    assert not match("/usr/lib/libcudart-static.so.12")
    assert not match("/usr/lib/libcudart-1a2b3c4.so.12")        # not auditwheel's 8 hex digits
    hashed = proc.lib_file("libcudart-9f8e7d6c.so.12")
    proc.add(100, {f"{site}/../pkg.libs/libcudart-9f8e7d6c.so.12": hashed})
    (lib,) = finder(proc).refresh()
    assert lib.name == "libcudart.so" and lib.path.endswith("libcudart-9f8e7d6c.so.12")


def test_each_library_inode_is_reported_once_with_the_pid_first_seen(proc):
    cuda, cudart = proc.lib_file("libcuda.so.1"), proc.lib_file("libcudart.so.12")
    proc.add(100, {"/usr/lib/libcuda.so.1": cuda, "/usr/lib/libcudart.so.12": cudart})
    f = finder(proc)
    new = f.refresh()
    assert sorted((lib.name, lib.path, lib.pid) for lib in new) == [
        ("libcuda.so", "/usr/lib/libcuda.so.1", 100),
        ("libcudart.so", "/usr/lib/libcudart.so.12", 100)]
    lib = next(x for x in new if x.name == "libcuda.so")
    st = os.stat(cuda)
    assert lib.key == (st.st_dev, st.st_ino)
    assert lib.open_path == f"{proc.root}/100/root/usr/lib/libcuda.so.1"

    # The same file mapped by a container at another path: not new.
    proc.add(200, {"/opt/cuda/lib64/libcuda.so.1": cuda})
    assert f.refresh() == []
    # Another copy (another inode) is new, first seen in its own process.
    proc.add(300, {"/opt/cuda/lib64/libcuda.so.1": proc.lib_file("libcuda.so.535")})
    assert [(x.pid, x.path) for x in f.refresh()] == [(300, "/opt/cuda/lib64/libcuda.so.1")]
    assert len(f.libraries) == 3


def test_kernel_threads_are_never_read(proc):
    proc.add(2, {"/lib/libcuda.so.1": proc.lib_file("libcuda.so.1")}, flags=PF_KTHREAD | 0x40,
             vsize=0, comm="kthreadd")
    f = finder(proc)
    assert f.refresh() == []
    assert (f.stats.maps_read, f.stats.kernel_threads) == (0, 1)
    assert f.refresh() == [] and f.stats.maps_read == 0


def test_known_processes_are_reread_only_when_their_mappings_change(proc):
    clock = Clock()
    proc.add(100, {})
    f = finder(proc, clock)
    assert f.refresh() == [] and f.stats.maps_read == 1
    assert f.refresh() == [] and (f.stats.stats_read, f.stats.maps_read) == (1, 0)

    # dlopen() later: the mapped size changes, the maps are read again.
    proc.add_map(100, "/usr/lib/libcudart.so.12", proc.lib_file("libcudart.so.12"), vsize=8192)
    assert [lib.path for lib in f.refresh()] == ["/usr/lib/libcudart.so.12"]
    assert f.stats.maps_read == 1

    # A mapping change that keeps the size is found by the periodic full read.
    proc.add_map(100, "/usr/lib/libcuda.so.1", proc.lib_file("libcuda.so.1"), vsize=8192)
    assert f.refresh() == []
    clock.t += 31
    assert [lib.path for lib in f.refresh()] == ["/usr/lib/libcuda.so.1"]


def test_a_reused_pid_is_read_as_a_new_process(proc):
    clock = Clock()
    proc.add(100, {}, starttime=1000)
    f = finder(proc, clock)
    f.refresh()
    proc.add(100, {"/lib/libcuda.so.1": proc.lib_file("libcuda.so.1")}, starttime=2000)
    assert [(lib.pid, lib.path) for lib in f.refresh()] == [(100, "/lib/libcuda.so.1")]


def test_libraries_in_another_mount_namespace_open_through_the_process_root(proc):
    # Nothing at /opt/conda/... in this namespace: only <pid>/root leads to it.
    proc.add(100, {"/opt/conda/lib/libcudart.so.12": proc.lib_file("libcudart.so.12")})
    assert not Path("/opt/conda/lib/libcudart.so.12").exists()
    (lib,) = finder(proc).refresh()
    assert lib.open_path == f"{proc.root}/100/root/opt/conda/lib/libcudart.so.12"


def test_deleted_or_replaced_files_open_through_map_files(proc):
    old = proc.lib_file("libcuda.so.1")
    proc.add(100, {"/lib/libcuda.so.1": old}, deleted={"/lib/libcuda.so.1"})
    (lib,) = finder(proc).refresh()
    assert lib.open_path == f"{proc.root}/100/map_files/7f0000000000-7f0000002000"
    assert lib.path == "/lib/libcuda.so.1"

    # The name now leads to a new file (an upgrade) while the old is mapped.
    proc.add(200, {"/lib/libcuda.so.1": proc.lib_file("libcuda.so.2")})
    (proc.root / "200/root/lib/libcuda.so.1").unlink()
    os.link(proc.lib_file("libcuda.so.3"), proc.root / "200/root/lib/libcuda.so.1")
    f = finder(proc)
    by_pid = {lib.pid: lib for lib in f.refresh()}
    assert by_pid[200].open_path.startswith(f"{proc.root}/200/map_files/")
    assert os.stat(by_pid[200].open_path).st_ino == by_pid[200].key[1]


def test_processes_and_files_that_vanish_mid_scan_are_skipped(proc):
    cuda = proc.lib_file("libcuda.so.1")
    proc.add(100, {"/lib/libcuda.so.1": cuda})
    (proc.root / "100/maps").unlink()               # exited after its stat was read
    (proc.root / "101").mkdir()                     # exited before anything was read
    proc.add(102, {"/lib/libcuda.so.1": cuda})
    (proc.root / "102/root/lib/libcuda.so.1").unlink()  # unmapped, file gone
    for p in (proc.root / "102/map_files").iterdir():
        p.unlink()
    f = finder(proc)
    assert f.refresh() == [] and f.libraries == []

    # Seen again in a live process: found then.
    proc.add(103, {"/lib/libcuda.so.1": cuda})
    assert [lib.pid for lib in f.refresh()] == [103]


def test_forget_lets_a_library_be_found_again(proc):
    proc.add(100, {"/lib/libcuda.so.1": proc.lib_file("libcuda.so.1")})
    f = finder(proc)
    (lib,) = f.refresh()
    assert f.refresh() == []
    f.forget(lib.key)
    assert [x.key for x in f.refresh()] == [lib.key]


def test_exited_processes_are_forgotten(proc):
    proc.add(100, {})
    f = finder(proc)
    f.refresh()
    _remove(proc.root / "100")
    f.refresh()
    assert f._seen == {}


def test_scan_cost_with_200_processes(proc, capsys):
    """Reads every maps file once, then only stat lines; prints the cost."""
    cuda = proc.lib_file("libcuda.so.1")
    for pid in range(1000, 1200):
        libs = {"/usr/lib/libcuda.so.1": cuda} if pid % 20 == 0 else {}
        proc.add(pid, libs, filler=300)  # ~300 mappings, a typical Python process
    for pid in range(2, 60):
        proc.add(pid, {}, flags=PF_KTHREAD, vsize=0)
    f = finder(proc)
    assert len(f.refresh()) == 1
    first = f.stats
    assert (first.processes, first.maps_read, first.kernel_threads) == (258, 200, 58)
    f.refresh()
    again = f.stats
    assert (again.stats_read, again.maps_read) == (258, 0)
    with capsys.disabled():
        print(f"\n  discovery scan, 200 processes + 58 kernel threads: first {first.seconds * 1e3:.1f} ms, "
              f"incremental {again.seconds * 1e3:.1f} ms")


def test_libraries_no_process_maps_any_more_are_reported_after_a_grace(proc):
    clock = Clock()
    cuda = proc.lib_file("libcuda.so.1")
    proc.add(100, {"/lib/libcuda.so.1": cuda})
    proc.add(101, {"/lib/libcuda.so.1": cuda})
    f = finder(proc, clock)
    (lib,) = f.refresh()
    assert f.unmapped(0) == []
    _remove(proc.root / "100")           # one of two users exits: still mapped
    f.refresh()
    assert f.unmapped(0) == []
    _remove(proc.root / "101")
    f.refresh()
    clock.t += 5
    assert f.unmapped(10) == [] and f.unmapped(5) == [lib]
    # Mapped again within the grace: kept.
    proc.add(102, {"/lib/libcuda.so.1": cuda})
    f.refresh()
    assert f.unmapped(0) == []


def _remove(d: Path) -> None:
    for p in sorted(d.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()
    d.rmdir()


# -- with the kernel's watch of changed processes (MapsWatch) ---------------------
class KernelChanges:
    """What bpf/span_ctx.bpf.c's maps_changed_pids would hold: pids the
    kernel saw exec, map a file executable or exit; drained on each take."""

    def __init__(self):
        self.pids: set[int] = set()
        self.drains = 0

    def __call__(self) -> list[int]:
        self.drains += 1
        pids, self.pids = sorted(self.pids), set()
        return pids


def watched(proc: FakeProc, changes: KernelChanges, clock: Clock, watch: MapsWatch | None = None):
    watch = watch or MapsWatch(changes)
    return LibraryFinder(NAMES, proc=proc.root, full_rescan_s=30.0, clock=clock,
                         watch=watch.subscribe())


def test_with_the_watch_only_the_processes_the_kernel_named_are_read(proc):
    clock, changes = Clock(), KernelChanges()
    for pid in range(100, 300):
        proc.add(pid, {}, filler=50)
    f = watched(proc, changes, clock)
    assert f.refresh() == [] and f.stats.full and f.stats.maps_read == 200
    # nothing changed: not one file of /proc is read, however many processes
    assert f.refresh() == [] and (f.stats.full, f.stats.stats_read, f.stats.maps_read) == (False, 0, 0)
    # one process dlopen()s libcuda, whatever its vsize does: the kernel names it, only it is read
    proc.add_map(150, "/usr/lib/libcuda.so.1", proc.lib_file("libcuda.so.1"), vsize=4096)
    changes.pids.add(150)
    assert [lib.path for lib in f.refresh()] == ["/usr/lib/libcuda.so.1"]
    assert (f.stats.processes, f.stats.stats_read, f.stats.maps_read) == (1, 1, 1)


def test_with_the_watch_a_full_scan_reads_only_new_processes_maps(proc):
    clock, changes = Clock(), KernelChanges()
    for pid in range(100, 150):
        proc.add(pid, {})
    f = watched(proc, changes, clock)
    f.refresh()
    # vsize changes (a Python app's allocations) do not make a process be read again
    for pid in range(100, 150):
        proc.set_stat(pid, 1000, 999_999)
    proc.add(500, {"/lib/libcuda.so.1": proc.lib_file("libcuda.so.1")})  # missed by the watch
    clock.t += 31
    assert [lib.pid for lib in f.refresh()] == [500]
    assert f.stats.full and (f.stats.stats_read, f.stats.maps_read) == (51, 1)


def test_the_watch_feeds_every_finder_and_exits_unmap(proc):
    clock, changes = Clock(), KernelChanges()
    cuda = proc.lib_file("libcuda.so.1")
    proc.add(100, {"/lib/libcuda.so.1": cuda})
    watch = MapsWatch(changes)
    a = watched(proc, changes, clock, watch)
    b = LibraryFinder(["libspanlet_marker"], proc=proc.root, clock=clock, watch=watch.subscribe())
    (lib,) = a.refresh()
    b.refresh()
    marker = proc.lib_file("libspanlet_marker.cpython-311-x86_64-linux-gnu.so")
    proc.add_map(100, "/app/libspanlet_marker.cpython-311-x86_64-linux-gnu.so", marker, vsize=4096)
    changes.pids.add(100)
    assert a.refresh() == []                      # a drained the kernel's list ...
    assert [x.path for x in b.refresh()] == ["/app/libspanlet_marker.cpython-311-x86_64-linux-gnu.so"]
    assert changes.drains == 4 and watch.drained == 1   # ... and b got its share of it
    _remove(proc.root / "100")                    # the process exits: the kernel names it
    changes.pids.add(100)
    a.refresh()
    assert a.stats.exited == 1 and a._seen == {}
    clock.t += 5
    assert a.unmapped(5) == [lib]
