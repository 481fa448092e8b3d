"""Network namespaces from Python: a thread steps into a named namespace
(/run/netns/NAME) to open sockets there, which stay in it afterwards. The demo
puts its serving workers' listening sockets in a namespace of its own this
way; the kernel tests do the same with theirs."""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import subprocess
import threading

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
# setns() changes the namespace of the calling thread only; one switch at a time
# keeps a thread from being left in the wrong one by an interleaving.
_switch_lock = threading.RLock()


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextlib.contextmanager
def inside(ns: str):
    """Run the body (this thread) inside network namespace `ns`."""
    with _switch_lock:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(home)
        finally:
            os.close(target)
            os.close(home)


def socket_in(ns: str, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM,
              proto: int = 0) -> socket.socket:
    with inside(ns):
        return socket.socket(family, type, proto)


def netns_exists(ns: str) -> bool:
    return os.path.exists(f"/run/netns/{ns}")


def link_exists(ifname: str) -> bool:
    return os.path.exists(f"/sys/class/net/{ifname}")
