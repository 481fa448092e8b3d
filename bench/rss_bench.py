"""The agent's resident memory idle with its defaults, store off and store on,
side by side in one run, each on an empty data_dir (its first start on a node)
and with the compile cache that start left: VmRSS, its anonymous and
file-backed parts, and the mappings that hold most of it. After its start the agent gives back what
compiling left resident (memory.release_startup_memory): the kernel
pages out LLVM's and clang's file pages only where no other process maps
them, so the bench says how many other processes map them now. With the
store on, the embedded engine runs in a process of its own by default
(store.engine_process): its RSS is printed beside the agent's, and the sum.

    sudo .venv/bin/python bench/rss_bench.py [--settle 8] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support")]

from common import Agent, agent_bench_args, engine_pid  # noqa: E402
from processes import free_port  # noqa: E402
from soak import rss_mb  # noqa: E402

GOALS = {"store off": 150, "store on": 300}


def biggest(pid: int, n: int = 5) -> list[tuple[str, float]]:
    """The mappings (by file name, or [heap]/[anon]) with the most resident MB."""
    per: collections.Counter = collections.Counter()
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            parts = line.split(maxsplit=5)
            name = os.path.basename(parts[5]) if len(parts) > 5 else "[anon]"
        elif line.startswith("Rss:"):
            per[name] += int(line.split()[1]) / 1024
    return per.most_common(n)


def others_mapping_llvm() -> int:
    me = os.getpid()
    n = 0
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            if int(maps.split("/")[2]) != me and "libLLVM" in Path(maps).read_text():
                n += 1
        except (OSError, ValueError):
            continue
    return n


def measure(store: bool, settle_s: float, extra: list[str], cache: Path,
            cached: bool) -> tuple[dict, list]:
    """RSS and the biggest mappings of an agent started on an empty data_dir,
    or (cached) with the compile cache (data_dir/bpf-cache) kept in `cache`
    by an earlier start."""
    with tempfile.TemporaryDirectory(prefix="spanlet-rss-bench-") as tmp:
        kept = Path(tmp) / "data" / "bpf-cache"
        if cached:
            shutil.copytree(cache, kept)
        agent = Agent(["tc.enabled=false", f"store.enabled={str(store).lower()}", f"data_dir={tmp}/data",
                       f"admin_socket={tmp}/admin.sock", f"otlp.grpc_port={free_port()}",
                       f"otlp.http_port={free_port()}", f"http_port={free_port()}",
                       "http_address=127.0.0.1", *extra])
        try:
            if not agent.wait_running():
                raise SystemExit("the agent did not start:\n" + "".join(agent.tail))
            time.sleep(settle_s)
            m = rss_mb(agent.proc.pid)
            engine = engine_pid(agent.proc.pid)
            m["engine"] = rss_mb(engine)["rss"] if engine is not None else 0.0
            return m, biggest(agent.proc.pid)
        finally:
            agent.proc.terminate()
            agent.proc.wait(30)
            if not cache.exists() and kept.exists():
                shutil.copytree(kept, cache)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settle", type=float, default=8.0, help="seconds idle before reading")
    a = agent_bench_args(ap, "the bench")
    print(f"agent RSS idle, defaults (TC off), {a.settle:g} s after it runs; "
          f"other processes mapping LLVM now: {others_mapping_llvm()}")
    print("  first start: an empty data_dir (every probe compiled); cached: the compile cache a "
          "first start left (data_dir/bpf-cache), nothing else of it")
    print(f"  {'':22}{'RSS MB':>8}{'anon':>8}{'file':>8}   goal    {'engine':>7}{'both':>7}   biggest mappings (MB)")
    with tempfile.TemporaryDirectory(prefix="spanlet-rss-bench-cache-") as keep:
        cache = Path(keep) / "bpf-cache"
        for label, store in (("store off", False), ("store on", True)):
            for start in ("first start", "cached"):
                m, top = measure(store, a.settle, a.agent_set, cache, start == "cached")
                print(f"  {label + ', ' + start:22}{m['rss']:>8.0f}{m['anon']:>8.0f}{m['file']:>8.0f}   "
                      f"<= {GOALS[label]:<4} {m['engine']:>7.0f}{m['rss'] + m['engine']:>7.0f}   "
                      + ", ".join(f"{n} {v:.0f}" for n, v in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
