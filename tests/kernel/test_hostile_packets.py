"""Hostile input through the real TC classifier: two namespaces of the test
joined by a veth, the probe on the server end. Broken, truncated, split and
oversized HTTP requests and fake traceparent values, RTP with absurd fields,
and IP/TCP headers that cannot be right: nothing is dropped or altered, every
rejection is counted under its reason, a traceparent is taken only when it is
exactly one valid header, and the flows keep their exact packet and byte
counts (checked against an AF_PACKET capture of the same interface)."""

from __future__ import annotations

import socket
import struct
import time

import pytest

from spanlet import config, events
from spanlet.probes.tc.attach import FILTER_NAME
from spanlet.probes.tc.probe import Method, Rejected, TcProbe, path_hash
from netns import Capture, eth, ipv4, ipv6, linked, socket_in, tcp, udp
from tc_harness import CLIENT_IP, SERVER_IP, Env, TcpPair, recv_exact

pytestmark = pytest.mark.kernel

CLIENT_IF, SERVER_IF = "hpc0", "hps0"
HTTP_PORT = 8080
SCAN_BYTES = 512            # tc.http_scan_bytes (the default)
LATE_NS = 40_000_000        # tau_plc + delta_buffer (defaults), as the kernel compares
NOWHERE = "169.254.77.9"    # on the link, owned by no one: injected frames die after TC
NO_REJECTIONS = {r.name: 0 for r in Rejected}


@pytest.fixture(scope="module")
def env():
    with linked("hostile", CLIENT_IF, CLIENT_IP, SERVER_IF, SERVER_IP) as (cli, srv):
        got: list = []
        cfg = config.load(env={}, overrides=[f'tc.interfaces=["{SERVER_IF}"]'])
        probe = TcProbe(cfg, sink=got.append, netns=srv.name)
        try:
            status = probe.start()
            assert status.attached, status.reason
            yield Env(cli, srv, probe, got)
            # Still attached and classifying: nothing above took it down.
            assert probe.status.attached
            for hook in ("ingress", "egress"):
                assert FILTER_NAME in srv.tc("filter", "show", "dev", SERVER_IF, hook)
        finally:
            probe.stop()


@pytest.fixture
def capture(env):
    cap = Capture(env.srv, SERVER_IF)
    try:
        yield cap
    finally:
        cap.close()


def rejected_delta(probe: TcProbe, before: dict) -> dict:
    now = probe.rejected()
    return {k: now[k] - before[k] for k in now if now[k] != before[k]}


# ---- HTTP ----------------------------------------------------------------------------

def ids(i: int) -> tuple[str, str]:
    """A valid (trace id, parent id) pair of its own for case i (with a-f in it)."""
    return f"{i:02x}f7651916cd43dd8448eb211c80319c", f"{i:02x}ad6b71692033b1"


def request(method: str, target: str, headers: list[tuple[str, str]] | list[bytes],
            eol: bytes = b"\r\n", body: bytes = b"") -> bytes:
    """A request as raw bytes; a header given as bytes is one raw line."""
    lines = [f"{method} {target} HTTP/1.1".encode(), b"Host: spanlet-test"]
    for h in headers:
        lines.append(h if isinstance(h, bytes) else f"{h[0]}: {h[1]}".encode())
    return eol.join(lines) + eol + eol + body


class Case:
    """One connection: the segments the client sends (each one TCP segment),
    the http events expected on it as (method, target, ids or None), and the
    rejections it adds."""

    def __init__(self, segments: list[bytes], expect: list[tuple], rejected: dict | None = None,
                 proto: str = "http1"):
        self.segments, self.expect, self.rejected, self.proto = segments, expect, rejected or {}, proto


def tp_case(i: int, value: str, accepted: bool, reason: str = "traceparent_invalid",
            flags: int = 1, name: str = "traceparent") -> Case:
    """A GET whose one traceparent header has `value`, followed by enough bytes
    that the value is never cut by the end of the packet."""
    trace, span = ids(i)
    raw = request("GET", f"/tp/{i}", [(name, value), ("X-After", "y" * 80)])
    if accepted:
        return Case([raw], [("GET", f"/tp/{i}", (trace, span, flags))])
    return Case([raw], [("GET", f"/tp/{i}", None)], {reason: 1})


