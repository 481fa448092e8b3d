"""What the benches that run the whole agent share: `spanlet run` in its own
process, OTLP span batches to load it with, and a process's CPU time."""

from __future__ import annotations

import io
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

REPO = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User and system CPU seconds of `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


POOL_THREAD = re.compile(r"_\d+$")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of the process's live threads, summed by thread name (a pool's, numbered
    name_0, name_1, ... as one)."""
    out: dict[str, float] = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = POOL_THREAD.sub("", text[text.index("(") + 1:text.rindex(")")])
        fields = text.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def engine_pid(agent_pid: int) -> int | None:
    """The agent's store engine process (store.engine_process), if it has one now."""
    for task in Path(f"/proc/{agent_pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spanlet.exporters.clickhouse.engine_process" in cmdline:
                return int(child)
    return None


def agent_cpu_s(agent_pid: int) -> float:
    """CPU seconds of the agent and of its store engine process so far (the
    engine's from /proc while it runs: a restarted one starts again from 0)."""
    total = cpu_s(agent_pid)
    pid = engine_pid(agent_pid)
    if pid is not None:
        try:
            total += cpu_s(pid)
        except OSError:
            pass
    return total


def spans_request(n: int, rnd: random.Random, service: str,
                  modality: str) -> ExportTraceServiceRequest:
    """`n` SERVER spans of 5 ms ending now, of one service and one mm.modality."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = service
    ss = rs.scope_spans.add()
    now = time.time_ns()
    for _ in range(n):
        s = ss.spans.add(name="infer", trace_id=rnd.randbytes(16), span_id=rnd.randbytes(8), kind=2,
                         start_time_unix_nano=now - 5_000_000, end_time_unix_nano=now)
        s.attributes.add(key="mm.modality").value.string_value = modality
    return req


class Agent:
    """`spanlet run` with each of `settings` (KEY=VALUE) as a --set; `tail` holds
    the last lines of its log, which is drained so that it never blocks on a pipe."""

    def __init__(self, settings: list[str], keep: int = 20, env: dict | None = None) -> None:
        self.keep = keep
        self.tail: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spanlet.cli", "run", *(arg for kv in settings for arg in ("--set", kv))],
            cwd=REPO, stderr=subprocess.PIPE, text=True, env=env)

    def _read(self, until: str | None) -> bool:
        for line in self.proc.stderr:
            self.tail.append(line)
            del self.tail[:-self.keep]
            if until is not None and until in line:
                return True
        return False

    def wait_running(self) -> bool:
        """Whether the agent said it runs (False: its log ended first)."""
        if not self._read("spanlet: running"):
            return False
        threading.Thread(target=self._read, args=(None,), daemon=True).start()
        return True


def agent_bench_args(ap, what: str, more_set_help: str = ""):
    """The options every whole-agent bench shares (--set, repeatable), parsed;
    exits 2 with one line unless run as root (the bench loads the agent's programs)."""
    ap.add_argument("--set", dest="agent_set", action="append", default=[], metavar="KEY=VALUE",
                    help="one more agent setting (repeatable)" + more_set_help)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit(f"{what} runs the whole agent: run it as root")
    return a


def tree_at(ref: str, into: Path) -> Path:
    """A folder to put on PYTHONPATH whose `spanlet` is the package of `ref` (its files, from
    `git archive`, with this tree's built native extensions)."""
    src = into / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", ref, "agent", "exporters", "bpf"], cwd=REPO,
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as t:
        t.extractall(src, filter="data")
    pkg = into / "pkg" / "spanlet"
    shutil.copytree(src / "agent", pkg)
    shutil.copytree(src / "exporters", pkg / "exporters")
    shutil.copytree(src / "bpf", pkg / "bpf")
    for built in list((REPO / "agent").glob("*.so")) + [REPO / "agent" / "_native"]:
        if built.is_dir():
            shutil.copytree(built, pkg / built.name, dirs_exist_ok=True)
        elif built.exists():
            shutil.copy2(built, pkg / built.name)
    return into / "pkg"


# -- trends ----------------------------------------------------------------------------------------

def fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares slope, its standard error, and the residuals' standard deviation."""
    n = len(xs)
    if n < 3:
        return float("nan"), float("nan"), float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    res = [y - (my + slope * (x - mx)) for x, y in zip(xs, ys)]
    var = sum(r * r for r in res) / (n - 2)
    return slope, math.sqrt(var / sxx), math.sqrt(var)


def rss_trend(minutes: list[float], mb: list[float]) -> str:
    """The verdict on RSS samples (MB at minutes): no growth trend when the
    least-squares slope lies within two standard errors or the drift it makes
    over the samples is under 2% of their mean."""
    slope, se, sd = fit(minutes, mb)
    mean = sum(mb) / len(mb)
    drift = slope * (minutes[-1] - minutes[0])
    within = abs(slope) <= 2 * se or abs(drift) < 0.02 * mean
    trend = "no growth trend" if within else ("GROWTH TREND" if slope > 0 else "falling")
    return (f"{trend} (slope {slope:+.3f} MB/min, noise ±{2 * se:.3f}; drift over the fitted "
            f"{minutes[-1] - minutes[0]:.1f} min {drift:+.1f} MB = {drift / mean:+.1%} of the mean; "
            f"residual sd {sd:.2f} MB)")


def quarter_means(ys: list[float]) -> tuple[float, float]:
    q = max(1, len(ys) // 4)
    return sum(ys[:q]) / q, sum(ys[-q:]) / q
