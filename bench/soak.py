"""Soak: the whole agent (`spanlet run` in its own process, GPU probe on a
stand-in CUDA workload, embedded store on in a temporary data directory, span
export to an upstream OTLP receiver in this process) under a steady load of
OTLP spans and GPU launches for --minutes (default 10). Samples the agent's
RSS (and its anonymous and file-backed parts) and CPU every --interval seconds
and prints, side by side, the first and the last quarter of the run, the
least-squares slope of RSS (MB/min) and of CPU (points of one core per minute)
with their noise (two standard errors), and where every span and launch ended
up (store, upstream, drops). --set KEY=VALUE (repeatable) adds an agent
setting, e.g. --set store.enabled=false to soak the agent without its store.
--at REF soaks the agent of another commit (its files, this tree's built native
extensions); two soaks can run at once, e.g. this tree beside --at main, each
on stand-in libraries named for its own run.

"No growth trend" means the RSS slope lies within its noise, or the drift it
would make over the whole run is under 2% of the mean RSS. The fit starts after
--warmup (default 120 s, or the first eighth of a run over 16 minutes): the
start-up (BPF compile, store schema) and the store engine's first merges, which
raise its working set by ~10 MB to the level it then keeps, and in a long run
the ~15 minutes in which the agent's malloc arenas and queues settle (~4 MB);
the RSS of that ramp is printed next to the fitted part's. CPU is the agent's
and its store engine's apart and summed, with each one's threads by quarter;
the store's active parts at the end show how large its merges grew. The agent's
memory (`spanlet inspect memory`) is marked at the end of the warm-up and read
at the end: what of the RSS changed, malloc's or Python's, and which types;
--tracemalloc N runs the agent under tracemalloc to name the lines too.

    sudo .venv/bin/python bench/soak.py [--minutes 10] [--interval 5] [--set KEY=VALUE] [--at REF]
    (or: make soak)
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support")]

import grpc  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import cuda_standin  # noqa: E402
from common import (Agent, agent_bench_args, cpu_s, engine_pid, fit, quarter_means, rss_trend,  # noqa: E402
                    spans_request, thread_cpu, tree_at)
from processes import free_port, stop_process  # noqa: E402
from spanlet.config import OtlpConfig  # noqa: E402
from spanlet.demo.standin import DRIVER, RUNTIME  # noqa: E402
from spanlet.exporters.otlp.receiver import OtlpReceiver  # noqa: E402
from spanlet.inspect import InspectError, ask  # noqa: E402

SPAN_BATCH = 50
# Self-metrics read at every sample: what would grow if something leaked by design.
WATCHED = {
    "spanlet_join_buffer_events": "join buffer",
    "spanlet_export_queue_spans": "export queue",
    "spanlet_store_queue_rows": "store queue",
}


# The soak's stand-in libraries under names of this run's own (the workload still
# opens libcuda.so.1 / libcudart.so.12, links to them), and the agent told to trace
# only these: the GPU load is the run's alone, whatever else on the node launches
# kernels through a CUDA library (another soak, another test's stand-in, a real GPU job).
SOAK_DRIVER, SOAK_RUNTIME = f"libsoak{os.getpid()}cuda.so", f"libsoak{os.getpid()}cudart.so"


def soak_libraries(lib_dir: Path, dest: Path) -> Path:
    """`dest` holding the stand-ins renamed (SOAK_DRIVER.1, SOAK_RUNTIME.12), with DRIVER and RUNTIME
    as links to them: a process maps the renamed files, and only those names are traced."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, soak in ((DRIVER, SOAK_DRIVER), (RUNTIME, SOAK_RUNTIME)):
        renamed = soak + name[name.index(".so") + 3:]
        shutil.copy2(lib_dir / name, dest / renamed)
        (dest / name).symlink_to(renamed)
    return dest