def valid(i: int, flags: str = "01", version: str = "00") -> str:
    trace, span = ids(i)
    return f"{version}-{trace}-{span}-{flags}"


def http_cases() -> dict[str, Case]:
    c: dict[str, Case] = {}
    n = iter(range(1, 200))

    i = next(n)
    c["control: one valid traceparent"] = Case(
        [request("GET", "/ok", [("traceparent", valid(i))])], [("GET", "/ok", (*ids(i), 1))])

    # -- broken, truncated, split, oversized requests
    i = next(n)
    c["traceparent after a header line longer than the scan window"] = Case(
        [request("GET", "/long", [("X-Long", "a" * 600), ("traceparent", valid(i))])],
        [("GET", "/long", None)])
    i = next(n)
    head = b"GET /cut HTTP/1.1\r\nHost: spanlet-test\r\nX-Pad: "
    tail = b"\r\ntraceparent: "
    pad = b"p" * (SCAN_BYTES - 32 - len(head) - len(tail))   # the value starts 32 bytes before the end
    c["traceparent value cut by the end of the scan window"] = Case(
        [head + pad + tail + valid(i).encode() + b"\r\n\r\n"], [("GET", "/cut", None)],
        {"traceparent_truncated": 1})
    i = next(n)
    c["traceparent name split across two packets"] = Case(
        [b"GET /split1 HTTP/1.1\r\nHost: spanlet-test\r\ntracepa",
         b"rent: " + valid(i).encode() + b"\r\n\r\n"], [("GET", "/split1", None)])
    i = next(n)
    v = valid(i).encode()
    c["traceparent value split across two packets"] = Case(
        [b"GET /split2 HTTP/1.1\r\nHost: spanlet-test\r\ntraceparent: " + v[:20], v[20:] + b"\r\n\r\n"],
        [("GET", "/split2", None)], {"traceparent_truncated": 1})
    i = next(n)
    c["traceparent alone in the second packet of the headers"] = Case(
        [b"GET /split3 HTTP/1.1\r\nHost: spanlet-test\r\n",
         b"traceparent: " + valid(i).encode() + b"\r\n\r\n"], [("GET", "/split3", None)])
    i = next(n)
    c["no line end after the value: the packet ends there"] = Case(
        [b"GET /noeol HTTP/1.1\r\nHost: spanlet-test\r\ntraceparent: " + valid(i).encode(), b"\r\n\r\n"],
        [("GET", "/noeol", None)], {"traceparent_truncated": 1})
    i = next(n)
    c["NUL bytes in another header"] = Case(
        [request("GET", "/nul1", [b"X-Bin: a\x00b\x00\x00c", ("traceparent", valid(i))])],
        [("GET", "/nul1", (*ids(i), 1))])
    i = next(n)
    v = valid(i)
    c["NUL byte inside the traceparent value"] = Case(
        [request("GET", "/nul2", [b"traceparent: " + v[:20].encode() + b"\x00" + v[21:].encode(),
                                  ("X-After", "y" * 80)])],
        [("GET", "/nul2", None)], {"traceparent_invalid": 1})
    i = next(n)
    c["NUL byte inside the header name"] = Case(
        [request("GET", "/nul3", [b"trace\x00parent: " + valid(i).encode()])], [("GET", "/nul3", None)])
    i = next(n)
    c["bare LF line endings"] = Case(
        [request("GET", "/lf", [("traceparent", valid(i))], eol=b"\n")], [("GET", "/lf", (*ids(i), 1))])
    i = next(n)
    body = b"traceparent: " + valid(i).encode() + b"\n"
    c["bare LF: a traceparent line in the body only"] = Case(
        [request("POST", "/lfbody", [("Content-Length", str(len(body)))], eol=b"\n", body=body)],
        [("POST", "/lfbody", None)])
    i = next(n)
    body = b"traceparent: " + valid(i).encode() + b"\r\n"
    c["CRLF: a traceparent line in the body only"] = Case(
        [request("POST", "/body", [("Content-Length", str(len(body)))], body=body)],
        [("POST", "/body", None)])
    i = next(n)
    c["CR-only line endings"] = Case(
        [request("GET", "/cr", [("traceparent", valid(i))], eol=b"\r")], [("GET", "/cr", None)])
    i = next(n)
    c["70 kB header block in one send"] = Case(
        [request("GET", "/big", [("X-Big", "b" * 70_000), ("traceparent", valid(i))])],
        [("GET", "/big", None)])
    i = next(n)
    c["65 header lines before the traceparent (64 are looked at)"] = Case(
        [request("GET", "/lines", [("A", "b")] * 65 + [("traceparent", valid(i))])],
        [("GET", "/lines", None)])
    c["not a method: GETX"] = Case([b"GETX /x HTTP/1.1\r\nHost: spanlet-test\r\n\r\n"], [], proto="tcp")
    c["binary junk after GET"] = Case([b"GET " + bytes(range(256))], [("GET", bytes(range(10)), None)])

    # -- fake or malformed traceparent values (each the one header of its request)
    for name, make in {
        "trace id of 31 hex digits": lambda t, s: f"00-{t[:31]}-{s}-01",
        "trace id of 33 hex digits": lambda t, s: f"00-{t}0-{s}-01",
        "parent id of 15 hex digits": lambda t, s: f"00-{t}-{s[:15]}-01",
        "parent id of 17 hex digits": lambda t, s: f"00-{t}-{s}0-01",
        "non-hex in the trace id": lambda t, s: f"00-{t[:5]}g{t[6:]}-{s}-01",
        "non-hex in the parent id": lambda t, s: f"00-{t}-{s[:3]}z{s[4:]}-01",
        "non-hex flags": lambda t, s: f"00-{t}-{s}-0x",
        "uppercase flags": lambda t, s: f"00-{t}-{s}-0A",
        "version ff": lambda t, s: f"ff-{t}-{s}-01",
        "non-hex version": lambda t, s: f"0g-{t}-{s}-01",
        "uppercase trace id": lambda t, s: f"00-{t.upper()}-{s}-01",
        "uppercase parent id": lambda t, s: f"00-{t}-{s.upper()}-01",
        "all-zero trace id": lambda t, s: f"00-{'0' * 32}-{s}-01",
        "all-zero parent id": lambda t, s: f"00-{t}-{'0' * 16}-01",
        "version 00 with an extra field": lambda t, s: f"00-{t}-{s}-01-extra",
        "garbage right after the flags": lambda t, s: f"00-{t}-{s}-01x",
        "whitespace, then garbage after the value": lambda t, s: f"00-{t}-{s}-01 x",
        "underscores for dashes": lambda t, s: f"00_{t}_{s}_01",
        "the trace id only": lambda t, s: f"00-{t}",
        "empty value": lambda t, s: "",
        "five spaces before the value": lambda t, s: f"     00-{t}-{s}-01",
    }.items():
        i = next(n)
        c[f"invalid: {name}"] = tp_case(i, make(*ids(i)), accepted=False)

    # -- valid forms that must be taken, ids exactly as written
    i = next(n)
    c["valid: version 01 with extra fields"] = tp_case(i, valid(i, version="01") + "-what-ever", True)
    i = next(n)
    c["valid: version cc, 55 characters"] = tp_case(i, valid(i, version="cc"), True)
    i = next(n)
    c["valid: whitespace after the value"] = tp_case(i, valid(i) + " \t ", True)
    i = next(n)
    c["valid: flags ff"] = tp_case(i, valid(i, flags="ff"), True, flags=0xFF)
    i = next(n)
    c["valid: mixed-case header name"] = tp_case(i, valid(i), True, name="TrAcEpArEnT")
    i = next(n)
    trace, span = ids(i)
    c["valid: tab before the value"] = Case(
        [request("GET", "/tab", [b"traceparent:\t" + valid(i).encode()])], [("GET", "/tab", (trace, span, 1))])

    # -- several traceparent headers: ambiguous, so none is taken
    for name, pair in {
        "two valid, different": (lambda a, b: (valid(a), valid(b))),
        "the same value twice": (lambda a, b: (valid(a), valid(a))),
        "valid, then invalid": (lambda a, b: (valid(a), valid(b).upper())),
        "invalid, then valid": (lambda a, b: (valid(a, version="ff"), valid(b))),
    }.items():
        a, b = next(n), next(n)
        first, second = pair(a, b)
        c[f"duplicate: {name}"] = Case(
            [request("GET", f"/dup/{a}", [("traceparent", first), ("X-Mid", "m"), ("Traceparent", second)])],
            [("GET", f"/dup/{a}", None)], {"traceparent_duplicate": 1})

    # -- keep-alive: the request after a bad one is read as usual
    a, b = next(n), next(n)
    c["invalid request, then a valid one on the same connection"] = Case(
        [request("PUT", "/bad", [("traceparent", valid(a, version="ff")), ("X-After", "y" * 80)]),
         request("GET", "/good", [("traceparent", valid(b))])],
        [("PUT", "/bad", None), ("GET", "/good", (*ids(b), 1))], {"traceparent_invalid": 1})
    i = next(n)
    c["control after all of the above"] = Case(
        [request("POST", "/after", [("Content-Type", "image/png"), ("traceparent", valid(i, flags="00"))],
                 body=b"\x89PNG" + bytes(300))], [("POST", "/after", (*ids(i), 0))])
    return c


