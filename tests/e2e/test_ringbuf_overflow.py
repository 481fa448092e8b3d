"""Ring-buffer overflow against a real Daemon: a stand-in CUDA workload makes
two million launches inside a planted span (each one a ring-buffer record)
into a one-page ring. Every launch is either received or counted as dropped,
exactly; /metrics, /healthz, /readyz and the admin socket answer while the
flood runs; afterwards the agent receives every record again; stopped in
the middle of a flood, it leaves no reader behind and the workload runs on.
Every record received is the launch it stands for (fields exact, in the
order the launches were made)."""

from __future__ import annotations

import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from spanlet import config, events
from spanlet.daemon import Daemon
from spanlet.inspect import ask
from otlp_upstream import wait_for
from gpu_harness import cgroup_id, counts
from processes import free_port

pytestmark = pytest.mark.kernel

FLOOD = 2_000_000
TRACE_ID, SPAN_ID = bytes(range(0x40, 0x50)), 0x5A5A_0000_0000_0001
ONE_LAUNCH = "1 1 1 1 1 1 0 0"   # grid, block, shared memory, stream of a script line


class Received:
    """The daemon's event sink: launch records of one process in the span,
    each checked against the launch the workload made (`want`: thread,
    cgroup, modality, func, stream, duration, grid, block, shared memory,
    api, entry) and against the one before it (ts_ns in order)."""

    def __init__(self):
        self.pid = 0
        self.n = 0
        self.foreign = 0          # records of the span from any other process
        self.want: tuple = ()
        self.wrong = 0            # records whose fields are not the launch's
        self.out_of_order = 0
        self.last_ts = 0
        self._lock = threading.Lock()

    def __call__(self, ev: events._Event) -> None:
        if ev.hdr.kind != events.Kind.GPU_LAUNCH or ev.hdr.span_id != SPAN_ID:
            return
        with self._lock:
            if ev.hdr.pid == self.pid and bytes(ev.hdr.trace_id) == TRACE_ID:
                self.n += 1
                h = ev.hdr
                if (h.tid, h.cgroup_id, h.modality, ev.func, ev.stream, ev.duration_ns,
                        list(ev.grid), list(ev.block), ev.shared_mem, ev.api,
                        ev.entry) != self.want:
                    self.wrong += 1
                self.out_of_order += h.ts_ns < self.last_ts
                self.last_ts = h.ts_ns
            else:
                self.foreign += 1


