"""The request-anatomy tests' helpers: the CPU spinner (spin.c, built with gcc),
a span context probe of the test's own, and the anatomy child (child.py) run
with its marker attached first."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from otlp_upstream import wait_for

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def build(out: Path) -> Path:
    lib = out / "libspin.so"
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(lib), str(HERE / "spin.c")], check=True)
    return lib


@contextlib.contextmanager
def span_ctx_probe(*overrides: str):
    """The span context probe alone, with these settings, attached in this process."""
    from spanlet import config
    from spanlet.probes.span_ctx import SpanCtxProbe
    p = SpanCtxProbe(config.load(env={}, overrides=list(overrides)))
    st = p.start()
    assert st.attached, st.reason
    try:
        yield p
    finally:
        p.stop()


def run_child(probe, spin: Path, *args: str, cgroup: Path | None = None) -> dict[tuple[bytes, int], tuple[int, ...]]:
    """child.py's spans: (trace, span) -> its own figures; the marker attached first
    (and the child moved into `cgroup` once started, before its spans; it reads
    that cgroup's throttled time at its spans' edges)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if cgroup is not None:
        env["SPANLET_TEST_CPU_STAT"] = str(cgroup / "cpu.stat")
    proc = subprocess.Popen([sys.executable, str(HERE / "child.py"), str(spin), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().startswith("ready")
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(proc.pid))
        wait_for(lambda: probe.refresh() or probe.libraries, 10, "the marker attached")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        spans = {}
        for line in proc.stdout:
            w = line.split()
            if w[0] == "done":
                break
            spans[(bytes.fromhex(w[1]), int(w[2], 16))] = tuple(map(int, w[3:]))
        assert proc.wait(60) == 0
        return spans
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