HTTP_CASES = http_cases()
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def run_case(env: Env, case: Case) -> int:
    """Drive one connection; returns its client port. Every byte arrives as sent."""
    pair = TcpPair(env, HTTP_PORT)
    try:
        pair.client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        port = pair.client.getsockname()[1]
        for seg in case.segments:
            pair.client.sendall(seg)
            assert recv_exact(pair.server, len(seg)) == seg
        pair.server.sendall(OK)
        assert recv_exact(pair.client, len(OK)) == OK
        pair.close()
    except BaseException:
        pair.client.close()
        pair.server.close()
        raise
    return port


def seen(ev: events.HttpRequest) -> tuple:
    tp = None
    if ev.has_traceparent:
        tp = (bytes(ev.hdr.trace_id).hex(), f"{ev.hdr.span_id:016x}", ev.trace_flags)
    else:
        assert bytes(ev.hdr.trace_id) == bytes(16) and ev.hdr.span_id == 0 and ev.trace_flags == 0
    return Method(ev.method).name, ev.path_hash, tp


def per_flow_capture(frames, port_of) -> dict:
    """{flow: {direction: (packets, bytes)}} from captured frames."""
    out: dict = {}
    for f in frames:
        key = port_of(f)
        if key is None:
            continue
        d = out.setdefault(key, {"ingress": [0, 0], "egress": [0, 0]})[f.direction]
        d[0] += 1
        d[1] += f.length
    return {k: {d: tuple(v) for d, v in dirs.items()} for k, dirs in out.items()}


