"""The TC classifier on a real kernel: two network namespaces joined by a veth,
the probe on the server end, traffic of every class driven from this process,
and the probe's counts compared exactly with an AF_PACKET capture of the same
interface; traceparent parsing, RTP jitter (JSS), and attach/detach hygiene."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from spanlet import config, events
from spanlet.probes.tc.attach import FILTER_NAME
from spanlet.probes.tc.probe import Method, TcProbe, path_hash
from tc_harness import (CLIENT_IP, SERVER_IP, Env, TcpPair, converge_by_port, delta, server_port,
                        tally_by_port)
from netns import Capture, Namespace, eth, ipv4, ipv6, socket_in, tcp, udp, veth_pair

pytestmark = pytest.mark.kernel

REPO = Path(__file__).resolve().parents[2]

CLIENT_IF, SERVER_IF = "tcc0", "tcs0"

# What each server port carries, as the test knows it (the independent side).
PORT_CLASS = {
    8080: ("http1", "image"),      # Content-Type: image/png, traceparent
    8081: ("http2", "other"),      # h2c preface + SETTINGS
    8082: ("http2", "other"),      # gRPC-like call over h2c
    8083: ("websocket", "other"),
    8084: ("tcp", "other"),
    8085: ("tcp", "video"),        # port map
    8086: ("http1", "audio"),      # port map wins over Content-Type: image/png
    9000: ("udp", "other"),
    5004: ("rtp", "audio"),        # PT 0
    5005: ("rtp", "other"),        # RTCP
    5006: ("rtp", "video"),        # PT 96
}
PORT_MODALITY = {"8085": "video", "8086": "audio"}

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
SPAN_ID = "b7ad6b7169203331"
TRACE_ID2 = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID2 = "00f067aa0ba902b7"


# ---- fixtures ----------------------------------------------------------------------



def make_cfg(**tc) -> config.Config:
    overrides = [f"tc.port_modality={json.dumps(PORT_MODALITY)}"]
    overrides += [f"tc.{k}={json.dumps(v)}" for k, v in tc.items()]
    return config.load(env={}, overrides=overrides)


@pytest.fixture(scope="module")
def env():
    made: list = []
    try:
        cli = Namespace("tctest-c")
        made.append(cli)
        srv = Namespace("tctest-s")
        made.append(srv)
        veth_pair(cli, CLIENT_IF, CLIENT_IP, srv, SERVER_IF, SERVER_IP)
        got: list = []
        probe = TcProbe(make_cfg(), sink=got.append, netns=srv.name)
        made.append(probe)
        status = probe.start()
        assert status.attached, status.reason
        assert status.attachments == [f"{SERVER_IF}/ingress", f"{SERVER_IF}/egress"]
        yield Env(cli, srv, probe, got)
    finally:
        for thing in reversed(made):
            if isinstance(thing, TcProbe):
                thing.stop()
            else:
                thing.close()


@pytest.fixture
def capture(env):
    cap = Capture(env.srv, SERVER_IF)
    try:
        yield cap
    finally:
        cap.close()


# ---- traffic helpers ---------------------------------------------------------------



def http_request(method: str, target: str, headers: list[tuple[str, str]], body: bytes = b"") -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: spanlet-test"]
    lines += [f"{k}: {v}" for k, v in headers]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}"

INVALID_TRACEPARENTS = {
    "short trace id": f"00-{TRACE_ID[:31]}-{SPAN_ID}-01",
    "non-hex": f"00-{TRACE_ID[:5]}g{TRACE_ID[6:]}-{SPAN_ID}-01",
    "version ff": f"ff-{TRACE_ID}-{SPAN_ID}-01",
    "zero trace id": f"00-{'0' * 32}-{SPAN_ID}-01",
    "zero span id": f"00-{TRACE_ID}-{'0' * 16}-01",
    "uppercase hex": f"00-{TRACE_ID.upper()}-{SPAN_ID}-01",
    "trailing garbage": f"00-{TRACE_ID}-{SPAN_ID}-01x",
}


def drive_http1(env: Env) -> None:
    pair = TcpPair(env, 8080)
    # Content-Type before the traceparent, mixed-case header name, a query.
    pair.exchange(http_request("POST", "/v1/images/generate?n=1", [
        ("Content-Type", "image/png"), ("TraceParent", f"00-{TRACE_ID}-{SPAN_ID}-01"),
        ("User-Agent", "spanlet-test/1.0")], body=b"\x89PNG" + b"\x00" * 1200), OK)
    # Keep-alive: every request is parsed; whitespace after the colon.
    pair.exchange(http_request("GET", "/v1/models", [
        ("Accept", "text/plain"), ("traceparent", f"  00-{TRACE_ID2}-{SPAN_ID2}-00")]), OK)
    for tp in INVALID_TRACEPARENTS.values():
        pair.exchange(http_request("PUT", "/v1/bad", [("traceparent", tp)]), OK)
    pair.close()


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def h2_frame(ftype: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack("!I", len(payload))[1:] + bytes([ftype, flags]) + struct.pack("!I", stream) + payload


SETTINGS, SETTINGS_ACK = h2_frame(4, 0, 0), h2_frame(4, 1, 0)


def drive_h2c(env: Env) -> None:
    pair = TcpPair(env, 8081)
    pair.exchange(H2_PREFACE + SETTINGS, SETTINGS + SETTINGS_ACK)
    pair.exchange(SETTINGS_ACK + h2_frame(7, 0, 0, b"\x00" * 8), b"")  # GOAWAY
    pair.close()


def drive_grpc(env: Env) -> None:
    pair = TcpPair(env, 8082)
    pair.exchange(H2_PREFACE + SETTINGS, SETTINGS + SETTINGS_ACK)
    headers = (b"\x83\x86\x44\x1c/helloworld.Greeter/SayHello\x41\x0aspanlet.io"
               b"\x5f\x10application/grpc\x40\x02te\x08trailers")
    message = b"\x0a\x07spanlet"
    pair.exchange(SETTINGS_ACK + h2_frame(1, 0x4, 1, headers)
                  + h2_frame(0, 0x1, 1, b"\x00" + struct.pack("!I", len(message)) + message),
                  h2_frame(1, 0x4, 1, b"\x88\x5f\x10application/grpc")
                  + h2_frame(0, 0, 1, b"\x00\x00\x00\x00\x0d\x0a\x0bhello there")
                  + h2_frame(1, 0x5, 1, b"\x40\x0bgrpc-status\x010"))
    pair.close()


def ws_frame(payload: bytes, mask: bytes | None) -> bytes:
    head = bytes([0x81, len(payload) | (0x80 if mask else 0)])
    if not mask:
        return head + payload
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def drive_websocket(env: Env) -> None:
    pair = TcpPair(env, 8083)
    pair.exchange(http_request("GET", "/chat", [
        ("Upgrade", "websocket"), ("Connection", "Upgrade"),
        ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="), ("Sec-WebSocket-Version", "13")]),
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n")
    for i in range(3):
        pair.exchange(ws_frame(f"GET / hello {i}".encode(), b"\x37\xfa\x21\x3d"),
                      ws_frame(f"reply {i}".encode(), None))
    pair.close()


def drive_tcp(env: Env, port: int, chunks: int, size: int) -> None:
    pair = TcpPair(env, port)
    for i in range(chunks):
        data = bytes([i % 251]) * size
        pair.exchange(data, data[: size // 2])
    pair.close()


def drive_http_on_audio_port(env: Env) -> None:
    pair = TcpPair(env, 8086)
    pair.exchange(http_request("POST", "/v1/speech", [("Content-Type", "image/png")], b"x" * 64), OK)
    pair.close()


def drive_udp(env: Env) -> None:
    server = socket_in(env.srv.name, type=socket.SOCK_DGRAM)
    client = socket_in(env.cli.name, type=socket.SOCK_DGRAM)
    try:
        server.bind((SERVER_IP, 9000))
        server.settimeout(10)
        client.settimeout(10)
        for i in range(5):
            client.sendto(b"\x00ping %d" % i, (SERVER_IP, 9000))
            data, peer = server.recvfrom(100)
            server.sendto(b"\x00pong" + data[5:], peer)
            assert client.recv(100).startswith(b"\x00pong")
    finally:
        server.close()
        client.close()


# ---- the independent count -----------------------------------------------------------

def tally(frames) -> dict[tuple[str, str, str], tuple[int, int]]:
    return tally_by_port(frames, PORT_CLASS)


def converge(env: Env, cap: Capture, before: dict, timeout: float = 5.0):
    return converge_by_port(env.probe, cap, before, PORT_CLASS, timeout)


# ---- tests ---------------------------------------------------------------------------

def test_every_class_is_counted_exactly_per_direction_and_modality(env, capture):
    before = env.probe.totals()
    jitter_before = env.probe.jitter()
    drive_http1(env)
    drive_h2c(env)
    drive_grpc(env)
    drive_websocket(env)
    drive_tcp(env, 8084, chunks=3, size=40)
    drive_tcp(env, 8085, chunks=5, size=3000)
    drive_http_on_audio_port(env)
    drive_udp(env)

    got, expected = converge(env, capture, before)
    assert got == expected
    assert {k[1:] for k in got} == {c for p, c in PORT_CLASS.items() if p < 9001 and p > 8000}
    assert env.probe.uncounted() == {"fragment": 0, "nonlinear": 0}

    # Non-RTP audio/video flows feed the JSS with their payload packets.
    payload = Counter(PORT_CLASS[server_port(f)] for f in capture.frames if f.payload_len > 0)
    jitter = env.probe.jitter()
    for key in [("tcp", "video"), ("http1", "audio")]:
        media = jitter[key].media_packets - (jitter_before[key].media_packets if key in jitter_before else 0)
        assert media == payload[key], key
    assert ("http1", "image") not in jitter

    # One flow event per flow, with the class the flow ended up with.
    seen = {(e.flow.dport, events.Proto(e.proto_class).name) for e in env.flow_events()
            if e.flow.dport in PORT_CLASS and e.flow.dport != 5004}
    assert seen >= {(p, c[0]) for p, c in PORT_CLASS.items() if 8000 < p < 9001}
    per_port = Counter(e.flow.dport for e in env.flow_events())
    assert all(per_port[p] == 1 for p in (8080, 8081, 8082, 8083, 8084, 8085, 8086, 9000))


def request_seen(ev: events.HttpRequest) -> tuple:
    """(trace id, parent span id, trace flags, method, path hash) of a request
    with a valid traceparent."""
    assert ev.has_traceparent
    return (bytes(ev.hdr.trace_id).hex(), f"{ev.hdr.span_id:016x}", ev.trace_flags,
            Method(ev.method), ev.path_hash)


def test_traceparent_of_every_keep_alive_request(env):
    reqs = env.http_events(8080)
    assert len(reqs) == 2 + len(INVALID_TRACEPARENTS)
    first, second, *invalid = reqs

    assert request_seen(first) == (TRACE_ID, SPAN_ID, 1, Method.POST, path_hash("/v1/images/generate"))
    assert first.hdr.modality == events.Modality.image
    assert first.direction == events.Direction.ingress
    assert first.flow.addresses() == (CLIENT_IP, SERVER_IP)
    assert first.ifindex == env.srv.ifindex(SERVER_IF)

    assert request_seen(second) == (TRACE_ID2, SPAN_ID2, 0, Method.GET, path_hash("/v1/models"))
    assert second.flow.sport == first.flow.sport  # the same connection

    for name, ev in zip(INVALID_TRACEPARENTS, invalid):
        assert not ev.has_traceparent, name
        assert bytes(ev.hdr.trace_id) == bytes(16) and ev.hdr.span_id == 0, name
        assert ev.method == Method.PUT and ev.path_hash == path_hash("/v1/bad"), name

    (upgrade,) = env.http_events(8083)
    assert upgrade.method == Method.GET and not upgrade.has_traceparent
    (speech,) = env.http_events(8086)
    assert speech.hdr.modality == events.Modality.audio  # the port map wins


def rtp_packet(pt: int, seq: int, ts: int, ssrc: int, payload: bytes) -> bytes:
    return struct.pack("!BBHII", 0x80, pt, seq & 0xFFFF, ts & 0xFFFFFFFF, ssrc) + payload


def test_rtp_jitter_sensitivity_score(env, capture):
    """100 audio packets 20 ms apart, 10 of them 60 ms late (the schedule after
    each shifts with it): JSS = 10/100. Each timestamp carries the sender's
    actual send instant, so this process's own scheduling noise cancels out of
    D and only the simulated lateness remains."""
    before = env.probe.totals()
    jitter_before = env.probe.jitter()
    assert ("rtp", "audio") not in jitter_before
    delayed = {7, 15, 23, 31, 42, 50, 61, 70, 84, 93}
    receivers = {}
    sender = socket_in(env.cli.name, type=socket.SOCK_DGRAM)
    try:
        for port in (5004, 5005, 5006):
            receivers[port] = socket_in(env.srv.name, type=socket.SOCK_DGRAM)
            receivers[port].bind((SERVER_IP, port))
        # An RTCP sender report on the RTCP port.
        sender.sendto(struct.pack("!BBHI", 0x80, 200, 6, 0x5EED) + bytes(20), (SERVER_IP, 5005))
        t0 = time.monotonic()
        shift = 0.0
        for k in range(100):
            if k in delayed:
                shift += 0.060
            scheduled = t0 + 0.020 * k + shift
            while (now := time.monotonic()) < scheduled:
                time.sleep(min(scheduled - now, 0.005))
            sent = time.monotonic()
            ts = 160 * k + round((sent - scheduled) * 8000)
            sender.sendto(rtp_packet(0, k, ts, 0xA0D10, b"\xd5" * 160), (SERVER_IP, 5004))
            if k < 50:
                vts = round((time.monotonic() - t0) * 90000)
                sender.sendto(rtp_packet(96, k, vts, 0x71DE0, b"\x00" * 1000), (SERVER_IP, 5006))
    finally:
        sender.close()
        for r in receivers.values():
            r.close()

    got, expected = converge(env, capture, before)
    assert got == expected
    assert got[("ingress", "rtp", "audio")][0] == 100
    assert got[("ingress", "rtp", "video")][0] == 50
    assert got[("ingress", "rtp", "other")][0] == 1

    jitter = env.probe.jitter(window_s=3600)
    audio, video = jitter[("rtp", "audio")], jitter[("rtp", "video")]
    assert (audio.media_packets, audio.late_packets) == (100, 10)
    assert audio.jss == 0.10
    assert (video.media_packets, video.late_packets) == (50, 0)
    assert video.jss == 0.0

    # The capture's own timestamps give the same count (RFC 3550 D, |D| > 40 ms).
    frames = [f for f in capture.frames if f.dport == 5004]
    late = 0
    for prev, cur in zip(frames, frames[1:]):
        d_ns = (cur.ts_ns - prev.ts_ns) - (cur.rtp_ts - prev.rtp_ts) * 1_000_000_000 // 8000
        late += abs(d_ns) > 40_000_000
    assert late == 10

    flow = next(f for f in env.probe.flows() if f["dport"] == 5004 or f["sport"] == 5004)
    assert flow["protocol"] == "rtp" and flow["modality"] == "audio"
    assert flow["jitter_ms"]["ingress"] > 0


def test_a_veth_created_after_start_is_attached_within_2s(env):
    start = time.monotonic()
    env.srv.ip("link", "add", "tcn0", "type", "veth", "peer", "name", "tcn1")
    try:
        while True:
            shown = env.srv.tc("filter", "show", "dev", "tcn0", "ingress")
            elapsed = time.monotonic() - start
            if FILTER_NAME in shown or elapsed > 5:
                break
            time.sleep(0.05)
        assert FILTER_NAME in shown
        assert elapsed < 2.0
        assert FILTER_NAME in env.srv.tc("filter", "show", "dev", "tcn0", "egress")
        assert "tcn0/ingress" in env.probe.status.attachments
    finally:
        env.srv.ip("link", "del", "tcn0", check=False)
    deadline = time.monotonic() + 5
    while "tcn0/ingress" in env.probe.status.attachments and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "tcn0/ingress" not in env.probe.status.attachments


def test_ipv6_fragments_and_foreign_protocols(env):
    """Frames injected on the client end (no handshake needed): IPv6 UDP and an
    IPv6 HTTP request are classified and counted; IPv4 non-first fragments and
    IPv6 extension headers are counted as uncounted; ICMP is not a flow."""
    src, dst = env.cli.mac(CLIENT_IF), env.srv.mac(SERVER_IF)
    v6 = {"src": "fd00::1", "dst": "fd00::2"}
    v4 = {"src": CLIENT_IP, "dst": SERVER_IP}
    v6_udp = eth(dst, src, 0x86DD, ipv6(socket.IPPROTO_UDP, udp(41000, 9100, b"\x00v6 datagram"), **v6))
    request = http_request("POST", "/v6/embed?q=1", [("Content-Type", "application/json"),
                                                      ("traceparent", f"00-{TRACE_ID}-{SPAN_ID}-01")], b"{}")
    v6_http = eth(dst, src, 0x86DD, ipv6(socket.IPPROTO_TCP, tcp(41001, 8090, request), **v6))
    fragment = eth(dst, src, 0x0800, ipv4(socket.IPPROTO_UDP, b"\x00" * 64, frag_off=185, **v4))
    hop_by_hop = eth(dst, src, 0x86DD, ipv6(0, bytes([socket.IPPROTO_UDP, 0]) + b"\x00" * 6
                                             + udp(41002, 9100, b"x"), **v6))
    icmp = eth(dst, src, 0x0800, ipv4(socket.IPPROTO_ICMP, b"\x08\x00" + b"\x00" * 30, **v4))

    before, uncounted_before = env.probe.totals(), env.probe.uncounted()
    sender = socket_in(env.cli.name, socket.AF_PACKET, socket.SOCK_RAW)
    try:
        sender.bind((CLIENT_IF, 0))
        for frame in [v6_udp, v6_udp, v6_udp, v6_http, fragment, hop_by_hop, icmp]:
            sender.send(frame)
    finally:
        sender.close()
    expected = {("ingress", "udp", "other"): (3, 3 * len(v6_udp)),
                ("ingress", "http1", "text"): (1, len(v6_http))}
    deadline = time.monotonic() + 5
    while (got := delta(env.probe.totals(), before)) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    assert got == expected
    uncounted = env.probe.uncounted()
    assert uncounted["fragment"] - uncounted_before["fragment"] == 2
    assert uncounted["nonlinear"] == uncounted_before["nonlinear"]

    (ev,) = env.http_events(8090)
    assert ev.flow.family == 6
    assert ev.flow.addresses() == ("fd00::1", "fd00::2")
    assert request_seen(ev) == (TRACE_ID, SPAN_ID, 1, Method.POST, path_hash("/v6/embed"))
    assert ev.hdr.modality == events.Modality.text


# ---- attach / detach hygiene ------------------------------------------------------------

def bpftool_programs() -> dict[int, dict]:
    out = subprocess.run(["bpftool", "-j", "prog", "show"], check=True, capture_output=True,
                         text=True, timeout=30).stdout
    return {p["id"]: p for p in json.loads(out)}


def spanlet_filters(ns: Namespace, ifname: str) -> dict[str, list[int]]:
    """Handles of our filters per hook, from `tc -j filter show`."""
    out = {}
    for hook in ("ingress", "egress"):
        shown = json.loads(subprocess.run(["tc", "-n", ns.name, "-j", "filter", "show", "dev", ifname, hook],
                                          check=True, capture_output=True, text=True).stdout or "[]")
        out[hook] = [int(str(f["options"]["handle"]), 0) for f in shown
                     if f.get("options", {}).get("bpf_name") == FILTER_NAME]
    return out


@pytest.fixture
def lone_ns():
    """A namespace with a veth whose two ends are both inside it."""
    ns = Namespace("tctest-l")
    try:
        ns.ip("link", "add", "tcl0", "type", "veth", "peer", "name", "tcl1")
        ns.ip("link", "set", "tcl0", "up")
        ns.ip("link", "set", "tcl1", "up")
        yield ns
    finally:
        ns.close()


def idle_flows_phase(probe: TcProbe, ns: Namespace) -> None:
    """Flows idle for flow_idle_timeout_s leave the kernel maps on refresh();
    the totals keep their counts, and the same 5-tuple later starts afresh."""
    frame = eth(ns.mac("tcl0"), ns.mac("tcl1"), 0x0800,
                ipv4(socket.IPPROTO_UDP, udp(40100, 9999, b"\x00idle"), src="169.254.9.1", dst="169.254.9.2"))
    sender = socket_in(ns.name, socket.AF_PACKET, socket.SOCK_RAW)
    key = ("ingress", "udp", "other")

    def send_and_wait(n: int, total: int) -> None:
        for _ in range(n):
            sender.send(frame)
        deadline = time.monotonic() + 5
        while probe.totals().get(key, (0, 0))[0] < total and time.monotonic() < deadline:
            time.sleep(0.02)
        assert probe.totals()[key] == (total, total * len(frame))

    try:
        sender.bind(("tcl1", 0))
        send_and_wait(3, 3)
        assert [f["packets"]["ingress"] for f in probe.flows()] == [3]
        time.sleep(probe.cfg.tc.flow_idle_timeout_s + 0.1)
        probe.refresh()  # unchanged since the last read, longer than the timeout: deleted
        assert probe.flows() == []
        assert probe.totals()[key] == (3, 3 * len(frame))
        send_and_wait(2, 5)
        assert [f["packets"]["ingress"] for f in probe.flows()] == [2]
    finally:
        sender.close()


def test_missing_interface_idle_flows_and_stop_leaves_nothing(lone_ns):
    probe = TcProbe(make_cfg(interfaces=["tcl0", "nosuch0"], flow_idle_timeout_s=0.4),
                    netns=lone_ns.name)
    try:
        status = probe.start()
        assert status.attached, status.reason
        assert status.attachments == ["tcl0/ingress", "tcl0/egress"]
        assert status.failed_attachments == ["nosuch0: no such interface"]
        handle = probe.prog_ids["ingress"]
        assert spanlet_filters(lone_ns, "tcl0") == {"ingress": [handle], "egress": [handle]}
        assert spanlet_filters(lone_ns, "tcl1") == {"ingress": [], "egress": []}
        idle_flows_phase(probe, lone_ns)
        ours = set(probe.prog_ids.values())
        loaded = bpftool_programs()
        assert ours <= set(loaded)
        assert {loaded[i]["name"] for i in ours} == {"tc_classify_in", "tc_classify_eg", "tc_classify_req"}
        our_maps = {m for i in ours for m in loaded[i].get("map_ids", [])}
    finally:
        probe.stop()
    probe.stop()  # safe twice
    for hook in ("ingress", "egress"):
        assert lone_ns.tc("filter", "show", "dev", "tcl0", hook).strip() == ""
    assert "clsact" not in lone_ns.tc("qdisc", "show", "dev", "tcl0")  # we added it
    # No tc_classify program of this probe (by id, or by its maps) is left; other
    # agents' (a concurrent test run's) are not ours to judge. Programs are freed
    # once the last reference goes (RCU): allow a moment.
    deadline = time.monotonic() + 5
    while True:
        left = {i: p["name"] for i, p in bpftool_programs().items()
                if p.get("name", "").startswith("tc_classify")
                and (i in ours or our_maps & set(p.get("map_ids", [])))}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert left == {}


def test_all_configured_interfaces_missing_is_not_attached(lone_ns):
    probe = TcProbe(make_cfg(interfaces=["nosuch0", "nosuch1"]), netns=lone_ns.name)
    try:
        status = probe.start()
        assert not status.attached
        assert "nosuch0: no such interface; nosuch1: no such interface" in status.reason
        assert status.failed_attachments == ["nosuch0: no such interface", "nosuch1: no such interface"]
        assert probe.bpf is None  # refused before compiling anything
    finally:
        probe.stop()


CHILD = """
import sys, time
sys.path.insert(0, {repo!r})
from spanlet import config
from spanlet.probes.tc.probe import TcProbe
p = TcProbe(config.load(env={{}}, overrides=["tc.interfaces=[tcl0,tcl1]"]), netns={ns!r})
s = p.start()
print(p.prog_ids["ingress"] if s.attached else "failed: " + s.reason, flush=True)
time.sleep(120)
"""


def test_stale_filters_are_replaced_not_duplicated(lone_ns):
    cfg = make_cfg(interfaces=["tcl0"])
    # An agent killed with SIGKILL leaves its filters (and so its programs) behind.
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(repo=str(REPO), ns=lone_ns.name)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    probes: list[TcProbe] = []
    try:
        line = child.stdout.readline().strip()
        assert line.isdigit(), line
        dead_handle = int(line)
        os.kill(child.pid, 9)
        child.wait(timeout=10)
        for ifname in ("tcl0", "tcl1"):
            assert spanlet_filters(lone_ns, ifname) == {"ingress": [dead_handle], "egress": [dead_handle]}
        assert bpftool_programs()[dead_handle]["name"] == "tc_classify_in"

        first = TcProbe(cfg, netns=lone_ns.name)  # configured for tcl0 only
        probes.append(first)
        assert first.start().attached
        h1 = first.prog_ids["ingress"]
        assert spanlet_filters(lone_ns, "tcl0") == {"ingress": [h1], "egress": [h1]}
        # Swept from the interface it does not use, with the dead agent's clsact.
        assert spanlet_filters(lone_ns, "tcl1") == {"ingress": [], "egress": []}
        assert "clsact" not in lone_ns.tc("qdisc", "show", "dev", "tcl1")

        # A second live instance also replaces rather than adds.
        second = TcProbe(cfg, netns=lone_ns.name)
        probes.append(second)
        assert second.start().attached
        h2 = second.prog_ids["ingress"]
        assert spanlet_filters(lone_ns, "tcl0") == {"ingress": [h2], "egress": [h2]}

        first.stop()  # removes only its own (already replaced) filters
        assert spanlet_filters(lone_ns, "tcl0") == {"ingress": [h2], "egress": [h2]}
        assert "clsact" in lone_ns.tc("qdisc", "show", "dev", "tcl0")
        second.stop()
        assert spanlet_filters(lone_ns, "tcl0") == {"ingress": [], "egress": []}
        # The clsact held only spanlet filters, so the last instance took it over.
        assert "clsact" not in lone_ns.tc("qdisc", "show", "dev", "tcl0")
        deadline = time.monotonic() + 5
        while dead_handle in bpftool_programs() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dead_handle not in bpftool_programs()
    finally:
        if child.poll() is None:
            os.kill(child.pid, 9)
            child.wait(timeout=10)
        for p in probes:
            p.stop()


def test_foreign_filters_stay_and_still_see_every_packet(env, lone_ns):
    """Another tool's clsact and filters are left as they are, and filters that
    come after ours in the chain still run (we pass without ending the chain).
    The other tool here: the module's probe program, attached behind ours
    under another name; it counts into that probe's maps."""
    from pyroute2 import IPRoute

    lone_ns.tc("qdisc", "add", "dev", "tcl0", "clsact")
    lone_ns.tc("filter", "add", "dev", "tcl0", "ingress", "prio", "60000", "u32",
               "match", "u32", "0", "0", "classid", "1:1")
    probe = TcProbe(make_cfg(interfaces=["tcl0"]), netns=lone_ns.name)
    sender = socket_in(lone_ns.name, socket.AF_PACKET, socket.SOCK_RAW)
    try:
        assert probe.start().attached
        assert spanlet_filters(lone_ns, "tcl0")["ingress"] == [probe.prog_ids["ingress"]]
        from bcc import BPF
        observer_fd = env.probe.bpf.load_func("tc_classify_in", BPF.SCHED_CLS).fd  # already loaded
        with IPRoute(netns=lone_ns.name, flags=0) as ipr:
            ipr.tc("add-filter", "bpf", index=lone_ns.ifindex("tcl0"), handle=1, fd=observer_fd,
                   name="test_observer", parent=0xFFFFFFF2, prio=30000, direct_action=True)
        sender.bind(("tcl1", 0))
        frame = eth(lone_ns.mac("tcl0"), lone_ns.mac("tcl1"), 0x0800,
                    ipv4(socket.IPPROTO_UDP, udp(40000, 9999, b"\x00observer"),
                         src="169.254.9.1", dst="169.254.9.2"))
        for _ in range(5):
            sender.send(frame)
        deadline = time.monotonic() + 5
        while probe.totals().get(("ingress", "udp", "other"), (0, 0))[0] < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert probe.totals()[("ingress", "udp", "other")] == (5, 5 * len(frame))
        seen = [f["packets"]["ingress"] for f in env.probe.flows()
                if f["src"] == "169.254.9.1" and f["sport"] == 40000]
        assert seen == [5]
    finally:
        sender.close()
        probe.stop()
    shown = lone_ns.tc("filter", "show", "dev", "tcl0", "ingress")
    assert "u32" in shown and "test_observer" in shown and FILTER_NAME not in shown
    assert "clsact" in lone_ns.tc("qdisc", "show", "dev", "tcl0")
