"""The sender of a span from its connection, against the real kernel: OTel SDK
processes, each in a cgroup of the test's own, export over OTLP/gRPC and
OTLP/HTTP to the agent's real receiver; the origin the span path hands the
join is exactly the sending process's cgroup (sock:inet_sock_set_state saw
it connect), whatever the spans say."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from spanlet import config
from spanlet.pipeline.senders import BY_SOCKET, UNKNOWN
from spanlet.pipeline.spans import SpanPath
from otlp_senders import otlp_senders

pytestmark = pytest.mark.kernel

REPEATS = 5


@pytest.fixture(scope="module")
def path():
    """A started span path (free ports) whose senders come from a real span_ctx probe;
    every join call is recorded as (service names, origin)."""
    from spanlet.probes.span_ctx import SpanCtxProbe

    cfg = config.load(env={}, overrides=["otlp.grpc_port=0", "otlp.http_port=0"])
    probe = SpanCtxProbe(cfg)
    assert probe.start().attached, probe.status.reason
    p = SpanPath(cfg)
    p.start()
    assert p.receiver.running
    p.watch_senders(probe)
    p.calls, p.calls_lock = [], threading.Lock()
    join = p.join.join

    def recording_join(resource_spans, held=None, origin=None, **kw):
        names = {kv.value.string_value for rs in resource_spans for kv in rs.resource.attributes
                 if kv.key == "service.name"}
        with p.calls_lock:
            p.calls.append((names, origin))
        return join(resource_spans, held, origin=origin, **kw)

    p.join.join = recording_join
    try:
        yield p
    finally:
        p.stop(time.monotonic() + 2)
        probe.stop()


@pytest.fixture
def senders():
    with otlp_senders() as make:
        yield make


def endpoint(path: SpanPath, transport: str) -> str:
    if transport == "grpc":
        return f"127.0.0.1:{path.receiver.grpc_port}"
    return f"http://127.0.0.1:{path.receiver.http_port}/v1/traces"


def origins_of(path: SpanPath, name: str) -> list:
    with path.calls_lock:
        return [origin for names, origin in path.calls if name in names]


@pytest.mark.parametrize("rep", range(REPEATS))
@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_the_origin_is_the_sending_process_cgroup(path, senders, transport, rep):
    before = path.senders.counts()
    s = senders(transport, endpoint(path, transport), f"sender-{transport}-{rep}")
    s.spans(3)
    got = origins_of(path, s.name)
    assert got == [frozenset({s.cgroup_id})] * 3      # SimpleSpanProcessor: a request a span
    after = path.senders.counts()
    assert after[BY_SOCKET] - before[BY_SOCKET] == 3
    assert after[UNKNOWN] == before[UNKNOWN]


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_two_senders_on_two_connections_get_their_own(path, senders, transport):
    a = senders(transport, endpoint(path, transport), f"a-{transport}")
    b = senders(transport, endpoint(path, transport), f"b-{transport}")
    assert a.cgroup_id != b.cgroup_id
    for _ in range(3):                                  # interleaved on the two connections
        a.spans(2)
        b.spans(2)
    assert origins_of(path, a.name) == [frozenset({a.cgroup_id})] * 6
    assert origins_of(path, b.name) == [frozenset({b.cgroup_id})] * 6


def test_a_connection_the_kernel_did_not_see_is_unknown(path):
    """Opened before the receiver's ports were watched (here: sent by hand to
    a peer the kernel never recorded): no origin, and counted unknown."""
    from spanlet.exporters.otlp.trust import Peer

    before = path.senders.counts()[UNKNOWN]
    assert path.senders.origin(Peer("http", "127.0.0.1", 1, "127.0.0.1",
                                    path.receiver.http_port)) is None
    assert path.senders.counts()[UNKNOWN] == before + 1


def test_a_closed_connection_is_forgotten(path, senders):
    s = senders("http", endpoint(path, "http"), "closing")
    s.spans(1)
    probe_owner = path.senders.owners
    with path.calls_lock:
        assert [o for n, o in path.calls if s.name in n] == [frozenset({s.cgroup_id})]
    # the kernel's entry for the child's connection, found by the receiver's side of it
    conns = [c for c in _established_to(path.receiver.http_port)]
    owned = [c for c in conns if probe_owner(*c) == (s.cgroup_id, s.proc.pid)]
    assert len(owned) == 1
    s.close()
    for _ in range(50):                                 # the close runs on after the exit
        if probe_owner(*owned[0]) is None:
            break
        time.sleep(0.1)
    assert probe_owner(*owned[0]) is None


def _established_to(port: int) -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """(peer, local) of the established IPv4 connections to a local port (/proc/net/tcp)."""
    from spanlet.exporters.otlp.trust import _proc_net_address

    out = []
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        local, remote = _proc_net_address(f[1]), _proc_net_address(f[2])
        if f[3] == "01" and local[1] == port:
            out.append((remote, local))
    return out


@pytest.mark.parametrize("rep", range(REPEATS))
def test_the_same_connection_in_another_namespace_makes_it_unknown(path, rep):
    """A connection with the same addresses and ports, made in a network
    namespace of the test's own (to its own loopback), must not lend the
    first connection its owner: the entry becomes no one's."""
    from netns import Namespace, socket_in
    from spanlet.exporters.otlp.trust import Peer

    port = path.receiver.http_port
    ns = Namespace("spanlet-senders")
    socks = []
    try:
        first = socket.create_connection(("127.0.0.1", port))
        socks.append(first)
        sport = first.getsockname()[1]
        peer = Peer("http", "127.0.0.1", sport, "127.0.0.1", port)
        assert path.senders.owners(("127.0.0.1", sport), ("127.0.0.1", port))[1] == os.getpid()
        assert path.senders.origin(peer) is not None
        listener, twin = socket_in(ns.name), socket_in(ns.name)
        socks += [listener, twin]
        listener.bind(("127.0.0.1", port))
        listener.listen()
        twin.bind(("127.0.0.1", sport))
        twin.connect(("127.0.0.1", port))
        socks.append(listener.accept()[0])
        assert path.senders.owners(("127.0.0.1", sport), ("127.0.0.1", port)) is None
        assert path.senders.origin(peer) is None
    finally:
        for s in socks:
            s.close()
        ns.close()


def test_without_the_tracepoint_span_ctx_still_loads(monkeypatch):
    """A kernel without sock:inet_sock_set_state: the span context works, no sender by socket."""
    from spanlet.probes import span_ctx

    monkeypatch.setattr(span_ctx, "tracepoint_exists", lambda tp: False)
    probe = span_ctx.SpanCtxProbe(config.load(env={}))
    try:
        assert probe.start().attached, probe.status.reason
        assert probe.bpf.program_fd("inet_sock_set_state") < 0       # not loaded
        assert probe.bpf["sock_owner"].max_entries == 1              # its maps the least they can be
        probe.watch_ports([4318])
        assert probe.sock_owner(("127.0.0.1", 1), ("127.0.0.1", 4318)) is None
        probe.set(1, b"\x01" * 16, 5, span_ctx.events.Modality.text)    # the span context still works
        assert probe.get(1)[1] == 5
    finally:
        probe.stop()