def rss_mb(pid: int) -> dict[str, float]:
    """VmRSS and its parts (MB): anonymous memory (heaps, the store's caches) and file pages (mapped code
    and data, e.g. the pages of the chdb library touched so far)."""
    out = {"rss": float("nan"), "anon": float("nan"), "file": float("nan")}
    keys = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file"}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = keys.get(line.split(None, 1)[0] if line else "")
        if key:
            out[key] = int(line.split()[1]) / 1024
    return out


def scrape(port: int) -> dict[str, float]:
    """Sums of a few self-metrics (over their labels) from the agent's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            if s.name == "spanlet_events_read_total" or s.name == "spanlet_events_dropped_total":
                out[f"{s.name}:{s.labels.get('probe', '')}"] = s.value
    return out


# -- load ------------------------------------------------------------------------------------------

class SpanSender(threading.Thread):
    """OTLP/gRPC spans to the agent at a steady rate, in batches."""

    def __init__(self, port: int, per_s: float) -> None:
        super().__init__(name="span-sender", daemon=True)
        self.port, self.per_s = port, per_s
        self.sent = self.failed = 0
        self.stop = threading.Event()

    def run(self) -> None:
        channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        rnd, t0, offered = random.Random(1), time.monotonic(), 0
        while not self.stop.is_set():
            try:
                stub.Export(spans_request(SPAN_BATCH, rnd, "soak", "image"), timeout=10)
                self.sent += SPAN_BATCH
            except grpc.RpcError:
                self.failed += SPAN_BATCH
            offered += SPAN_BATCH
            ahead = offered / self.per_s - (time.monotonic() - t0)
            if ahead > 0:
                self.stop.wait(ahead)
        channel.close()


class Upstream:
    """The OTLP collector the agent exports enriched spans to; counts them."""

    def __init__(self) -> None:
        self.spans = 0
        self.lock = threading.Lock()
        self.rx = OtlpReceiver(OtlpConfig(grpc_port=0, http_port=0), self)
        self.rx.start()

    def __call__(self, request, peer=None) -> int:
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self.lock:
            self.spans += n
        return n


# -- statistics ------------------------------------------------------------------------------------

def default_warmup(seconds: float) -> float:
    """The seconds left out of the fit: the start-up and the store's first merges (120 s), and in a
    longer run its first eighth: the malloc arenas of the agent's threads and its queues settle
    over its first ~15 minutes (~4 MB of RSS, measured in a 2-hour soak), a ramp that a fit
    from the second minute reads as growth."""
    return max(120.0, seconds / 8)


def summarize(samples: list[dict], warmup_s: float) -> None:
    steady = [s for s in samples if s["t"] >= warmup_s]
    if len(steady) < 4:
        print(f"only {len(steady)} samples after the {warmup_s:.0f} s warm-up: run longer")
        return
    xs = [s["t"] / 60 for s in steady]
    print(f"\n{len(samples)} samples every ~{samples[1]['t'] - samples[0]['t']:.1f} s; "
          f"the first {warmup_s:.0f} s (start-up: BPF compile, store schema, the store's first merges) "
          f"left out of the fit")
    ramp = [s["rss"] for s in samples if 30 <= s["t"] < warmup_s]
    if ramp:
        print(f"RSS in the ramp (30 s to {warmup_s:.0f} s): mean {sum(ramp) / len(ramp):.1f} MB, "
              f"max {max(ramp):.1f} MB; after it: mean {sum(s['rss'] for s in steady) / len(steady):.1f} MB")
    print(f"{'':22s}{'min':>9s}{'mean':>9s}{'max':>9s}{'first q':>9s}{'last q':>9s}{'last/first':>11s}"
          f"{'slope/min':>11s}{'± 2 SE':>9s}")
    verdicts = []
    apart = any(s["engine"] for s in steady)          # the store's engine in a process of its own
    for key, label, unit in (("rss", "RSS (MB)", "MB"), ("anon", "  anonymous (MB)", "MB"),
                             ("file", "  file pages (MB)", "MB"), ("engine", "engine process RSS", "MB"),
                             ("total", "agent + engine RSS", "MB"), ("cpu_agent", "CPU agent (%)", "pts"),
                             ("cpu_engine", "CPU engine (%)", "pts"), ("cpu", "CPU agent + engine (%)", "pts")):
        if key in ("engine", "total", "cpu_engine") and not apart:
            continue
        ys = [s[key] * (100 if key.startswith("cpu") else 1) for s in steady]
        slope, se, sd = fit(xs, ys)
        first, last = quarter_means(ys)
        print(f"{label:22s}{min(ys):9.1f}{sum(ys) / len(ys):9.1f}{max(ys):9.1f}{first:9.1f}{last:9.1f}"
              f"{last / first if first else float('nan'):11.3f}{slope:+11.3f}{2 * se:9.3f}")
        if key in ("rss", "engine"):
            verdicts.append(("RSS: " if key == "rss" else "engine RSS: ") + rss_trend(xs, ys))
        elif key.startswith("cpu"):
            within = abs(slope) <= 2 * se
            trend = "no trend" if within else ("GROWTH TREND" if slope > 0 else "falling")
            verdicts.append(f"{label.strip()}: {trend} (slope {slope:+.3f} points/min, noise ±{2 * se:.3f})")
    for key, label in WATCHED.items():
        ys = [s.get(key, float("nan")) for s in steady]
        first, last = quarter_means(ys)
        print(f"{label:22s}{min(ys):9.0f}{sum(ys) / len(ys):9.0f}{max(ys):9.0f}{first:9.0f}{last:9.0f}")
    print()
    for v in verdicts:
        print(v)


def store_counts(data_dir: Path, workload_pid: int) -> dict[str, int]:
    from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend

    backend = ChdbBackend(str(data_dir / "chdb"))
    try:
        (spans, distinct), = backend.query("SELECT count(), uniqExact(SpanId) FROM spanlet.otel_traces")
        (launches, events), = backend.query(
            f"SELECT countIf(Kind = 'GPU_LAUNCH' AND Pid = {int(workload_pid)}), count() FROM spanlet.kernel_events")
        parts = [f"{'active parts of the store at the end':38}{'parts':>8}{'level':>8}{'rows':>14}"
                 f"{'largest part':>24}"]
        for table, n, level, rows, big_rows, big_mib in backend.query(
                "SELECT table, count(), max(level), sum(rows), max(rows), max(bytes_on_disk) / 1048576 "
                "FROM system.parts WHERE database = 'spanlet' AND active GROUP BY table ORDER BY table"):
            parts.append(f"  {table:36}{n:8}{level:8}{rows:14,}{big_rows:12,} rows{big_mib:7.1f} MiB")
        return {"spans": spans, "span_ids": distinct, "launches": launches, "events": events, "parts": parts}
    finally:
        backend.close()


# -- the run ---------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds left out of the fit (default: 120, or an eighth of a run over 16 minutes)")
    ap.add_argument("--spans", type=float, default=200.0, help="spans per second over OTLP/gRPC")
    ap.add_argument("--launches", type=int, default=1000, help="GPU launches per second (each one stored)")
    ap.add_argument("--at", metavar="REF", help="soak the agent of this commit, not this tree's")
    ap.add_argument("--tracemalloc", type=int, metavar="FRAMES", default=0,
                    help="run the agent under tracemalloc (PYTHONTRACEMALLOC=FRAMES) to see which lines "
                         "hold the memory that changed; its CPU then counts tracemalloc's cost")
    a = agent_bench_args(ap, "the soak", ", after the soak's own, e.g. store.enabled=false")
    seconds = a.minutes * 60
    grpc_port, http_port = free_port(), free_port()
    upstream = Upstream()
    with tempfile.TemporaryDirectory(prefix="spanlet-soak-") as tmp:
        tmp_path = Path(tmp)
        standin = cuda_standin.build(tmp_path / "standin")
        data_dir = tmp_path / "data"
        with cuda_standin.Workload(standin.workload, timeout_s=seconds + 120) as w:
            w.load(soak_libraries(standin.lib_dir, tmp_path / "soaklib"))
            agent = Agent([
                "tc.enabled=false", "sandbox.enabled=false", "store.enabled=true",
                "gpu.launch_events=all", f"data_dir={data_dir}",
                f"gpu.driver_libraries={SOAK_DRIVER}", f"gpu.runtime_libraries={SOAK_RUNTIME}",
                f"admin_socket={tmp_path / 'admin.sock'}",
                f"otlp.grpc_port={grpc_port}", f"otlp.http_port={free_port()}",
                f"otlp.upstream_endpoint=http://127.0.0.1:{upstream.rx.grpc_port}",
                "otlp.upstream_protocol=grpc",
                f"http_port={http_port}", "http_address=127.0.0.1", *a.agent_set],
                env=agent_env(a, tmp_path))
            try:
                if not agent.wait_running():
                    print("the agent did not start:\n" + "".join(agent.tail), file=sys.stderr)
                    return 1
                time.sleep(2)  # discovery attaches the GPU probe to the workload
                sender = SpanSender(grpc_port, a.spans)
                launches = int(a.launches * seconds)
                w.send(f"paced {launches} {a.launches}", "go")
                sender.start()
                warmup = a.warmup if a.warmup is not None else default_warmup(seconds)
                admin_sock = tmp_path / "admin.sock"
                samples, snaps = sample(agent.proc.pid, http_port, seconds, a.interval,
                                        (warmup, lambda: agent_memory(admin_sock, mark=True)))
                memory = agent_memory(admin_sock)
                w.until("done")
                sender.stop.set()
                sender.join(15)
                time.sleep(2)  # the last spans through the join, the store batch and the export batch
                final = scrape(http_port)
            finally:
                stop_process(agent.proc, 30)
        stored = (store_counts(data_dir, w.pid) if "store.enabled=false" not in a.agent_set
                  else {"spans": 0, "span_ids": 0, "launches": 0, "events": 0})
    upstream.rx.stop(0)

    print(f"soak of {f'the agent at {a.at}' if a.at else 'this tree'}: {a.minutes:g} min of {a.spans:g} spans/s (OTLP/gRPC) and {a.launches:,} GPU launches/s "
          f"(launch_events=all, every launch stored), store chdb, export to an upstream")
    if a.tracemalloc:
        print(f"the agent ran under tracemalloc ({a.tracemalloc} frames): its CPU and RSS count tracemalloc's")
    summarize(samples, warmup)
    print()
    for line in [*thread_lines(snaps), *memory_lines(memory)]:
        print(line)
    for line in stored.get("parts", []):
        print(line)
    ring_drops = final.get("spanlet_events_dropped_total:gpu_launch", 0)
    print(f"\nspans: sent {sender.sent:,} (failed {sender.failed:,}), stored {stored['spans']:,} "
          f"({stored['span_ids']:,} distinct ids), exported upstream {upstream.spans:,}, "
          f"export drops {final.get('spanlet_export_dropped_spans_total', 0):.0f}")
    print(f"launches of the workload: run {launches:,}, stored {stored['launches']:,}; GPU probe records (of "
          f"the soak's libraries): read {final.get('spanlet_events_read_total:gpu_launch', 0):,.0f}, "
          f"dropped in the ring buffer {ring_drops:,.0f}; kernel_events rows {stored['events']:,}")
    others = final.get("spanlet_events_read_total:gpu_launch", 0) + ring_drops - launches
    if others > 0.01 * launches:
        print(f"NOTE: {others:,.0f} GPU probe records more than the workload's launches: the load was not the "
              f"soak's alone")
    print(f"agent exit status {agent.proc.returncode}")
    if agent.proc.returncode:
        print("".join(agent.tail), file=sys.stderr)
    return 0


def agent_env(a, tmp_path: Path) -> dict | None:
    """The agent's environment: the tree of --at, tracemalloc with --tracemalloc."""
    env = {}
    if a.at:
        env["PYTHONPATH"] = str(tree_at(a.at, tmp_path / "tree"))
    if a.tracemalloc:
        env["PYTHONTRACEMALLOC"] = str(a.tracemalloc)
    return dict(os.environ, **env) if env else None