def per_flow_probe(probe: TcProbe, port_of) -> dict:
    out = {}
    for f in probe.flows():
        key = port_of(f)
        if key is not None:
            out[key] = {d: (f["packets"][d], f["bytes"][d]) for d in ("ingress", "egress")}
    return out


def converge_flows(env: Env, cap: Capture, cap_key, probe_key, timeout: float = 5.0):
    """The last ACKs travel after the test's own exchange ends: read until the
    probe's per-flow counts and the capture's agree, or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        cap.drain()
        expected = per_flow_capture(cap.frames, cap_key)
        got = per_flow_probe(env.probe, probe_key)
        if got == expected or time.monotonic() > deadline:
            return got, expected
        time.sleep(0.02)


def test_hostile_http_requests(env, capture):
    ports: dict[str, int] = {}
    for name, case in HTTP_CASES.items():
        before = env.probe.rejected()
        ports[name] = run_case(env, case)
        # TC ran on every segment before the server could read it.
        assert rejected_delta(env.probe, before) == case.rejected, name

    env.probe.drain()
    reqs = [e for e in env.events if isinstance(e, events.HttpRequest) and e.flow.dport == HTTP_PORT]
    by_port: dict[int, list] = {}
    for e in reqs:
        assert e.direction == events.Direction.ingress
        assert e.flow.addresses() == (CLIENT_IP, SERVER_IP)
        by_port.setdefault(e.flow.sport, []).append(seen(e))
    for name, case in HTTP_CASES.items():
        want = [(m, path_hash(t), tp) for m, t, tp in case.expect]
        assert by_port.get(ports[name], []) == want, name

    # Attribution: no event carries ids that are not exactly those of one
    # valid header that the test sent alone in its request.
    accepted = {tp for case in HTTP_CASES.values() for *_, tp in case.expect if tp}
    taken = {tp for evs in by_port.values() for *_, tp in evs if tp}
    assert taken == accepted
    assert len(accepted) == 11

    # Every flow was classified, and counted exactly, packet by packet.
    classes = {f["sport"]: f["protocol"] for f in env.probe.flows() if f["dport"] == HTTP_PORT}
    for name, case in HTTP_CASES.items():
        assert classes[ports[name]] == case.proto, name
    mine = set(ports.values())
    got, expected = converge_flows(
        env, capture,
        cap_key=lambda f: (f.sport if not f.egress else f.dport) if HTTP_PORT in (f.sport, f.dport)
        and (f.dport if f.egress else f.sport) in mine else None,
        probe_key=lambda f: f["sport"] if f["dport"] == HTTP_PORT and f["sport"] in mine else None)
    assert got == expected
    assert set(got) == mine
    assert env.probe.uncounted() == {"fragment": 0, "nonlinear": 0}


# ---- RTP -----------------------------------------------------------------------------

AUDIO_PT, CLOCK = 0, 8000  # PCMU in the default payload type map


def rtp(pt: int, seq: int, ts: int, payload: bytes = b"\xd5" * 40, *, version: int = 2,
        cc: int = 0, x: bool = False, p: bool = False, marker: bool = False) -> bytes:
    b0 = (version << 6) | (0x20 if p else 0) | (0x10 if x else 0) | cc
    b1 = (0x80 if marker else 0) | pt
    return struct.pack("!BBHII", b0, b1, seq & 0xFFFF, ts & 0xFFFFFFFF, 0x5EED) + payload


class RtpFlow:
    """Datagrams from one client port to one server port, each received by the
    server socket exactly as sent, with what the classifier should make of it:
    "media", "invalid", "unknown_pt" or None (neither: RTCP, empty, non-RTP flow)."""

    def __init__(self, env: Env, port: int):
        self.port = port
        self.media_late_before = media_late(env.probe)   # the flows are sent one after another
        self.rx = socket_in(env.srv.name, type=socket.SOCK_DGRAM)
        self.tx = socket_in(env.cli.name, type=socket.SOCK_DGRAM)
        self.rx.bind((SERVER_IP, port))
        self.rx.settimeout(10)
        self.sent: list[tuple[bytes, str | None]] = []
        self.t0 = time.monotonic()

    def now_ts(self, base: int = 0) -> int:
        return base + round((time.monotonic() - self.t0) * CLOCK)

    def send(self, data: bytes, verdict: str | None) -> None:
        self.tx.sendto(data, (SERVER_IP, self.port))
        assert self.rx.recv(65536) == data
        self.sent.append((data, verdict))

    def media(self, seq: int, base: int = 0, payload: bytes = b"\xd5" * 40, **kw) -> None:
        """A valid packet stamped with the instant it is sent (so that D, the
        RFC 3550 transit difference, is only what the path adds)."""
        self.send(rtp(AUDIO_PT, seq, self.now_ts(base), payload, **kw), "media")

    def close(self) -> None:
        self.rx.close()
        self.tx.close()

    @property
    def client_port(self) -> int:
        return self.tx.getsockname()[1]

    def count(self, verdict: str) -> int:
        return sum(v == verdict for _, v in self.sent)


def expected_late(frames, sent) -> tuple[int, list[int]]:
    """Late media packets (|D| > LATE_NS) computed as the kernel does, from the
    capture's receive timestamps; also |D| of each media packet after the first."""
    media = [f for f, (_, v) in zip(frames, sent) if v == "media"]
    late, ds = 0, []
    for prev, cur in zip(media, media[1:]):
        dts = (cur.rtp_ts - prev.rtp_ts) & 0xFFFFFFFF
        dts = dts - (1 << 32) if dts >= 1 << 31 else dts
        ts_ns = abs(dts) * 1_000_000_000 // CLOCK
        arr = cur.ts_ns - prev.ts_ns
        d = arr + ts_ns if dts < 0 else abs(arr - ts_ns)
        ds.append(d)
        late += d > LATE_NS
    return late, ds


