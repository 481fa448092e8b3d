"""Start-up to /readyz with the defaults (every probe compiled and attached),
this tree beside another commit's (--before, default main) in one run,
alternating, with the goal beside them: this tree's first start on a node
(an empty data_dir) and its start with the compile cache a first start left
(data_dir/bpf-cache, nothing else of that start kept); and each probe's
compile and attach seconds and the store and span path's start, from the
agent's log. The TC probe classifies the interfaces of a network namespace
made by the bench (a veth pair, both ends in it), never the machine's own.

    sudo .venv/bin/python bench/startup_bench.py [--before REF] [--rounds 3] [--set KEY=VALUE]

The other commit runs from its files (`git archive`) with this tree's built
native extensions: a commit whose C parts differ from this tree's cannot be
compared this way.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support")]

from common import Agent, agent_bench_args, tree_at  # noqa: E402
from netns import Namespace  # noqa: E402
from processes import free_port  # noqa: E402

GOAL_S = 2.0
PHASES = re.compile(r"probes compiled and attached (?:in )?([\d.]+) s(?: after the daemon's start)?(?: \((.*)\))?")
# the span path after the probes; the store with it (trees before) or beside the probes (now)
REST = re.compile(r"(store and )?span path started in ([\d.]+) s")
STORE = re.compile(r"store started in ([\d.]+) s, beside")


def start_once(settings: list[str], env: dict | None, tmp: str) -> tuple[float, list[str]]:
    """Seconds from the agent's exec to a 200 from /readyz, and its log."""
    port = free_port()
    agent = Agent([f"data_dir={tmp}/data", f"admin_socket={tmp}/admin.sock",
                   f"otlp.grpc_port={free_port()}", f"otlp.http_port={free_port()}",
                   f"http_port={port}", "http_address=127.0.0.1", *settings], keep=400, env=env)
    t0 = time.monotonic()
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        ready = time.monotonic() - t0
                        break
            except OSError:
                pass
            if agent.proc.poll() is not None or time.monotonic() - t0 > 120:
                agent.proc.kill()
                agent._read(None)
                raise SystemExit("the agent did not get ready:\n" + "".join(agent.tail[-30:]))
            time.sleep(0.01)
    finally:
        if agent.proc.poll() is None:
            agent.proc.terminate()
        agent._read(None)
        agent.proc.wait(30)
    return ready, agent.tail


def phases(log: list[str]) -> str:
    out = []
    for line in log:
        if m := PHASES.search(line):
            out.append(f"probes {float(m.group(1)):.2f} s" + (f" ({m.group(2)})" if m.group(2) else ""))
        elif m := REST.search(line):
            out.append(f"{'store + ' if m.group(1) else ''}span path {float(m.group(2)):.2f} s")
        elif m := STORE.search(line):
            out.append(f"store beside the probes {float(m.group(1)):.2f} s")
    return "; ".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="main", help="the commit to compare with (default main)")
    ap.add_argument("--rounds", type=int, default=3)
    a = agent_bench_args(ap, "the bench")
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"start-up to /readyz, defaults (every probe, TC in a namespace of the bench), "
          f"{os.cpu_count()} CPUs ({cpu}), load average {os.getloadavg()[0]:.1f} at the start")
    ns = Namespace("spl-startup")
    tmp = tempfile.mkdtemp(prefix="spanlet-startup-bench-")
    try:
        ns.ip("link", "add", "v0", "type", "veth", "peer", "name", "v1")
        for end in ("v0", "v1"):
            ns.ip("link", "set", end, "up")
        settings = [f"tc.netns={ns.name}", *a.agent_set]
        before_env = dict(os.environ, PYTHONPATH=str(tree_at(a.before, Path(tmp))))
        # the compile cache a first start on the node leaves (data_dir/bpf-cache),
        # copied into each cached start's own data folder (nothing else of it kept)
        warm = Path(tmp) / "warm"
        ready, log = start_once(settings, None, str(warm))
        print(f"  first start of this tree, filling its compile cache: {ready:.2f} s   {phases(log)}")
        cache = warm / "data" / "bpf-cache"
        runs: dict[str, list[float]] = {"before": [], "first start": [], "cached": []}
        for r in range(a.rounds):
            for label, env in (("before", before_env), ("first start", None), ("cached", None)):
                folder = Path(tmp) / f"{label.replace(' ', '_')}{r}"
                if label == "cached":
                    shutil.copytree(cache, folder / "data" / "bpf-cache")
                ready, log = start_once(settings, env, str(folder))
                runs[label].append(ready)
                print(f"  round {r + 1} {label:12} {ready:6.2f} s   {phases(log)}", flush=True)
        print(f"\n  {'':34}{'median':>8}{'min':>8}{'max':>8}   goal")
        names = {"before": f"before ({a.before})", "first start": "this tree, first start on a node",
                 "cached": "this tree, compile cache kept"}
        for label, xs in runs.items():
            print(f"  {names[label]:34}{statistics.median(xs):8.2f}{min(xs):8.2f}{max(xs):8.2f}   "
                  f"≤ {GOAL_S:g} s")
        before = statistics.median(runs["before"])
        print(f"  ratio to before (medians): first start {statistics.median(runs['first start']) / before:.2f}, "
              f"cached {statistics.median(runs['cached']) / before:.2f}; "
              f"load average {os.getloadavg()[0]:.1f} at the end")
    finally:
        ns.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
