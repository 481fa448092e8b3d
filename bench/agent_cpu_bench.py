"""Agent CPU and RSS at 1,000 spans/s with 50 GPU launches inside each span (50,000 launches/s
in spans), store and span export on, side by side with the same agent idle; then how long it takes to stop.

`spanlet run` in its own process (embedded store in a temporary data directory, export to an
upstream OTLP receiver in this process); an OTel SDK app (tests/support/span_facts_child.py,
SpanletSpanProcessor + BatchSpanProcessor over OTLP/gRPC) makes the spans and launches through
stand-in libraries that only this bench maps. CPU from /proc/<agent>/stat, RSS from
/proc/<agent>/status once a second (its anonymous and file-backed parts apart; with
--seconds 120 or more the RSS after the load's first minute is fitted for a trend, the soak's
verdict). Also prints how many spans arrived upstream with exactly their launches, and the
agent's stop time on SIGTERM against its shutdown_timeout_s.

    sudo .venv/bin/python bench/agent_cpu_bench.py [--seconds 10] [--idle-seconds S] [--tree N] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support")]

import cuda_standin  # noqa: E402
from facts_child import FactsChild  # noqa: E402
from otlp_upstream import Upstream, kernel_attrs  # noqa: E402
from common import Agent, agent_bench_args, agent_cpu_s as cpu_s, rss_trend, thread_cpu  # noqa: E402
from processes import free_port  # noqa: E402
from soak import SOAK_DRIVER, SOAK_RUNTIME, rss_mb, scrape, soak_libraries  # noqa: E402
from spanlet import config  # noqa: E402


def start_agent(tmp: Path, grpc_port: int, http_port: int, upstream: Upstream,
                extra: list[str]) -> subprocess.Popen:
    sets = ["tc.enabled=false", "sandbox.enabled=false", "store.enabled=true", f"data_dir={tmp / 'data'}",
            f"gpu.driver_libraries={SOAK_DRIVER}", f"gpu.runtime_libraries={SOAK_RUNTIME}",
            f"admin_socket={tmp / 'admin.sock'}", f"otlp.grpc_port={grpc_port}",
            f"otlp.http_port={free_port()}", f"otlp.upstream_endpoint={upstream.endpoint()}",
            "otlp.upstream_protocol=grpc", f"http_port={http_port}", "http_address=127.0.0.1", *extra]
    agent = Agent(sets)
    if not agent.wait_running():
        raise SystemExit("the agent did not start:\n" + "".join(agent.tail))
    agent.proc.log_tail = agent.tail
    return agent.proc


def wait_traced(child: FactsChild, http_port: int, limit_s: float = 30) -> None:
    """One-launch spans until the agent counts image launches and marks: both probes are attached."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        child.command("threads 1 1")
        m = scrape(http_port)
        if m.get("spanlet_gpu_kernel_launches_total", 0) > 0 and m.get("spanlet_span_marks_total", 0) > 0:
            child.expected.clear()
            return
        time.sleep(0.3)
    raise SystemExit("the agent never counted the child's launches and marks: is it attached?")


# RSS after the load's first WARMUP_S (the store's first inserts and merges,
# the code pages they touch) is fitted for a trend when TREND_S or more of it
# remain: several of the store's insert cycles (store.batch_interval_s), each a saw-tooth.
WARMUP_S, TREND_S = 60.0, 60.0


def measure(pid: int, seconds: float) -> dict:
    """CPU share of one core over `seconds`, and RSS samples (MB, with their
    seconds into the window) and CPU seconds so far once a second; the
    threads' CPU by name at each quarter of the window."""
    c0, t0 = cpu_s(pid), time.monotonic()
    rss, at, cpu = [rss_mb(pid)], [0.0], [0.0]
    threads = [thread_cpu(pid)]
    while time.monotonic() - t0 < seconds:
        time.sleep(min(1.0, max(0.0, seconds - (time.monotonic() - t0))))
        rss.append(rss_mb(pid))
        at.append(time.monotonic() - t0)
        cpu.append(cpu_s(pid) - c0)
        if at[-1] >= len(threads) * seconds / 4 - 0.5:
            threads.append(thread_cpu(pid))
    return {"cpu": (cpu_s(pid) - c0) / (time.monotonic() - t0), "rss": [r["rss"] for r in rss],
            "anon": [r["anon"] for r in rss], "file": [r["file"] for r in rss], "at": at,
            "cpu_s": cpu, "threads": threads}


