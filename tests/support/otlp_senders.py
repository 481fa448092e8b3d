"""OTel SDK processes that export spans to a receiver, each in a new cgroup
v2 group of its own (otlp_sender_child.py), for the tests of how the agent
establishes a span's sender from the connection."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator

from gpu_harness import cgroup2_root
from processes import stop_process

CHILD = Path(__file__).resolve().parent / "otlp_sender_child.py"


class Sender:
    """otlp_sender_child.py in a new cgroup of its own (moved in before it
    connects); ended and the cgroup removed at close()."""

    def __init__(self, transport: str, endpoint: str, name: str) -> None:
        self.name = name
        self.cgroup = cgroup2_root() / f"spanlet-sender-test-{os.getpid()}-{os.urandom(3).hex()}"
        self.cgroup.mkdir()
        self.cgroup_id = os.stat(self.cgroup).st_ino
        self.proc = subprocess.Popen([sys.executable, str(CHILD), transport, endpoint, name],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        (self.cgroup / "cgroup.procs").write_text(str(self.proc.pid))
        assert self.proc.stdout.readline().startswith("ready")

    def spans(self, n: int) -> None:
        self.proc.stdin.write(f"spans {n}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "done"

    def __enter__(self) -> "Sender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            stop_process(self.proc, 5)
        for _ in range(50):
            try:
                self.cgroup.rmdir()
                return
            except FileNotFoundError:         # closed before
                return
            except OSError:                   # the child is still on its way out
                time.sleep(0.1)


@contextmanager
def otlp_senders() -> Iterator[Callable[..., Sender]]:
    """make(transport, endpoint, name) -> a started Sender; all closed after."""
    with ExitStack() as stack:
        yield lambda *args: stack.enter_context(Sender(*args))
