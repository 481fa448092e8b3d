"""A real Prometheus server (Debian's) scrapes a running agent: the kernel
metrics carry exactly what the test caused, and `promtool check metrics`
accepts the exposition."""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

import cuda_standin
from spanlet import config
from spanlet.daemon import Daemon
from netns import linked, socket_in
from otlp_upstream import wait_for
from processes import free_port
from prometheus_server import Prometheus

pytestmark = pytest.mark.kernel


@pytest.fixture
def nets():
    with linked("spanlet-pm", "pma0", "169.254.94.1", "pmb0", "169.254.94.2") as pair:
        yield pair


@pytest.fixture
def pool_dir():
    d = Path(f"/dev/shm/tensor_pool_prom_{secrets.token_hex(4)}")
    d.mkdir()
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_prometheus_scrapes_exact_kernel_metrics(tmp_path, nets, pool_dir):
    a, b = nets
    standin = cuda_standin.build(tmp_path / "cuda")
    port = free_port()
    cfg = config.load(env={}, overrides=[
        f"tc.netns={b.name}", "tc.interfaces=pmb0", f"sandbox.prefixes=[{pool_dir}/]",
        "http_address=127.0.0.1", f"http_port={port}", "store.enabled=false", "otlp.grpc_port=0", "otlp.http_port=0",
        "discovery.interval_s=0.2"])
    with cuda_standin.Workload(standin.workload) as w:
        w.load(standin.lib_dir)
        agent = Daemon(cfg)
        agent.check_node()
        agent.start()
        prom = Prometheus(tmp_path, f"127.0.0.1:{port}")
        try:
            gpu = next(p for p in agent.probes if p.name == "gpu_launch")
            # the driver hooked before the first launch (the runtime is looked for
            # only with gpu.runtime_hooks)
            wait_for(lambda: sum(l.pid == w.pid for l in gpu.libraries()) == 1, 5, "the GPU probe")
            # the 3 runtime launches reach the driver (as real cudart does): by default each
            # is counted once, there, under api="driver" (runtime hooks are off)
            out = w.run("cu 5 1 1 1 1 1 1 0 0", "cuda 3 1 1 1 1 1 1 0 0", "cusync 3000")
            # "sync API NS": the workload's own timing around the call, an upper bound
            took_ns = next(int(l.split()[2]) for l in out if l.startswith("sync"))
            # 20 UDP datagrams of 100 bytes from a to b
            tx = socket_in(a.name, socket.AF_INET, socket.SOCK_DGRAM)
            for _ in range(20):
                tx.sendto(b"u" * 100, ("169.254.94.2", 9999))
            tx.close()
            # one unauthorized mapping of a pool
            pool = pool_dir / "kv0"
            pool.write_bytes(b"\0" * 4096)
            subprocess.run([sys.executable, "-c",
                            "import mmap, os; fd = os.open(%r, os.O_RDONLY); "
                            "mmap.mmap(fd, 4096, prot=mmap.PROT_READ)" % str(pool)], check=True)

            launches = 'sum by (api) (spanlet_gpu_kernel_launches_total)'
            try:
                wait_for(lambda: {r["metric"].get("api"): float(r["value"][1])
                                  for r in prom.query(launches)} == {"driver": 5 + 3},
                         30, "launch counts in Prometheus")
            except AssertionError as e:
                raise AssertionError(f"{e}: {prom.query(launches)}; up: {prom.query('up')}")
            assert prom.value("sum(spanlet_gpu_sync_wait_seconds_count)") == 1
            wait_s = prom.value("sum(spanlet_gpu_sync_wait_seconds_sum)")
            assert 0.003 <= wait_s <= took_ns / 1e9
            wait_for(lambda: prom.value('sum(spanlet_network_packets_total{protocol="udp",'
                                        'direction="ingress"})') == 20, 30, "UDP packets")
            # 100 bytes of payload + UDP 8 + IPv4 20 + Ethernet 14
            assert prom.value('sum(spanlet_network_bytes_total{protocol="udp",'
                              'direction="ingress"})') == 20 * 142
            wait_for(lambda: prom.value('sum(spanlet_sandbox_violations_total'
                                        '{rule="unauthorized",action="audit"})') == 1, 30,
                     "the sandbox violation")
            for probe in ("span_ctx", "tc_classify", "mmap_sandbox", "gpu_launch"):
                assert prom.value(f'spanlet_probe_attached{{probe="{probe}"}}') == 1
            # promtool on the exposition itself
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                exposition = r.read()
            check = subprocess.run(["promtool", "check", "metrics"], input=exposition,
                                   capture_output=True)
            assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), \
                check.stdout + check.stderr
            for path, status in (("/healthz", 200), ("/readyz", 200)):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                    assert r.status == status
        finally:
            prom.stop()
            agent.stop()