def cpu_lines(loaded: dict) -> list[str]:
    """The load's CPU by quarter, and the threads (by name) that took most of it, by quarter."""
    at, cpu = loaded["at"], loaded["cpu_s"]
    span = at[-1] / 4
    if span < 30 or len(loaded["threads"]) < 5:
        return []
    marks = [min(range(len(at)), key=lambda i: abs(at[i] - k * span)) for k in range(5)]
    shares = [(cpu[marks[k + 1]] - cpu[marks[k]]) / (at[marks[k + 1]] - at[marks[k]]) for k in range(4)]
    out = [f"  {'CPU by quarter of the load':34}" + " /".join(f"{x:>6.1%}" for x in shares)]
    snaps = loaded["threads"][:5]
    totals = {n: snaps[4].get(n, 0.0) - snaps[0].get(n, 0.0) for n in snaps[4]}
    for name in sorted(totals, key=totals.get, reverse=True)[:6]:
        per = [(snaps[k + 1].get(name, 0.0) - snaps[k].get(name, 0.0)) / span for k in range(4)]
        out.append(f"    {'thread ' + name:32}" + " /".join(f"{x:>6.2%}" for x in per))
    return out


def rss_lines(idle: dict, loaded: dict, warmup_s: float) -> list[str]:
    """RSS idle, loaded after `warmup_s` (the store's batch, the engine's
    working set, the code pages the load touches) and its trend from there
    (the soak's verdict), anonymous and file pages apart."""
    out = [f"  {'RSS idle (MB): all / anon / file':34}{idle['rss'][-1]:>8.0f} /{idle['anon'][-1]:>4.0f} /"
           f"{idle['file'][-1]:>4.0f}"]
    if loaded["at"][-1] - warmup_s < TREND_S:
        r = loaded["rss"]
        out.append(f"  {'RSS at end of load (MB)':34}{r[-1]:>8.0f}   flat after its warm-up "
                   f"(--seconds {warmup_s + TREND_S:.0f} or more prints its trend; max {max(r):.0f} MB)")
        return out
    after = [i for i, t in enumerate(loaded["at"]) if t >= warmup_s]
    mean = lambda key: sum(loaded[key][i] for i in after) / len(after)  # noqa: E731
    out.append(f"  {'RSS loaded after ' + f'{warmup_s:.0f} s (MB): mean':34}{mean('rss'):>8.0f} /"
               f"{mean('anon'):>4.0f} /{mean('file'):>4.0f}   (max {max(loaded['rss']):.0f} MB)")
    minutes = [loaded["at"][i] / 60 for i in after]
    for key, label in (("rss", "RSS trend over the rest of the load"), ("anon", "  anonymous"),
                       ("file", "  file pages")):
        out.append(f"  {label:34}  " + rss_trend(minutes, [loaded[key][i] for i in after]))
    q = max(1, len(after) // 4)
    quarters = [sum(loaded["rss"][i] for i in after[k * q:(k + 1) * q]) / q for k in range(4)]
    out.append(f"  {'RSS by quarter of the rest (MB)':34}" + " /".join(f"{m:>5.0f}" for m in quarters))
    return out


def stop_time(agent: subprocess.Popen, limit_s: float) -> float | None:
    """Seconds from SIGTERM to exit; None if it was still running after limit_s (then killed)."""
    t0 = time.monotonic()
    agent.send_signal(signal.SIGTERM)
    try:
        agent.wait(limit_s)
        return time.monotonic() - t0
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait(10)
        return None


def exact_spans(upstream: Upstream, expected_launches: int, sent: int, limit_s: float = 30) -> tuple[int, int, int]:
    """(spans of the load upstream, of them with exactly their launches, late records), once all came."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        with upstream.lock:
            load = [s for spans in upstream.by_ids.values() for s in spans if s.name == "paced"]
        if len(load) >= sent:
            break
        time.sleep(0.2)
    with upstream.lock:
        late = sum(1 for spans in upstream.by_ids.values() for s in spans if s.name == "spanlet.kernel.late_events")
    exact = sum(1 for s in load if kernel_attrs(s).get("kernel.gpu.launches") == expected_launches)
    return len(load), exact, late


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10, help="seconds of load")
    ap.add_argument("--idle-seconds", type=float, default=None,
                    help="seconds of the idle window before the load (default: --seconds)")
    ap.add_argument("--spans", type=float, default=1000, help="spans per second")
    ap.add_argument("--launches", type=int, default=50, help="GPU launches inside each span")
    ap.add_argument("--tree", type=int, default=1,
                    help="spans a request: 1, root spans; N > 1, a SERVER span and N - 1 children "
                         "(each with its launches), whose facts the request totals sum")
    ap.add_argument("--processor", choices=("batch-sdk", "batch", "simple"), default="batch-sdk",
                    help="the app's span processor: the SDK's BatchSpanProcessor with its defaults "
                         "(batch-sdk: every 5 s or 512 spans), one exporting every 50 ms (batch), or "
                         "SimpleSpanProcessor (one export call per span)")
    a = agent_bench_args(ap, "the bench")
    cfg = config.load(env={}, overrides=a.agent_set)
    shutdown_timeout_s = cfg.shutdown_timeout_s
    upstream = Upstream()
    upstream.rx.start()
    grpc_port, http_port = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="spanlet-cpu-bench-") as tmp:
        tmp_path = Path(tmp)
        standin = cuda_standin.build(tmp_path / "standin")
        libs = soak_libraries(standin.lib_dir, tmp_path / "benchlib")
        agent = start_agent(tmp_path, grpc_port, http_port, upstream, a.agent_set)
        try:
            with FactsChild(f"127.0.0.1:{grpc_port}", libs / (SOAK_DRIVER + ".1"), a.processor) as child:
                wait_traced(child, http_port)
                # the warm-up's spans exported now and stored at the next insert: idle starts after it
                child.command("flush", "flushed")
                time.sleep(1 + cfg.store.batch_interval_s)
                idle = measure(agent.pid, a.seconds if a.idle_seconds is None else a.idle_seconds)
                load = threading.Thread(target=child.command,
                                        args=(f"paced {a.spans} {a.launches} {a.seconds + 1} {a.tree}",))
                load.start()
                time.sleep(0.5)
                loaded = measure(agent.pid, a.seconds)
                load.join()
                child.command("flush", "flushed")
            sent = -(-int(a.spans * (a.seconds + 1)) // a.tree) * a.tree
            got, exact, late = exact_spans(upstream, a.launches, sent)
            with upstream.lock:
                summed = sum(1 for spans in upstream.by_ids.values() for s in spans
                             if s.name == "paced" and "kernel.request.cpu_ns" in kernel_attrs(s))
        finally:
            stopped = stop_time(agent, shutdown_timeout_s + 10)
    upstream.rx.stop()

    print(f"agent at {a.spans:,.0f} spans/s x {a.launches} launches in each "
          f"({a.spans * a.launches:,.0f} launches/s inside spans), store and export on, {a.seconds:.0f} s loaded"
          + (f", {a.idle_seconds:.0f} s idle" if a.idle_seconds is not None else " and idle")
          + (f"; in requests of {a.tree} spans" if a.tree > 1 else "")
          + (f"; settings {' '.join(a.agent_set)}" if a.agent_set else ""))
    print(f"  {'':34}{'figure':>16}   goal")
    print(f"  {'CPU idle (share of one core)':34}{idle['cpu']:>16.1%}")
    print(f"  {'CPU loaded':34}{loaded['cpu']:>16.1%}   <= 3%")
    for line in cpu_lines(loaded):
        print(line)
    print("\n".join(rss_lines(idle, loaded, WARMUP_S)))
    print(f"  {'spans upstream / exact launches':34}{got:>8,} /{exact:>6,}   all of {sent:,} exact")
    if a.tree > 1:
        print(f"  {'requests with kernel.request.*':34}{summed:>16,}   {sent // a.tree:,} "
              f"(with sched.enabled)")
    print(f"  {'late records':34}{late:>16,}   0")
    print(f"  {'stop on SIGTERM (s)':34}"
          f"{(f'{stopped:.2f}' if stopped is not None else 'killed'):>16}   <= shutdown_timeout_s "
          f"= {shutdown_timeout_s:g}")
    print(f"agent exit status {agent.returncode}")
    if stopped is None or agent.returncode:
        print("".join(agent.log_tail), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