def scrape(port: int) -> dict[tuple[str, str], float]:
    """{(sample name, probe label): value} of the self-metrics of /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ("spanlet_events_dropped_total", "spanlet_events_read_total"):
                out[(s.name, s.labels["probe"])] = s.value
    return out


def healthy(port: int, admin: str) -> dict:
    for path in ("/healthz", "/readyz"):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as r:
            assert r.status == 200, path
    answer = ask(admin, "summary", timeout=60)
    return {p["name"]: p for p in answer["data"]["probes"]}


def test_flood_drops_are_counted_exactly_and_the_agent_stays_up(tmp_path, standin, spawn):  # noqa: F811
    port = free_port()
    admin = str(tmp_path / "admin.sock")
    cfg = config.load(env={}, overrides=[
        "tc.enabled=false", "sandbox.enabled=false", "store.enabled=false",
        "otlp.grpc_port=0", "otlp.http_port=0", "http_address=127.0.0.1", f"http_port={port}",
        f"admin_socket={admin}", f"data_dir={tmp_path / 'data'}", "ringbuf_pages=1",
        "gpu.launch_events=all", "discovery.interval_s=0.2"])
    got = Received()
    w = spawn(standin.workload)
    w.timeout_s = 300          # the flood prints its line only at the end
    w.load(standin.lib_dir)
    got.pid = w.pid
    cg = cgroup_id(w.pid)
    # every launch of the flood and of the bursts: FUNC, unit grid and block, stream 0
    got.want = (w.tid, cg, events.Modality.video, 0xF00D, 0, 0, [1, 1, 1], [1, 1, 1], 0,
                events.Api.driver, events.Entry.cuLaunchKernel)
    agent = Daemon(cfg, sink=got)
    agent.check_node()
    try:
        statuses = agent.start()
        assert all(st.attached for st in statuses), [(s.name, s.reason) for s in statuses]
        span_ctx, gpu = agent.probes[0], next(p for p in agent.probes if p.name == "gpu_launch")
        wait_for(lambda: sum(lib.pid == w.pid for lib in gpu.libraries()) == 1, 10, "the GPU probe")
        span_ctx.set(w.tid, TRACE_ID, SPAN_ID, events.Modality.video)
        def launched() -> int:
            return sum(counts(gpu.launches(), cg).values())

        polls = [0]   # returns of the reader's poll(), counted on the real probe
        real_poll = gpu.poll

        def counted_poll(timeout_ms: int = 100) -> int:
            n = real_poll(timeout_ms)
            polls[0] += 1
            return n
        gpu.poll = counted_poll
        wait_for(lambda: polls[0] > 0, 10, "the reader's loop")

        w.send(f"bench {FLOOD}", "go")
        # Mid-flood: the ring overflows, and every door of the agent answers.
        wait_for(lambda: gpu.events_dropped() > 0 and got.n > 0, 60, "drops during the flood")
        # A ring kept full does not hold the reader in one poll: its loop
        # goes round (and would see a stop) while the flood goes on.
        p0 = polls[0]
        wait_for(lambda: polls[0] >= p0 + 3, 60, "the reader to come back from poll()")
        assert launched() < FLOOD, "the flood ended before the reader was seen: make it longer"
        during = []
        for _ in range(3):
            m = scrape(port)
            probes = healthy(port, admin)
            during.append((launched(), m, probes))
        assert launched() < FLOOD, "the flood ended before the agent was asked: make it longer"
        for n_then, m, probes in during:
            assert 0 < n_then < FLOOD
            assert m[("spanlet_events_dropped_total", "gpu_launch")] > 0
            assert probes["gpu_launch"]["attached"] and probes["gpu_launch"]["events_dropped"] > 0
        # The counters only grow from one answer to the next.
        drops = [m[("spanlet_events_dropped_total", "gpu_launch")] for _, m, _ in during]
        assert drops == sorted(drops)

        (line,) = [ln for ln in w.until("done") if ln.startswith("bench ")]
        assert int(line.split()[1]) == FLOOD
        assert launched() == FLOOD
        # Every launch was a record: received, or counted as dropped.
        wait_for(lambda: got.n + gpu.events_dropped() == FLOOD, 60, "the reader to catch up")
        dropped, received = gpu.events_dropped(), got.n
        assert received + dropped == FLOOD
        assert dropped > 0 and received > 0
        assert got.foreign == 0 and gpu.decode_errors == 0 and gpu.sink_errors == 0
        assert got.wrong == 0 and got.out_of_order == 0
        m = scrape(port)
        assert m[("spanlet_events_dropped_total", "gpu_launch")] == dropped
        assert m[("spanlet_events_dropped_total", "span_ctx")] == 0
        assert m[("spanlet_events_read_total", "gpu_launch")] == gpu.events_read
        assert gpu.events_read >= received

        # Recovery: bursts that fit the ring are all received, nothing more dropped.
        for k in range(1, 11):
            w.run(f"cu 10 {ONE_LAUNCH}")
            wait_for(lambda k=k: got.n == received + 10 * k, 30, f"burst {k} after the flood")
        assert gpu.events_dropped() == dropped
        assert got.wrong == 0 and got.out_of_order == 0 and got.foreign == 0
        assert launched() == FLOOD + 100
        probes = healthy(port, admin)
        assert probes["gpu_launch"]["events_dropped"] == dropped
        print(f"flood of {FLOOD} launches into a 1-page ring: {received} received, "
              f"{dropped} dropped ({dropped / FLOOD:.1%}); then 100 of 100 received")

        # Stopped in the middle of a second flood: the readers leave their
        # loop (a full ring does not hold them), and the workload runs on.
        w.send(f"bench {FLOOD}", "go")
        wait_for(lambda: gpu.events_dropped() > dropped, 60, "drops in the second flood")
        readers = [t for t in agent._threads if t.name.startswith("reader-")]
        agent.stop()
        assert readers and not any(t.is_alive() for t in readers)
        (line,) = [ln for ln in w.until("done") if ln.startswith("bench ")]
        assert int(line.split()[1]) == FLOOD
    finally:
        agent.stop()
