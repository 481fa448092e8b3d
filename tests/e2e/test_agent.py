"""The whole agent: `spanlet run` in a network namespace of the test attaches
every probe, prints decoded events, and on SIGTERM/SIGINT exits 0 within 5 s
leaving no program, TC filter, uprobe or pinned map behind."""

from __future__ import annotations

import ctypes.util
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import cuda_standin
from bpf_leftovers import bpf_ids, bpftool_ids, still_loaded
from netns import Namespace, linked

pytestmark = pytest.mark.kernel
ROOT = Path(__file__).resolve().parents[2]


HEAP_MAX = 64 << 20        # glibc's heap of a thread's arena (64-bit): reserved whole, aligned to its size


def malloc_heaps(pid: int) -> int:
    """The heaps of glibc's thread arenas that `pid` maps (the main arena's is not one):
    anonymous mappings at a multiple of HEAP_MAX, readable and writable at the start,
    HEAP_MAX long with the reserved rest that follows them."""
    maps = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        f = line.split()
        start, end = (int(x, 16) for x in f[0].split("-"))
        maps.append((start, end, f[1], f[5] if len(f) > 5 else ""))
    heaps = 0
    for i, (start, end, perms, path) in enumerate(maps):
        if path or start % HEAP_MAX or not perms.startswith("rw"):
            continue
        for nxt_start, nxt_end, _, nxt_path in maps[i + 1:]:
            if end - start >= HEAP_MAX or nxt_start != end or nxt_path:
                break
            end = nxt_end
        heaps += end - start == HEAP_MAX
    return heaps


