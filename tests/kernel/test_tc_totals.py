"""The TC classifier's class totals (metrics 3 and 4) are kept by the kernel as
each packet is counted: they equal an AF_PACKET capture of the same interface
exactly, also while the per-flow maps (here 64 flows) evict and re-create
flows, and the packets of a TCP flow that carries no payload end up as tcp.
Repeated runs: an exactness that holds once by luck must hold every time."""

from __future__ import annotations

import json
import socket
import time
from contextlib import closing

import pytest

from spanlet import config
from spanlet.probes.maps import dump_table
from spanlet.probes.tc import probe as tcprobe
from spanlet.probes.tc.probe import TcProbe
from tc_harness import (CLIENT_IP, SERVER_IP, Env, TcpPair, converge_by_port, delta,
                        tally_by_port)
from netns import Capture, eth, ipv4, linked, socket_in, tcp

pytestmark = pytest.mark.kernel

CLIENT_IF, SERVER_IF = "ttc0", "tts0"
MAX_FLOWS = 64
HTTP_PORT, QUIET_PORT, CLOSED_PORT, SYN_PORT = 8090, 8091, 8092, 8093
UDP_BASE, UDP_FLOWS = 20_000, 300
NOWHERE = "169.254.77.99"   # on the veth's subnet, no host: a SYN to it is never answered
CLASSES = {HTTP_PORT: ("http1", "other"), QUIET_PORT: ("tcp", "other"),
           CLOSED_PORT: ("tcp", "other"), SYN_PORT: ("tcp", "other"),
           **{UDP_BASE + i: ("udp", "other") for i in range(UDP_FLOWS)}}
REPEATS = range(3)

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@pytest.fixture(scope="module")
def env():
    with linked("tctot", CLIENT_IF, CLIENT_IP, SERVER_IF, SERVER_IP) as (cli, srv):
        cfg = config.load(env={}, overrides=[f"tc.max_flows={MAX_FLOWS}",
                                             f"tc.flow_idle_timeout_s={json.dumps(0.4)}"])
        probe = TcProbe(cfg, netns=srv.name)
        try:
            status = probe.start()
            assert status.attached, status.reason
            yield Env(cli, srv, probe)
        finally:
            probe.stop()


@pytest.fixture
def capture(env):
    with closing(Capture(env.srv, SERVER_IF)) as cap:
        yield cap


def udp_flows(env: Env, count: int, size: int) -> None:
    """Two datagrams on each of `count` flows (one server port each, nobody listening)."""
    tx = socket_in(env.cli.name, type=socket.SOCK_DGRAM)
    try:
        for i in range(count):
            tx.sendto(b"u" * (size + i % 7), (SERVER_IP, UDP_BASE + i))
            tx.sendto(b"v" * (2 * size), (SERVER_IP, UDP_BASE + i))
    finally:
        tx.close()


def pending_flows(probe: TcProbe) -> dict:
    return dump_table(probe.bpf["tc_pending"])


@pytest.mark.parametrize("run", REPEATS)
def test_class_totals_are_exact_while_the_flow_maps_evict(env, capture, run):
    before = env.probe.totals()
    pair = TcpPair(env, HTTP_PORT)          # handshake: pending, no class yet
    udp_flows(env, UDP_FLOWS, 40 + run)      # 300 flows through maps of 64
    pair.exchange(b"GET /v1/models HTTP/1.1\r\nHost: spanlet-test\r\n\r\n", OK)
    pair.close()
    udp_flows(env, 100, 90)                  # the first 100 again: re-created after eviction

    got, expected = converge_by_port(env.probe, capture, before, CLASSES)
    assert got == expected
    assert sum(p for p, _ in got.values()) == len(capture.frames)
    assert got[("ingress", "http1", "other")][0] >= 4  # SYN, ACK, request, FIN at least
    # The per-flow maps held only a fraction of the flows: the totals did not need them.
    assert len(env.probe.flows()) <= MAX_FLOWS < UDP_FLOWS
    assert pending_flows(env.probe) == {}


@pytest.mark.parametrize("run", REPEATS)
def test_a_tcp_flow_ending_without_payload_is_tcp(env, capture, run):
    before = env.probe.totals()
    listener = socket_in(env.srv.name)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((SERVER_IP, QUIET_PORT))
        listener.listen(1)
        client = socket_in(env.cli.name)
        client.connect((SERVER_IP, QUIET_PORT))   # a health check: connect, close
        server, _ = listener.accept()
        client.close()
        assert server.recv(1) == b""
        server.close()
    finally:
        listener.close()
    refused = socket_in(env.cli.name)
    try:
        with pytest.raises(ConnectionRefusedError):
            refused.connect((SERVER_IP, CLOSED_PORT))  # SYN, RST
    finally:
        refused.close()

    got, expected = converge_by_port(env.probe, capture, before, CLASSES)
    assert got == expected
    assert set(got) == {("ingress", "tcp", "other"), ("egress", "tcp", "other")}
    assert pending_flows(env.probe) == {}


@pytest.mark.parametrize("run", REPEATS)
def test_an_unanswered_syn_is_tcp_after_the_pending_grace(env, capture, run, monkeypatch):
    monkeypatch.setattr(tcprobe, "PENDING_GRACE_S", 0.5)
    frame = eth(env.srv.mac(SERVER_IF), env.cli.mac(CLIENT_IF), 0x0800,
                ipv4(socket.IPPROTO_TCP, tcp(41000 + run, SYN_PORT, b"", flags=0x02),
                     src=CLIENT_IP, dst=NOWHERE))
    before = env.probe.totals()
    sender = socket_in(env.cli.name, socket.AF_PACKET, socket.SOCK_RAW)
    try:
        sender.bind((CLIENT_IF, 0))
        for _ in range(2):
            sender.send(frame)
    finally:
        sender.close()
    deadline = time.monotonic() + 5
    while capture.drain() or len(capture.frames) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert delta(env.probe.totals(), before) == {}      # held back: no class yet
    assert len(pending_flows(env.probe)) == 1
    time.sleep(0.6)
    env.probe.refresh()
    assert delta(env.probe.totals(), before) == tally_by_port(capture.frames, CLASSES) == {
        ("ingress", "tcp", "other"): (2, 2 * len(frame))}
    assert pending_flows(env.probe) == {}
