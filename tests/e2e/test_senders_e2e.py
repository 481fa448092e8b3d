"""The whole agent establishes each request's sender from its connection:
the daemon wires the span_ctx probe's sock_owner into the span path, and an
OTel SDK process in a cgroup of its own is counted by its socket, on
/metrics as on the receiver's stats."""

from __future__ import annotations

import pytest

from spanlet.daemon import Daemon
from otlp_senders import otlp_senders
from otlp_upstream import Upstream, agent_config

pytestmark = pytest.mark.kernel


@pytest.fixture
def agent():
    up = Upstream()
    up.rx.start()
    d = Daemon(agent_config(up, "gpu.enabled=false"))
    d.check_node()
    d.start()
    try:
        yield d
    finally:
        d.stop()
        up.rx.stop()


def origin_sample(agent, reason: str) -> float | None:
    return agent.registry.get_sample_value("spanlet_otlp_receiver_sender_origins_total",
                                           {"node": agent.cfg.node_name, "reason": reason})


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_the_daemon_knows_each_sender_by_its_socket(agent, transport):
    rx = agent.spans.receiver
    endpoint = (f"127.0.0.1:{rx.grpc_port}" if transport == "grpc"
                else f"http://127.0.0.1:{rx.http_port}/v1/traces")
    seen = []
    origin = agent.spans.senders.origin
    agent.spans.senders.origin = lambda peer: seen.append(origin(peer)) or seen[-1]
    with otlp_senders() as make:
        s = make(transport, endpoint, f"e2e-{transport}")
        s.spans(4)
        assert seen == [frozenset({s.cgroup_id})] * 4
    assert rx.stats()["origins"] == {"socket": 4, "pod_ip": 0, "unknown": 0}
    assert origin_sample(agent, "socket") == 4 and origin_sample(agent, "unknown") == 0