class Cpu:
    """CPU seconds of one process so far, read across a restart of it (the engine's: a new
    process starts again from 0, so what the old one took up to its last reading is kept)."""

    def __init__(self) -> None:
        self.pid, self.base, self.last = None, 0.0, 0.0

    def read(self, pid: int | None) -> float:
        if pid is not None and pid != self.pid:
            self.pid, self.base = pid, self.base + self.last
            self.last = 0.0
        if self.pid is not None:
            try:
                self.last = cpu_s(self.pid)
            except OSError:
                pass
        return self.base + self.last


def threads_of(pid: int | None) -> dict[str, float]:
    try:
        return thread_cpu(pid) if pid is not None else {}
    except OSError:
        return {}


def agent_memory(admin_sock: Path, mark: bool = False) -> dict | None:
    """The agent's `inspect memory` answer (and, with mark, the one later answers are compared
    with); None from an agent without it (--at an older commit)."""
    try:
        return ask(str(admin_sock), "memory", {"mark": mark}, timeout=60)["data"]
    except InspectError as e:
        print(f"(no memory breakdown from the agent: {e})", file=sys.stderr)
        return None


def sample(pid: int, http_port: int, seconds: float, interval: float,
           on_warm: tuple[float, Callable[[], None]] | None = None) -> tuple[list[dict], list[dict]]:
    """Samples every `interval` seconds (RSS, the agent's and the engine's CPU share since the last
    sample, the watched self-metrics) and, at the start and at each quarter of the run, the CPU
    seconds so far of both processes and of their threads by name; on_warm's call once its
    second of the run has passed."""
    out, snaps = [], []
    agent_cpu, engine_cpu = Cpu(), Cpu()
    t0 = time.monotonic()

    def snap(t: float) -> dict:
        engine = engine_pid(pid)
        return {"t": t, "agent": agent_cpu.read(pid), "engine": engine_cpu.read(engine),
                "agent_threads": threads_of(pid), "engine_threads": threads_of(engine)}

    snaps.append(snap(0.0))
    a_prev, e_prev, t_prev = snaps[0]["agent"], snaps[0]["engine"], t0
    next_at = t0 + interval
    while True:
        time.sleep(max(0.0, next_at - time.monotonic()))
        now = time.monotonic()
        engine = engine_pid(pid)
        a, e = agent_cpu.read(pid), engine_cpu.read(engine)
        row = {"t": now - t0, **rss_mb(pid), "cpu_agent": (a - a_prev) / (now - t_prev),
               "cpu_engine": (e - e_prev) / (now - t_prev)}
        row["cpu"] = row["cpu_agent"] + row["cpu_engine"]
        row["engine"] = rss_mb(engine)["rss"] if engine is not None else 0.0
        row["total"] = row["rss"] + row["engine"]
        a_prev, e_prev, t_prev = a, e, now
        try:
            metrics = scrape(http_port)
            row.update({k: metrics.get(k, float("nan")) for k in WATCHED})
        except OSError:
            pass
        out.append(row)
        print(f"  t={row['t']:6.0f}s  rss {row['rss']:7.1f} MB (anon {row['anon']:7.1f}, file {row['file']:6.1f})"
              f"  engine {row['engine']:7.1f} MB  cpu {row['cpu_agent']:6.1%} + engine {row['cpu_engine']:6.1%}",
              flush=True)
        if row["t"] >= len(snaps) * seconds / 4 - interval / 2 and len(snaps) < 5:
            snaps.append(snap(row["t"]))
        if on_warm is not None and row["t"] >= on_warm[0]:
            on_warm[1]()
            on_warm = None
        next_at += interval
        if now - t0 >= seconds:
            return out, snaps


