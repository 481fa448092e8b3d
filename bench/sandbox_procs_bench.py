"""Agent CPU while many processes that never touch a tensor pool hold many open
files: 0 (idle), 100, 400 and 1,000 processes holding 500 fds each, the whole
agent (`spanlet run`) with the sandbox on and, side by side, with it off, so
that the sandbox's own share shows; then the sandbox probe alone in this
process (its notice reader, and refresh() once a second as the agent calls
it), with what it did in /proc meanwhile (notices from the whole node, links
and maps read), which machine noise from other processes does not blur. The processes are forked by a small C
helper built here (tests/support/fd_holder.c, gcc), each opens its files and waits; they are killed by
pid after each count. Each count is measured after one sandbox.sweep_interval_s
and a second (so that every periodic step of the sandbox ran at least once).

    sudo .venv/bin/python bench/sandbox_procs_bench.py [--seconds 10] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support")]

import fd_holders  # noqa: E402
from common import Agent, agent_bench_args, agent_cpu_s as cpu_s  # noqa: E402
from processes import free_port  # noqa: E402
from spanlet import config  # noqa: E402
from spanlet.probes.sandbox.probe import SandboxProbe  # noqa: E402

COUNTS = (0, 100, 400, 1000)
FDS = 500
FILES = 50            # the fds name these files, round robin
GOAL = 0.02           # of one core, at 400 processes

def start_agent(tmp: Path, sandbox: bool, extra: list[str]) -> Agent:
    sets = ["tc.enabled=false", "store.enabled=false", f"sandbox.enabled={str(sandbox).lower()}",
            f"data_dir={tmp / 'data'}", f"admin_socket={tmp / 'admin.sock'}",
            f"otlp.grpc_port={free_port()}", f"otlp.http_port={free_port()}",
            f"http_port={free_port()}", "http_address=127.0.0.1", *extra]
    agent = Agent(sets)
    if not agent.wait_running():
        raise SystemExit("the agent did not start:\n" + "".join(agent.tail))
    return agent


def stop_agent(agent: Agent) -> None:
    agent.proc.send_signal(signal.SIGTERM)
    try:
        agent.proc.wait(60)
    except subprocess.TimeoutExpired:
        agent.proc.kill()
        agent.proc.wait()


def measure(pid: int, seconds: float) -> float:
    c0, t0 = cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_s(pid) - c0) / (time.monotonic() - t0)


def probe_alone(exe: Path, files: Path, seconds: float, settle_s: float, extra: list[str]
                ) -> dict[int, tuple[float, dict]]:
    """{count: (CPU share of this process, the probe's work in /proc)} with only
    the sandbox probe loaded here."""
    cfg = config.load(env={}, overrides=extra)
    probe = SandboxProbe(cfg)
    st = probe.start()
    if not st.attached:
        raise SystemExit(f"the sandbox probe did not attach: {st.reason}")
    out = {}
    try:
        for n in COUNTS:
            holders = fd_holders.Holders(exe, n, FDS, files, FILES) if n else None
            try:
                end = time.monotonic() + settle_s
                while time.monotonic() < end:
                    probe.refresh()
                    time.sleep(1)
                w0, c0, t0 = dict(probe.work), time.process_time(), time.monotonic()
                while time.monotonic() - t0 < seconds:
                    probe.refresh()
                    time.sleep(1)
                share = (time.process_time() - c0) / (time.monotonic() - t0)
                out[n] = (share, {k: v - w0[k] for k, v in probe.work.items()})
            finally:
                if holders:
                    holders.end()
    finally:
        probe.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10, help="measured per count")
    a = agent_bench_args(ap, "the bench")
    cfg = config.load(env={}, overrides=a.agent_set)
    settle_s = cfg.sandbox.sweep_interval_s + 1
    cpu: dict[tuple[bool, int], float] = {}
    with tempfile.TemporaryDirectory(prefix="spanlet-sbx-procs-") as tmp:
        tmp_path = Path(tmp)
        exe = fd_holders.build(tmp_path)
        files = fd_holders.files(tmp_path / "files", FILES)
        for sandbox in (True, False):
            agent = start_agent(tmp_path, sandbox, a.agent_set)
            try:
                for n in COUNTS:
                    holders = fd_holders.Holders(exe, n, FDS, files, FILES) if n else None
                    try:
                        time.sleep(settle_s)
                        cpu[(sandbox, n)] = measure(agent.proc.pid, a.seconds)
                    finally:
                        if holders:
                            holders.end()
            finally:
                stop_agent(agent)
        alone = probe_alone(exe, files, a.seconds, settle_s, a.agent_set)
    print(f"agent CPU (share of one core) while N processes hold {FDS} fds each, none near a "
          f"pool; {a.seconds:.0f} s per count after {settle_s:.0f} s; tc and store off"
          + (f"; settings {' '.join(a.agent_set)}" if a.agent_set else ""))
    print(f"  {'processes':>10}{'sandbox on':>12}{'sandbox off':>13}{'sandbox share':>15}   goal")
    for n in COUNTS:
        on, off = cpu[(True, n)], cpu[(False, n)]
        goal = {0: "(idle)", 400: f"<= {GOAL:.0%} of a core", 1000: "flat"}.get(n, "")
        print(f"  {n:>10}{on:>12.2%}{off:>13.2%}{on - off:>+15.2%}   {goal}")
    print(f"the sandbox probe alone, in this process ({a.seconds:.0f} s per count): CPU, and "
          f"its /proc work in that time")
    print(f"  {'processes':>10}{'CPU':>9}{'notices':>10}{'links':>8}{'maps':>7}{'full sweeps':>13}")
    for n in COUNTS:
        share, w = alone[n]
        print(f"  {n:>10}{share:>9.2%}{w['notices']:>10}{w['links']:>8}{w['maps']:>7}"
              f"{w['sweeps']:>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
