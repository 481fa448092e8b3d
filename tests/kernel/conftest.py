"""Fixtures of the kernel tier: real programs loaded into the running kernel,
driven by child processes and namespaces the tests make."""

from __future__ import annotations

import secrets

import pytest

from sandbox_harness import Harness, Pools, _own_cgroup
from spanlet import config
from spanlet.cgroups import CgroupResolver


@pytest.fixture
def kernel():
    """start(span_facts_max=65536, *overrides) → (span_ctx probe, GPU probe)
    with default GPU settings, the GPU probe on the span_ctx probe's maps."""
    from spanlet.probes.gpu import GpuProbe
    from spanlet.probes.span_ctx import SpanCtxProbe

    started = []

    def start(*overrides: str, span_facts_max: int = 65536):
        cfg = config.load(env={}, overrides=[f"join.span_facts_max={span_facts_max}",
                                             *overrides])
        span = SpanCtxProbe(cfg)
        started.append(span)
        assert span.start().attached, span.status.reason
        gpu = GpuProbe(cfg)
        started.append(gpu)
        assert gpu.start(pin_dir=span.shared_pin_dir()).attached, gpu.status.reason
        return span, gpu

    yield start
    for p in reversed(started):
        p.stop()


@pytest.fixture(scope="module")
def pools():
    p = Pools(secrets.token_hex(4))
    try:
        p.create()
        yield p
    finally:
        p.remove()


@pytest.fixture(scope="module")
def audit(pools):
    h = Harness(pools.config())
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def own_cgroup_id():
    return CgroupResolver().id(_own_cgroup())


@pytest.fixture
def probes():
    """Start probes (GPU ones with a config tweak); stopped at teardown, last first.
    By default timing and runtime hooks are on: both layers, both probes per
    launch (the defaults, one entry-only driver probe, are asked for by name)."""
    from spanlet import config, events
    from spanlet.probes.gpu import GpuProbe

    started = []

    def gpu(launch_events: str = "all", pin_dir: str | None = None,
            unmapped_grace_s: float = 600.0, timing: bool = True, runtime_hooks: bool = True,
            uprobe_multi: bool = True, **kw) -> GpuProbe:
        cfg = config.load(env={})
        cfg.gpu.launch_events = launch_events
        cfg.gpu.launch_timing, cfg.gpu.runtime_hooks = timing, runtime_hooks
        cfg.gpu.uprobe_multi = uprobe_multi
        cfg.discovery.unmapped_grace_s = unmapped_grace_s
        seen: list[events._Event] = []
        p = GpuProbe(cfg, sink=seen.append, **kw)
        p.seen = seen
        started.append(p)
        st = p.start(pin_dir=pin_dir)
        assert st.attached, st.reason
        return p

    def span_ctx():
        from spanlet.probes.span_ctx import SpanCtxProbe

        p = SpanCtxProbe(config.load(env={}))
        started.append(p)
        assert p.start().attached, p.status.reason
        return p

    gpu.span_ctx = span_ctx
    yield gpu
    for p in reversed(started):
        p.stop()


@pytest.fixture
def traced(standin, spawn, probes):
    """start(**gpu) → (workload, span probe, GPU probe): a workload with the
    stand-ins loaded, the span context and GPU probes sharing the span facts."""
    def start(**gpu):
        span = probes.span_ctx()
        w = spawn(standin.workload)
        w.load(standin.lib_dir)
        gpu = probes(pin_dir=span.shared_pin_dir(), **gpu)
        return w, span, gpu
    return start
