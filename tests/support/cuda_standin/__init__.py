"""Stand-in CUDA libraries for the GPU probe's tests and benches: builds them
with gcc (the libraries from agent/demo/standin, the workload program and a
library without CUDA symbols from the C sources next to this file) and drives
the workload program over its stdin/stdout protocol:

    ready PID TID          printed at start
    load DIR               dlopen DIR/libcuda.so.1 and DIR/libcudart.so.12 -> "loaded"
    load-driver PATH       dlopen one driver library (load-runtime PATH: a runtime) -> "loaded"
    dlopen PATH            dlopen any library -> "opened"
  script lines (run on "go"):
    ENTRY N GX GY GZ BX BY BZ SHMEM STREAM [FUNC]   N launches through the launch entry
                           point named (its real name: cuLaunchKernel_ptsz, cudaLaunchKernelExC,
                           cuLaunchGrid, ...; or cu, cuex, cuda) -> "failed K RC" if K failed
    begin SYMBOL STREAM [MODE|GRAPH]   a cu/cudaStreamBeginCapture* call -> "begin RC"
    end SYMBOL STREAM      a cu/cudaStreamEndCapture* call -> "end RC GRAPH"
    create cuGraphCreate   -> "create RC GRAPH"
    addnode SYMBOL GRAPH N N cuGraphAddKernelNode* calls -> "addnode RC"
    inst SYMBOL GRAPH      a cu/cudaGraphInstantiate* call -> "inst RC EXEC"
    replay SYMBOL EXEC N [STREAM]      N cu/cudaGraphLaunch* calls -> "replay FAILED"
    destroy SYMBOL HANDLE  a cu/cudaGraph(Exec)Destroy call -> "destroy RC"
    SYNC-SYMBOL US         one sync (cusync|cudasync|devsync, or a real name: cuCtxSynchronize,
                           cuEventSynchronize, ...) "waiting" US µs -> "sync NAME NS"
    copy SYMBOL N ARGS...  N copy or allocation calls (driver cuMemcpy*/cuMemAlloc*, or
                           cudaMemcpy(Async) BYTES KIND, cudaMalloc BYTES; see workload.c)
                           -> "copy NAME FAILED NS"
    bench|benchrt N        N back-to-back cuLaunchKernel|cudaLaunchKernel -> "bench N NS"
    benchx ENTRY N         N back-to-back launches through ENTRY -> "benchx N NS"
    benchgraph SYMBOL EXEC N           N back-to-back replays -> "benchgraph N NS"
    paced N RATE           N launches at RATE/s -> "paced N NS"
  control:
    thread N               start a thread -> "thread TID"; it makes N launches on "release"
    release                let that thread launch and exit -> "joined"
    go                     run the script collected so far -> its output, then "done"
    exit
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from spanlet.demo.standin import DRIVER, HERE as STANDIN_SOURCES, RUNTIME, build_cuda, gcc

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class StandIn:
    lib_dir: Path      # DRIVER and RUNTIME
    nocuda: Path       # a "libcuda.so.99" without any CUDA symbol
    workload: Path

    def copy_libs(self, dest: Path) -> Path:
        """A second copy of the libraries (new inodes) in `dest`."""
        dest.mkdir(parents=True, exist_ok=True)
        for name in (DRIVER, RUNTIME):
            shutil.copy2(self.lib_dir / name, dest / name)
        return dest


def build(out: Path) -> StandIn:
    """Compile everything into `out` (the libraries as build_cuda says)."""
    lib = build_cuda(out / "lib")
    nocuda = out / "nocuda" / "libcuda.so.99"
    nocuda.parent.mkdir(exist_ok=True)
    gcc("-shared", "-fPIC", "-o", nocuda, HERE / "nocuda.c")
    workload = out / "workload"
    gcc("-O2", "-pthread", f"-I{STANDIN_SOURCES}", "-o", workload, HERE / "workload.c", "-ldl")
    return StandIn(lib, nocuda, workload)


class WorkloadError(Exception):
    pass


class Workload:
    """One running workload process. `argv_prefix` wraps it (unshare ...);
    with no `exe`, the prefix alone is the command (it must exec the workload)."""

    def __init__(self, exe: Path | None, argv_prefix: list[str] | None = None,
                 timeout_s: float = 30.0):
        self.timeout_s = timeout_s
        argv = [*(argv_prefix or []), *([str(exe)] if exe else [])]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._buf = b""
        try:
            _, pid, tid = self.expect("ready").split()
        except Exception:
            self.close()
            raise
        self.pid, self.tid = int(pid), int(tid)

    def send(self, *lines: str) -> None:
        self.proc.stdin.write("".join(f"{ln}\n" for ln in lines).encode())
        self.proc.stdin.flush()

    def readline(self) -> str:
        deadline = time.monotonic() + self.timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise WorkloadError(f"workload {self.proc.pid}: no output in {self.timeout_s} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.poll() is not None else ""
                raise WorkloadError(f"workload {self.proc.pid} exited ({self.proc.poll()}): {err}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    def expect(self, word: str) -> str:
        """The next line that starts with `word`; an error line raises."""
        lines = self.until(word)
        return lines[-1]

    def until(self, word: str) -> list[str]:
        lines = []
        while True:
            line = self.readline()
            if line.startswith("error"):
                raise WorkloadError(f"workload {self.proc.pid}: {line}")
            lines.append(line)
            if line.split(" ", 1)[0] == word:
                return lines

    def load(self, lib_dir: Path | str) -> None:
        self.send(f"load {lib_dir}")
        self.expect("loaded")

    def dlopen(self, path: Path | str) -> None:
        self.send(f"dlopen {path}")
        self.expect("opened")

    def thread(self, launches: int) -> int:
        """Start the second thread (it launches on release()); its tid."""
        self.send(f"thread {launches}")
        return int(self.expect("thread").split()[1])

    def release(self) -> None:
        """Let the second thread make its launches and exit; returns once it has."""
        self.send("release")
        self.expect("joined")

    def run(self, *script: str) -> list[str]:
        """Run script lines; their output lines (without the final "done")."""
        self.send(*script, "go")
        return self.until("done")[:-1]

    def close(self) -> None:
        """End this process (and only it); safe to call twice."""
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except OSError:
                pass

    def __enter__(self) -> "Workload":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
