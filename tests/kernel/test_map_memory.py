"""What the probes' maps take from the node's kernel memory (charged to the
agent's memory cgroup) as it grows with its CPUs: a per-CPU hash keyed by
what a node has few of is not preallocated (a value per CPU for each key
used, not max_entries of them made at each load); the per-CPU maps that are
preallocated with more than a few entries is the per-flow counters map of the
TC probe, named in the README's limits."""

from __future__ import annotations

import pytest

from spanlet import config
from spanlet.probes import compile_cache
from spanlet.probes.compile_cache import map_info
from spanlet.probes.gpu import GpuProbe
from spanlet.probes.sandbox.probe import SandboxProbe
from spanlet.probes.span_ctx import SpanCtxProbe
from spanlet.probes.tc.probe import TcProbe

pytestmark = pytest.mark.kernel

PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH = 5, 6, 10
BPF_F_NO_PREALLOC = 1
FEW = 1024       # entries a preallocated per-CPU map may have without being named here


@pytest.fixture(scope="module")
def maps(tmp_path_factory):
    """Every table of every probe, compiled as the agent compiles them: (probe, table) -> map info."""
    cfg = config.load(env={}, overrides=[f"data_dir={tmp_path_factory.mktemp('data')}",
                                         "compile_cache=false"])
    span = SpanCtxProbe(cfg)
    assert span.start().attached, span.status.reason
    probes = [span]
    try:
        for cls in (GpuProbe, SandboxProbe, TcProbe):
            p = cls(cfg)
            p.compile(pin_dir=str(span.pin_dir))
            probes.append(p)
        proxy = compile_cache._install()          # libbcc's module calls, as bcc's Python makes them
        out = {}
        for p in probes:
            if p.core:                            # a CO-RE object: its maps by name
                out.update({(p.name, name): map_info(p.bpf[name].fd) for name in p.bpf.maps()})
                continue
            for i in range(proxy.bpf_num_tables(p.bpf.module)):
                name = proxy.bpf_table_name(p.bpf.module, i)
                out[(p.name, name.decode())] = map_info(proxy.bpf_table_fd_id(p.bpf.module, i))
        yield out
    finally:
        for p in reversed(probes):
            p.stop()


def test_per_cpu_hashes_are_not_preallocated(maps):
    hashes = {k: info for k, info in maps.items() if info.type == PERCPU_HASH}
    assert {k[1] for k in hashes} >= {"spanlet_gpu_kernel_launches_total", "spanlet_gpu_sync_wait_seconds",
                                      "spanlet_sandbox_violations_total"}
    assert {k: info.map_flags & BPF_F_NO_PREALLOC for k, info in hashes.items()} == \
        {k: BPF_F_NO_PREALLOC for k in hashes}


def test_the_only_large_preallocated_per_cpu_map_is_the_per_flow_one(maps):
    large = {k for k, info in maps.items()
             if info.type in (PERCPU_ARRAY, LRU_PERCPU_HASH) and info.max_entries > FEW}
    assert large == {("tc_classify", "tc_flow_counters")}