def media_late(probe: TcProbe) -> tuple[int, int]:
    """(media, late) packets so far, all classes, straight from the kernel's
    class counters (what the Jitter Sensitivity Score is made of)."""
    rows = probe._class_rows("spanlet_jitter_sensitivity_score")
    return sum(v[0] for _, v in rows), sum(v[1] for _, v in rows)


def jitter_of(probe: TcProbe, flows: list[RtpFlow]) -> dict[int, tuple[int, int]]:
    """{server port: (media, late)} of flows sent one after another: what the
    kernel counted from each one's start to the next one's."""
    marks = [f.media_late_before for f in flows] + [media_late(probe)]
    return {f.port: (m1 - m0, l1 - l0) for f, (m0, l0), (m1, l1) in zip(flows, marks, marks[1:])}


def test_hostile_rtp(env, capture):
    before = env.probe.rejected()
    flows: dict[str, RtpFlow] = {}
    try:
        # A: an audio flow with every kind of broken packet among valid ones.
        a = flows["absurd fields"] = RtpFlow(env, 5104)
        a.media(0)
        a.media(1)
        ts = a.now_ts()
        a.send(rtp(AUDIO_PT, 2, ts, version=1), "invalid")
        a.send(rtp(AUDIO_PT, 3, ts, version=0), "invalid")
        a.send(rtp(AUDIO_PT, 4, ts, version=3), "invalid")
        a.media(5)
        a.send(rtp(AUDIO_PT, 6, ts, b"", cc=15), "invalid")                        # 60 CSRC bytes missing
        a.send(rtp(AUDIO_PT, 7, ts, b"\xbe\xde\x03\xe8" + bytes(8), x=True), "invalid")  # 1000 words
        a.send(rtp(AUDIO_PT, 8, ts, b"", x=True), "invalid")                       # no room for it
        a.send(rtp(AUDIO_PT, 9, ts, bytes(27) + b"\xc8", p=True), "invalid")       # 200 > 28
        a.send(rtp(AUDIO_PT, 10, ts, bytes(27) + b"\x00", p=True), "invalid")      # count 0
        a.send(rtp(99, 11, ts), "unknown_pt")
        a.send(rtp(127, 12, ts), "unknown_pt")
        a.send(rtp(AUDIO_PT, 13, ts)[:11], "invalid")
        a.send(b"\x80", "invalid")
        a.send(b"", None)                                                         # never parsed
        a.send(struct.pack("!BBHI", 0x80, 201, 1, 0x5EED), None)                 # RTCP RR (rtcp-mux)
        a.media(14, payload=b"")                                                  # header only: 12 bytes
        a.media(15, payload=struct.pack("!II", 1, 2) + b"\xd5" * 20, cc=2)
        a.media(16, payload=b"\xbe\xde\x00\x01" + b"\x10\xaa\x00\x00" + b"\xd5" * 20, x=True)
        a.media(17, payload=b"\xd5" * 20 + b"\x00\x00\x00\x04", p=True)
        a.media(18, payload=bytes(27) + b"\x1c", p=True)                          # padding only
        a.media(19)

        # B: the first datagram looks like RTP of a known type but is broken:
        # the flow is RTP (audio), that datagram is no media sample.
        b = flows["broken first datagram"] = RtpFlow(env, 5106)
        b.send(rtp(AUDIO_PT, 0, b.now_ts(), b"", cc=15), "invalid")
        for k in range(1, 4):
            b.media(k)

        # C, D: a first datagram that is not RTP (version 1; an unconfigured
        # payload type) makes a plain UDP flow; RTP after it is not media
        # (the class of a flow is decided on its first datagram).
        c = flows["version 1 first"] = RtpFlow(env, 5108)
        c.send(rtp(AUDIO_PT, 0, 0, version=1), None)
        d = flows["unconfigured payload type first"] = RtpFlow(env, 5110)
        d.send(rtp(35, 0, 0), None)
        for f in (c, d):
            for k in range(1, 4):
                f.send(rtp(AUDIO_PT, k, f.now_ts()), None)

        # E: the timestamp jumps by 2^31 ticks (about three days at 8 kHz) and
        # stays there: one late packet, the one that jumped.
        e = flows["timestamp jump"] = RtpFlow(env, 5112)
        for k in range(5):
            e.media(k)
        for k in range(5, 10):
            e.media(k, base=1 << 31)

        # F: the timestamp wraps past 2^32 halfway: nothing is late for it.
        f = flows["timestamp wrap"] = RtpFlow(env, 5114)
        for k in range(10):
            f.media(k, base=(1 << 32) - 200)   # 25 ms before the wrap
            time.sleep(0.005)
        assert f.sent[0][0][4:8] > f.sent[-1][0][4:8]   # it did wrap
    finally:
        for flow in flows.values():
            flow.close()

    assert rejected_delta(env.probe, before) == {
        "rtp_invalid": sum(fl.count("invalid") for fl in flows.values()),
        "rtp_unknown_payload_type": 2}
    assert (a.count("invalid"), b.count("invalid")) == (10, 1)

    # Per flow: class, modality, media packets, and late ones as the capture's
    # own timestamps say.
    kinds = {fl["dport"]: (fl["protocol"], fl["modality"]) for fl in env.probe.flows()
             if fl["src"] == CLIENT_IP}
    jitter = jitter_of(env.probe, list(flows.values()))
    capture.drain()
    for name, flow in flows.items():
        frames = [fr for fr in capture.frames if fr.dport == flow.port and not fr.egress]
        assert [fr.payload_len for fr in frames] == [len(d) for d, _ in flow.sent], name
        rtp_flow = flow.port in (5104, 5106, 5112, 5114)
        assert kinds[flow.port] == (("rtp", "audio") if rtp_flow else ("udp", "other")), name
        late, _ = expected_late(frames, flow.sent)
        assert jitter.get(flow.port, (0, 0)) == (flow.count("media"), late), name
    assert a.count("media") == 9
    # The jump is late however the machine was scheduled; the wrap is not
    # mistaken for a jump of 2^32 ticks.
    e_frames = [fr for fr in capture.frames if fr.dport == 5112 and not fr.egress]
    assert expected_late(e_frames, e.sent)[1][4] > 10**12
    f_frames = [fr for fr in capture.frames if fr.dport == 5114 and not fr.egress]
    assert max(expected_late(f_frames, f.sent)[1]) < 10**9

    # Exact packets and bytes for every one of these flows.
    ports = {fl.port for fl in flows.values()}
    got, expected = converge_flows(
        env, capture,
        cap_key=lambda fr: fr.dport if not fr.egress and fr.dport in ports else None,
        probe_key=lambda fl: fl["dport"] if fl["src"] == CLIENT_IP and fl["dport"] in ports else None)
    assert got == expected and set(got) == ports