def memory_lines(d: dict | None) -> list[str]:
    """What of the agent's memory changed from the end of the warm-up to the end of the run: the RSS,
    malloc's totals, Python's blocks and objects (and the types that changed most), tracemalloc's
    lines where the agent ran with it."""
    if d is None or d["since_mark"] is None:
        return []
    then = d["since_mark"]
    title = f"agent memory, change over the last {then['seconds'] / 60:.0f} min"
    out = [f"{title:50}{'then':>12}{'now':>12}{'change':>12}"]
    rows = [(f"RSS {k} (MB)", then["rss"].get(k), d["rss"].get(k), 2**20) for k in ("rss", "anon", "file")]
    if d["malloc"] is not None:
        rows += [(f"malloc {k} (MB)", then["malloc"][k], d["malloc"][k], 2**20)
                 for k in ("in_use", "free", "mmapped", "arenas")]
    rows += [(f"Python {k.replace('_', ' ')}", then["python"][k], d["python"][k], 1)
             for k in ("allocated_blocks", "gc_objects")]
    for label, old, new, unit in rows:
        if old is not None and new is not None:
            out.append(f"  {label:48}{old / unit:12,.1f}{new / unit:12,.1f}{(new - old) / unit:+12,.1f}")
    out.append("  Python types that changed most (tracked by gc):")
    out += [f"    {t['type'][-46:]:46}{t['count'] - t['change']:12,}{t['count']:12,}{t['change']:+12,}"
            for t in d["python"]["types"][:8] if t["change"]]
    if d["tracemalloc"] is not None:
        out.append(f"  tracemalloc: {d['tracemalloc']['traced'] / 2**20:.1f} MB traced; lines by change (KB):")
        out += [f"    {r['where'][-58:]:58}{r['size'] / 1024:10,.0f}{r['size_change'] / 1024:+12,.0f}"
                for r in d["tracemalloc"]["top"][:12] if r["size_change"]]
    return out


