"""Starts and drives span_facts_child.py (an OTel SDK app launching stand-in
kernels in its spans) for the span-facts tests and benches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().parent / "span_facts_child.py"


class FactsChild:
    """One child process; `expected` collects (trace hex, span hex) → launches
    of every span it reported."""

    def __init__(self, endpoint: str, libcuda: Path | str, processor: str = "batch",
                 script: Path = CHILD, command: list[str] | None = None):
        """`script`: the child program (default span_facts_child.py); `command`:
        what runs it, given the same three arguments (default: this interpreter
        on `script`, the checkout's spanlet)."""
        # the marker extension of the package build, as an installed app loads it
        env = {k: v for k, v in os.environ.items() if k != "SPANLET_MARKER_LIB"}
        env["PYTHONPATH"] = str(ROOT)
        self.proc = subprocess.Popen([*(command or [sys.executable, str(script)]), endpoint,
                                      str(libcuda), processor],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.expected: dict[tuple[str, str], int] = {}
        line = self.proc.stdout.readline()
        if not line.startswith("ready"):
            self.close()
            raise AssertionError(f"child did not start: {line!r}")
        self.pid = int(line.split()[1])

    def command(self, cmd: str, done: str = "done") -> list[list[str]]:
        """Run one command; the other lines it printed, split. Span lines go to `expected`."""
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        lines = []
        for line in self.proc.stdout:
            if line.startswith(done):
                return lines
            words = line.split()
            if words[0] == "span":
                self.expected[(words[1], words[2])] = int(words[3])
            else:
                lines.append(words)
        raise AssertionError(f"child {self.pid} exited during {cmd!r} (rc {self.proc.wait()})")

    def exit(self, timeout_s: float = 30) -> int:
        """Shut the provider down (it exports what is left) and wait for the exit."""
        self.proc.stdin.write("exit\n")
        self.proc.stdin.flush()
        return self.proc.wait(timeout_s)

    def close(self) -> None:
        """End this process (and only it); safe twice."""
        if self.proc.poll() is None:
            try:
                self.exit(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def __enter__(self) -> "FactsChild":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