# ---- IP and TCP headers that cannot be right ------------------------------------------

def test_impossible_headers_are_rejected_and_valid_frames_still_counted(env):
    """Frames injected on the client end towards an address nobody owns (they
    pass TC, then the stack drops them without an answer)."""
    src, dst = env.cli.mac(CLIENT_IF), env.srv.mac(SERVER_IF)
    v4 = {"src": CLIENT_IP, "dst": NOWHERE}

    def frame(ip_bytes: bytes, ethertype: int = 0x0800) -> bytes:
        return eth(dst, src, ethertype, ip_bytes)

    good_tcp = ipv4(socket.IPPROTO_TCP, tcp(41000, 9200, b"\x00junk"), **v4)
    doff0 = bytearray(ipv4(socket.IPPROTO_TCP, tcp(41001, 9200, b"x" * 40), **v4))
    doff0[20 + 12] = 0x00                                   # data offset 0
    doff15 = bytearray(ipv4(socket.IPPROTO_TCP, tcp(41002, 9200, b"x" * 8), **v4))
    doff15[20 + 12] = 0xF0                                  # 60 bytes of TCP header claimed, 28 there
    ihl4 = bytearray(good_tcp)
    ihl4[0] = 0x44
    ihl15 = bytearray(ipv4(socket.IPPROTO_UDP, udp(41003, 9201, b""), **v4))
    ihl15[0] = 0x4F                                         # 60-byte IP header claimed, 28 bytes in all
    long_tot = bytearray(ipv4(socket.IPPROTO_UDP, udp(41004, 9202, b"\x00long"), **v4))
    long_tot[2:4] = struct.pack("!H", 1500)                 # claims more than the frame holds
    short_tot = bytearray(ipv4(socket.IPPROTO_UDP, udp(41005, 9203, b"\x00short"), **v4))
    short_tot[2:4] = struct.pack("!H", 20)                  # claims no room even for UDP
    bad_udp_len = bytearray(ipv4(socket.IPPROTO_UDP, udp(41006, 9204, b"\x00len"), **v4))
    bad_udp_len[20 + 4:20 + 6] = b"\xff\xff"
    bad = {  # frame → reason it is rejected (not counted in any flow)
        "IPv4 header length 4 words": frame(bytes(ihl4)),
        "IPv4 header length 15 words in 28 bytes": frame(bytes(ihl15)),
        "IPv4 header cut at 12 bytes": frame(good_tcp[:12]),
        "TCP header cut at 10 bytes": frame(good_tcp[:30]),
        "IPv6 header cut at 30 bytes": frame(ipv6(socket.IPPROTO_UDP, udp(1, 2, b"x"), "fd00::1",
                                                   "fd00::2")[:30], 0x86DD),
    }
    counted_bad = {  # counted in their flow, payload not looked at, rejected
        41001: frame(bytes(doff0)), 41002: frame(bytes(doff15)), 41005: frame(bytes(short_tot))}
    odd_but_counted = {  # not rejected: an IP length past the frame is clamped to it; the
        41004: frame(bytes(long_tot)), 41006: frame(bytes(bad_udp_len))}  # UDP length is not read
    valid_after = {41000: frame(good_tcp), 41007: frame(ipv4(socket.IPPROTO_UDP,
                                                              udp(41007, 9205, b"\x00ok"), **v4))}

    before, uncounted_before = env.probe.rejected(), env.probe.uncounted()
    sender = socket_in(env.cli.name, socket.AF_PACKET, socket.SOCK_RAW)
    try:
        sender.bind((CLIENT_IF, 0))
        for fr in [*bad.values(), *counted_bad.values(), *odd_but_counted.values()]:
            sender.send(fr)
        for _ in range(3):
            for fr in valid_after.values():
                sender.send(fr)
    finally:
        sender.close()

    counts = {41001: 1, 41002: 1, 41004: 1, 41005: 1, 41006: 1, 41000: 3, 41007: 3}
    frames = {**counted_bad, **odd_but_counted, **valid_after}
    expected = {p: {"ingress": (n, n * len(frames[p])), "egress": (0, 0)} for p, n in counts.items()}
    deadline = time.monotonic() + 5
    while True:
        got = {f["sport"]: {d: (f["packets"][d], f["bytes"][d]) for d in ("ingress", "egress")}
               for f in env.probe.flows() if f["dst"] == NOWHERE}
        if got == expected or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert got == expected
    assert rejected_delta(env.probe, before) == {"header_invalid": len(bad) + len(counted_bad)}
    assert env.probe.uncounted() == uncounted_before
    classes = {f["sport"]: f["protocol"] for f in env.probe.flows() if f["dst"] == NOWHERE}
    # No payload seen on the bad TCP flows: still waiting for their class.
    assert classes == {41001: "pending", 41002: "pending", 41004: "udp", 41005: "pending",
                       41006: "udp", 41000: "tcp", 41007: "udp"}
