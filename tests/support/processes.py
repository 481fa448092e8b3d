"""Child processes and ports for tests and benches: a free loopback TCP port,
and a child stopped with SIGTERM, killed if it does not end in time."""

from __future__ import annotations

import signal
import socket
import subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, wait_s: float, kill_wait_s: float = 10) -> None:
    """SIGTERM to `proc` if it still runs, then wait `wait_s`; past that, SIGKILL."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(kill_wait_s)