def lines_of(stream, q: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        q.put(line.rstrip("\n"))
    q.put(None)


class Agent:
    """`spanlet run` inside network namespace `ns`, its stdout and stderr read
    by threads so that neither pipe fills."""

    def __init__(self, ns: Namespace, config: Path, *extra: str):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SPANLET_") and k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
        self.proc = subprocess.Popen(
            # nsenter switches only the network namespace (ip netns exec would
            # also remount /sys, hiding tracefs and bpffs)
            ["nsenter", f"--net=/run/netns/{ns.name}", sys.executable, "-m", "spanlet.cli", "run",
             "--config", str(config), "--print-events", *extra],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out: queue.Queue = queue.Queue()
        self.err: queue.Queue = queue.Queue()
        self.log: list[str] = []
        for stream, q in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lines_of, args=(stream, q), daemon=True).start()

    def wait_log(self, text: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.err.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"agent exited before {text!r}:\n" + "\n".join(self.log))
            self.log.append(line)
            if text in line:
                return line
        raise AssertionError(f"no {text!r} in the agent's log within {timeout} s:\n"
                             + "\n".join(self.log))

    def events(self, want, timeout: float = 10) -> list[dict]:
        """Printed events for which want(event) holds, until none come for a while."""
        got, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.out.get(timeout=0.5)
            except queue.Empty:
                if got:
                    break
                continue
            if line is None:
                break
            ev = json.loads(line)
            if want(ev):
                got.append(ev)
        return got

    def bpf_ids(self) -> tuple[set[int], set[int]]:
        """Ids of the BPF programs and maps the agent's process holds open."""
        # nsenter execs the command: the agent is that very process.
        return bpf_ids(self.proc.pid)

    def stop(self, sig: int) -> float:
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        self.proc.wait(timeout=15)
        return time.monotonic() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def node(tmp_path):
    """A namespace with one veth (the agent's node) and a peer namespace."""
    with linked("spanlet-ag", "sla0", "169.254.91.1", "slb0", "169.254.91.2") as pair:
        yield pair


@pytest.fixture
def pool_prefix():
    prefix = Path(f"/dev/shm/tensor_pool_agent_{secrets.token_hex(4)}")
    prefix.mkdir()
    try:
        yield prefix
    finally:
        for f in prefix.iterdir():
            f.unlink()
        prefix.rmdir()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_run_attaches_reads_and_detaches(tmp_path, node, pool_prefix, sig):
    host, peer = node
    standin = cuda_standin.build(tmp_path / "cuda")
    config = tmp_path / "spanlet.yaml"
    config.write_text(
        f"data_dir: {tmp_path / 'data'}\n"
        "tc:\n  interfaces: [sla0, nosuch0]\n"
        f"sandbox:\n  prefixes: [{pool_prefix}/]\n"
        "gpu:\n  launch_events: all\n")
    with cuda_standin.Workload(standin.workload) as w:
        w.load(standin.lib_dir)            # a process that maps libcuda before the agent
        agent = Agent(host, config)
        try:
            agent.wait_log("spanlet: running")
            log = "\n".join(agent.log)
            assert "kernel headers: " in log
            assert f"store: embedded chdb in {tmp_path / 'data' / 'chdb'}" in log
            if ctypes.util.find_library("nvidia-ml") is None:   # no GPU driver here
                assert log.count("NVML not available") == 1, log
            for probe in ("span_ctx", "mmap_sandbox", "gpu_launch"):
                assert f"probe {probe} attached" in log, log
            tc_line = next(l for l in agent.log if "probe tc_classify attached" in l)
            assert "1 failed: " in tc_line and "nosuch0" in tc_line
            for direction in ("ingress", "egress"):
                assert "spanlet" in host.tc("filter", "show", "dev", "sla0", direction)
            progs, maps = agent.bpf_ids()
            assert len(progs) >= 8 and progs <= bpftool_ids("prog")
            pins = list(Path("/sys/fs/bpf/spanlet").glob(f"{agent.proc.pid}-*/span_ctx"))
            assert len(pins) == 1
            # its threads share two malloc arenas (memory.cap_malloc_arenas): one heap besides the main one
            assert malloc_heaps(agent.proc.pid) == 1

            # kernel → ring buffer → decoder → stdout, end to end
            w.run("cu 3 4 2 1 128 1 1 256 0")
            launches = agent.events(lambda e: e["kind"] == "GPU_LAUNCH" and e["pid"] == w.pid)
            assert len(launches) == 3
            assert launches[0]["grid"] == [4, 2, 1] and launches[0]["block"] == [128, 1, 1]
            assert launches[0]["shared_mem"] == 256
            assert abs(launches[0]["ts_ns"] - time.time_ns()) < 60e9

            # a process started after the agent, with its own copy of the library
            later_libs = standin.copy_libs(tmp_path / "later")
            with cuda_standin.Workload(standin.workload) as later:
                later.load(later_libs)
                deadline = time.monotonic() + 2.5
                while time.monotonic() < deadline:
                    later.run("cu 1 1 1 1 1 1 1 0 0")
                    if agent.events(lambda e: e["kind"] == "GPU_LAUNCH"
                                    and e["pid"] == later.pid, timeout=0.6):
                        break
                else:
                    raise AssertionError("a process started after the agent was not traced in 2.5 s")

            took = agent.stop(sig)
            assert agent.proc.returncode == 0, "\n".join(agent.log)
            assert took < 5.0
        finally:
            agent.kill()
    # nothing of the agent is left
    assert not still_loaded(progs, "prog")
    assert not still_loaded(maps, "map")
    for direction in ("ingress", "egress"):
        assert host.tc("filter", "show", "dev", "sla0", direction).strip() == ""
    uprobes = Path("/sys/kernel/tracing/uprobe_events").read_text()
    assert f"bcc_{agent.proc.pid}" not in uprobes
    assert not list(Path("/sys/fs/bpf/spanlet").glob(f"{agent.proc.pid}-*"))


def test_restart_after_sigkill_leaves_nothing_of_the_dead_agent(tmp_path, node, pool_prefix):
    """SIGKILL leaves the dead agent's TC filters and pin behind (the kernel
    keeps a filter's program alive); the next agent removes them at start,
    re-attaches every probe, and a process that ran through both is traced."""
    host, _peer = node
    standin = cuda_standin.build(tmp_path / "cuda")
    config = tmp_path / "spanlet.yaml"
    config.write_text(f"data_dir: {tmp_path / 'data'}\ntc:\n  interfaces: [sla0]\n"
                      f"sandbox:\n  prefixes: [{pool_prefix}/]\ngpu:\n  launch_events: all\n"
                      f"admin_socket: {tmp_path / 'admin.sock'}\n")
    with cuda_standin.Workload(standin.workload) as w:
        w.load(standin.lib_dir)
        first = Agent(host, config)
        try:
            first.wait_log("spanlet: running")
            first_progs, _ = first.bpf_ids()
            first.proc.kill()
            first.proc.wait(10)
        finally:
            first.kill()
        # what the kill left: the TC filters (their programs stay loaded) and the pin
        left = first_progs & bpftool_ids("prog")
        assert left, "expected the dead agent's TC programs to outlive it"
        assert "spanlet" in host.tc("filter", "show", "dev", "sla0", "ingress")
        assert list(Path("/sys/fs/bpf/spanlet").glob(f"{first.proc.pid}-*"))

        second = Agent(host, config)
        try:
            t0 = time.monotonic()
            second.wait_log("spanlet: running")
            started_s = time.monotonic() - t0
            log = "\n".join(second.log)
            for probe in ("span_ctx", "tc_classify", "mmap_sandbox", "gpu_launch"):
                assert f"probe {probe} attached" in log, log
            # the dead agent's filters were replaced, not added to: one per hook
            for direction in ("ingress", "egress"):
                assert host.tc("filter", "show", "dev", "sla0", direction).count("spanlet") == 1
            assert not still_loaded(first_progs, "prog"), "the dead agent's programs are still loaded"
            assert not list(Path("/sys/fs/bpf/spanlet").glob(f"{first.proc.pid}-*"))
            # the workload that ran through both agents is traced by the new one
            w.run("cu 2 1 1 1 1 1 1 0 0")
            got = second.events(lambda e: e["kind"] == "GPU_LAUNCH" and e["pid"] == w.pid)
            assert len(got) == 2
            second.stop(signal.SIGTERM)
            assert second.proc.returncode == 0
        finally:
            second.kill()
    print(f"second agent up in {started_s:.1f} s (compile included)")


def test_sigterm_during_the_start_stops_the_agent_after_it_leaving_nothing(tmp_path):
    """A SIGTERM while the probes compile (a pod deleted as it starts) is taken
    once the start is done: the agent then stops as ever, its pin folder and
    programs gone, exit status 0; the signal's default action would end it at
    once and leave them behind."""
    from processes import free_port

    config = tmp_path / "spanlet.yaml"
    config.write_text(f"data_dir: {tmp_path / 'data'}\nadmin_socket: {tmp_path / 'admin.sock'}\n"
                      "compile_cache: false\ntc:\n  enabled: false\nstore:\n  enabled: false\n"
                      f"http_address: 127.0.0.1\nhttp_port: {free_port()}\n"
                      f"otlp:\n  grpc_port: {free_port()}\n  http_port: {free_port()}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPANLET_")}
    proc = subprocess.Popen([sys.executable, "-m", "spanlet.cli", "run", "--config", str(config)],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lines_of, args=(proc.stderr, lines), daemon=True).start()
    log = []
    try:
        while (line := lines.get(timeout=60)) is not None:
            log.append(line)
            if "kernel headers: compiling against" in line:
                break
        time.sleep(0.3)                      # the first probe compiling
        assert not any("spanlet: running" in line for line in log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, "\n".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    while (line := lines.get(timeout=10)) is not None:
        log.append(line)
    text = "\n".join(log)
    assert "received SIGTERM" in text and "stopped: all probes detached" in text, text
    assert not list(Path("/sys/fs/bpf/spanlet").glob(f"{proc.pid}-*"))
