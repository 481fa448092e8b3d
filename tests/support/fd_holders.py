"""Processes that hold many open files and nothing else (tests/support/fd_holder.c),
for the sandbox's test and bench that its work does not follow them."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "fd_holder.c"


def build(folder: Path) -> Path:
    exe = folder / "fd_holder"
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", "-o", str(exe), str(SOURCE)], check=True,
                   capture_output=True)
    return exe


def files(folder: Path, n: int) -> Path:
    """A folder of `n` one-byte files f0..f<n-1> for the holders to open."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"f{i}").write_bytes(b"x")
    return folder


class Holders:
    """`n` processes holding `fds` fds each over the files of `folder`;
    end() kills them by pid and waits until they are gone."""

    def __init__(self, exe: Path, n: int, fds: int, folder: Path, nfiles: int):
        self.proc = subprocess.Popen([str(exe), str(n), str(fds), str(nfiles), str(folder)],
                                     stdout=subprocess.PIPE, text=True)
        self.pids: list[int] = []
        for line in self.proc.stdout:
            if line.strip() == "ready":
                break
            self.pids.append(int(line))
        if len(self.pids) != n:
            self.end()
            raise RuntimeError(f"fd_holder started {len(self.pids)} of {n} processes")

    def end(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        for pid in self.pids:           # reaped by init once the holder is gone
            deadline = time.monotonic() + 10
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                time.sleep(0.01)