def thread_lines(snaps: list[dict]) -> list[str]:
    """Each process's CPU by quarter of the run, and its threads (by name) that took most of it; what
    the threads that ended within a quarter took is in neither (hence 'other')."""
    if len(snaps) < 5:
        return []
    spans = [snaps[k + 1]["t"] - snaps[k]["t"] for k in range(4)]
    out = [f"{'CPU by quarter (% of a core)':38}" + "".join(f"{f'q{k + 1}':>8}" for k in range(4))]
    for proc in ("agent", "engine"):
        whole = [(snaps[k + 1][proc] - snaps[k][proc]) / spans[k] for k in range(4)]
        out.append(f"  {proc + ' process':36}" + "".join(f"{x:8.2%}" for x in whole))
        first, last = snaps[0][proc + "_threads"], snaps[4][proc + "_threads"]
        totals = {n: last.get(n, 0.0) - first.get(n, 0.0) for n in last}
        top = sorted(totals, key=totals.get, reverse=True)[:6]
        named = [0.0] * 4
        for name in top:
            per = [(snaps[k + 1][proc + "_threads"].get(name, 0.0) - snaps[k][proc + "_threads"].get(name, 0.0))
                   / spans[k] for k in range(4)]
            named = [x + y for x, y in zip(named, per)]
            out.append(f"    {'thread ' + name:34}" + "".join(f"{x:8.2%}" for x in per))
        out.append(f"    {'other':34}" + "".join(f"{x - y:8.2%}" for x, y in zip(whole, named)))
    return out


if __name__ == "__main__":
    sys.exit(main())
