"""What the sandbox's kernel tests share: the test pools under a prefix of
their own in /dev/shm, a child process that opens and maps them step by step
on the test's word, and a started sandbox probe with the events it received."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

from spanlet import config, events
from spanlet.config import SandboxConfig, SandboxGrant, SandboxPool
from spanlet.probes.sandbox.probe import SandboxProbe


KIB = 1024


POOL_SIZES = {"ro": 64 * KIB, "rw": 64 * KIB, "capped": 128 * KIB, "unlisted": 8 * KIB}


CAPPED_MAX = 64 * KIB


# The child: says who it is, then runs its steps; a "go" step waits for a
# "go" line on stdin, so the test decides when the child acts. Mappings go
# through libc's mmap so that prot, flags and offset are exactly the test's.
CHILD = r'''
import ctypes, json, os, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PROT = {"r": 1, "rw": 3, "rx": 5, "rwx": 7}
FLAGS = {"shared": 1, "private": 2}
MAP_FAILED = ctypes.c_void_p(-1).value
SYS = json.loads(os.environ.get("SBX_SYSCALLS", "{}"))
def say(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()
fds = {}
say({"pid": os.getpid(), "tid": threading.get_native_id()})
for step in json.loads(sys.argv[1]):
    op = step["op"]
    if op == "go":
        say({"waiting": True})
        if sys.stdin.readline().strip() != "go":
            sys.exit(3)
    elif op == "open":
        fd = os.open(step["path"], os.O_RDWR if step.get("mode") == "rw" else os.O_RDONLY)
        fds[step.get("as", "f")] = fd
        say({"fd": fd})
    elif op == "map":
        name = step.get("fd", "f")
        fd = -1 if name == "anon" else fds[name]
        flags = FLAGS[step.get("flags", "shared")] | (0x20 if fd == -1 else 0)
        addr = libc.mmap(None, step["len"], PROT[step.get("prot", "r")], flags, fd,
                         step.get("off", 0))
        ok = addr != MAP_FAILED
        err = 0 if ok else ctypes.get_errno()
        if ok:
            libc.munmap(addr, step["len"])
        say({"ok": ok, "errno": err})
    elif op == "open_sys":  # the syscall itself, not glibc's openat
        path = step["path"].encode()
        if step["syscall"] == "openat2":
            how = (ctypes.c_uint64 * 3)(os.O_RDONLY, 0, 0)
            fd = libc.syscall(SYS[step["syscall"]], -100, path, ctypes.byref(how), 24)
        else:
            fd = libc.syscall(SYS[step["syscall"]], path, os.O_RDONLY)
        if fd < 0:
            sys.exit(5)
        fds[step.get("as", "f")] = fd
        say({"fd": fd})
    elif op == "close":
        os.close(fds.pop(step.get("fd", "f")))
    elif op == "close_range":
        fd = fds.pop(step.get("fd", "f"))
        if libc.close_range(fd, fd, 0) != 0:
            sys.exit(4)
        say({"closed": fd})
    elif op == "memfd":
        fd = os.memfd_create("spanlet-sbx")
        os.ftruncate(fd, step["size"])
        fds[step.get("as", "f")] = fd
        say({"fd": fd})
'''


READ_TIMEOUT_S = 20.0


# Opening syscalls other than openat that this machine has (arm64 has no open).
SYSCALLS = {"x86_64": {"open": 2, "openat2": 437},
            "aarch64": {"openat2": 437}}.get(os.uname().machine, {})


class Child:
    """One child process and its line protocol (see CHILD)."""

    def __init__(self, steps: list[dict]):
        self.proc = subprocess.Popen([sys.executable, "-S", "-c", CHILD, json.dumps(steps)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, "SBX_SYSCALLS": json.dumps(SYSCALLS)})
        self._buf = b""
        hello = self._line()
        assert hello is not None, "child died before saying hello"
        self.pid, self.tid = hello["pid"], hello["tid"]
        self.before_go = self._until_waiting()

    def _line(self) -> dict | None:
        deadline = time.monotonic() + READ_TIMEOUT_S
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            assert left > 0, f"child {self.pid if hasattr(self, 'pid') else '?'} is silent"
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    return None
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def _until_waiting(self) -> list[dict]:
        out = []
        while (msg := self._line()) is not None and not msg.get("waiting"):
            out.append(msg)
        return out

    def go(self) -> list[dict]:
        """Let the child run to its next "go" step (or its end)."""
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()
        return self._until_waiting()

    def wait(self) -> int:
        return self.proc.wait(timeout=READ_TIMEOUT_S)

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=READ_TIMEOUT_S)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class Pools:
    """The test's prefix, pool files and an unrelated file."""

    def __init__(self, token: str):
        self.dir = Path(f"/dev/shm/tensor_pool_test_{token}")
        self.prefix = str(self.dir) + "/"
        self.outside = Path(f"/dev/shm/spanlet_sbx_outside_{token}")

    def path(self, name: str) -> str:
        return self.prefix + name

    def create(self) -> None:
        self.dir.mkdir()
        for name, size in POOL_SIZES.items():
            with open(self.path(name), "wb") as f:
                f.truncate(size)
        with open(self.outside, "wb") as f:
            f.truncate(8 * KIB)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.outside.unlink(missing_ok=True)

    def config(self, grants: dict[str, list[SandboxGrant]] | None = None,
               mode: str = "audit") -> SandboxConfig:
        grants = grants or {}
        return SandboxConfig(mode=mode, prefixes=[self.prefix], pools=[
            SandboxPool(path=self.path("ro"), grants=grants.get("ro", [])),
            SandboxPool(path=self.path("rw"), grants=grants.get("rw", [])),
            SandboxPool(path=self.path("capped"), max_bytes=CAPPED_MAX,
                        grants=grants.get("capped", [])),
        ])


def _own_cgroup() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise AssertionError("this process is in no cgroup v2")


class Harness:
    """A started sandbox probe and the events its sink received."""

    def __init__(self, sb: SandboxConfig, pin_dir: str | None = None):
        cfg = config.load(env={})
        cfg.sandbox = sb
        self.got: list[events._Event] = []
        self.probe = SandboxProbe(cfg, sink=self.got.append)
        st = self.probe.start(pin_dir=pin_dir)
        assert st.attached, st.reason

    def events_of(self, child: Child) -> list[events.SandboxViolation]:
        self.probe.drain()
        return [e for e in self.got if e.hdr.pid == child.pid]

    def grant(self, sb: SandboxConfig) -> None:
        self.probe.apply_policy(sb)

    def pool_id(self, path: str) -> int:
        return self.probe.policy.pools[path][0]

    def pool_fd_known(self, child: Child, fd: int) -> bool:
        table = self.probe.bpf["sandbox_pool_fds"]
        return any(k.tgid == child.pid and k.fd == fd for k in table.keys())

    def stop(self) -> None:
        self.probe.stop()


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
