"""Network namespaces and veth pairs for kernel tests and benchmarks: made with
random names, quiet (no IPv6, static neighbours, so no ND/ARP noise), sockets
opened inside them from this process, and removed again whatever happens."""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import struct
import subprocess

from spanlet.demo.net import inside, run, socket_in

__all__ = ["inside", "run", "socket_in", "Namespace", "veth_pair", "linked", "Capture",
           "http_request_bytes"]


class Namespace:
    """A network namespace named <prefix>-<random>, deleted by close()."""

    def __init__(self, prefix: str):
        self.name = f"{prefix}-{secrets.token_hex(4)}"
        run("ip", "netns", "add", self.name)
        try:
            # Before any interface exists: new ones inherit "default".
            for key in ("net.ipv6.conf.all.disable_ipv6", "net.ipv6.conf.default.disable_ipv6"):
                self.sysctl(key, "1")
            run("ip", "-n", self.name, "link", "set", "lo", "up")
        except Exception:
            self.close()
            raise

    def sysctl(self, key: str, value: str) -> None:
        run("ip", "netns", "exec", self.name, "sysctl", "-q", "-w", f"{key}={value}")

    def ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return run("ip", "-n", self.name, *args, check=check)

    def tc(self, *args: str) -> str:
        return run("tc", "-n", self.name, *args).stdout

    def ifindex(self, ifname: str) -> int:
        with inside(self.name):
            return socket.if_nametoindex(ifname)

    def mac(self, ifname: str) -> str:
        return json.loads(self.ip("-j", "link", "show", "dev", ifname).stdout)[0]["address"]

    def close(self) -> None:
        run("ip", "netns", "del", self.name, check=False)


def veth_pair(a: Namespace, a_if: str, a_ip: str, b: Namespace, b_if: str, b_ip: str,
              prefix_len: int = 24) -> None:
    """A veth between two namespaces with addresses, up, and permanent neighbour
    entries both ways (no ARP)."""
    a.ip("link", "add", a_if, "type", "veth", "peer", "name", b_if, "netns", b.name)
    a.ip("addr", "add", f"{a_ip}/{prefix_len}", "dev", a_if)
    b.ip("addr", "add", f"{b_ip}/{prefix_len}", "dev", b_if)
    a.ip("link", "set", a_if, "up")
    b.ip("link", "set", b_if, "up")
    a.ip("neigh", "replace", b_ip, "lladdr", b.mac(b_if), "dev", a_if, "nud", "permanent")
    b.ip("neigh", "replace", a_ip, "lladdr", a.mac(a_if), "dev", b_if, "nud", "permanent")


# ---- frames to inject (AF_PACKET) or to run through a program (BPF_PROG_TEST_RUN) ----

def eth(dst_mac: str, src_mac: str, ethertype: int, body: bytes) -> bytes:
    return (bytes.fromhex(dst_mac.replace(":", "")) + bytes.fromhex(src_mac.replace(":", ""))
            + struct.pack("!H", ethertype) + body)


def ipv4(proto: int, l4: bytes, src: str, dst: str, frag_off: int = 0) -> bytes:
    return struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 0, frag_off, 64, proto, 0,
                       socket.inet_aton(src), socket.inet_aton(dst)) + l4


def ipv6(nexthdr: int, l4: bytes, src: str, dst: str) -> bytes:
    return (struct.pack("!IHBB", 6 << 28, len(l4), nexthdr, 64)
            + socket.inet_pton(socket.AF_INET6, src) + socket.inet_pton(socket.AF_INET6, dst) + l4)


def udp(sport: int, dport: int, payload: bytes) -> bytes:
    return struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload


def tcp(sport: int, dport: int, payload: bytes, flags: int = 0x18) -> bytes:
    """A segment without options; PSH|ACK by default (0x10: a bare ACK)."""
    return struct.pack("!HHIIBBHHH", sport, dport, 1, 1, 5 << 4, flags, 65535, 0, 0) + payload


# ---- an independent count: AF_PACKET capture -------------------------------------

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SO_TIMESTAMPNS = 35


class Frame:
    __slots__ = ("egress", "length", "ts_ns", "l4proto", "src", "dst", "sport", "dport",
                 "payload_len", "payload")

    def __init__(self, egress, length, ts_ns, l4proto, src, dst, sport, dport, payload_len, payload):
        self.egress, self.length, self.ts_ns = egress, length, ts_ns
        self.l4proto, self.src, self.dst = l4proto, src, dst
        self.sport, self.dport, self.payload_len = sport, dport, payload_len
        self.payload = payload  # the first bytes captured

    @property
    def rtp_ts(self) -> int:
        return struct.unpack_from("!I", self.payload, 4)[0]

    @property
    def direction(self) -> str:
        return "egress" if self.egress else "ingress"


def parse_frame(buf: bytes, length: int, egress: bool, ts_ns: int) -> Frame | None:
    """IPv4 TCP/UDP frames only (what the classifier counts in these tests)."""
    if len(buf) < 14 + 20 or buf[12:14] != b"\x08\x00":
        return None
    ihl = (buf[14] & 0x0F) * 4
    tot_len = struct.unpack_from("!H", buf, 16)[0]
    proto = buf[23]
    if proto not in (socket.IPPROTO_TCP, socket.IPPROTO_UDP):
        return None
    l4 = 14 + ihl
    sport, dport = struct.unpack_from("!HH", buf, l4)
    l4_hdr = ((buf[l4 + 12] >> 4) * 4) if proto == socket.IPPROTO_TCP else 8
    return Frame(egress, length, ts_ns, proto, socket.inet_ntoa(buf[26:30]),
                 socket.inet_ntoa(buf[30:34]), sport, dport, tot_len - ihl - l4_hdr,
                 buf[l4 + l4_hdr:])


class Capture:
    """Every frame through one interface, both directions, with its full length
    (MSG_TRUNC) and kernel receive timestamp."""

    def __init__(self, ns: Namespace, ifname: str):
        self.sock = socket_in(ns.name, socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
            self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            self.sock.bind((ifname, ETH_P_ALL))
            self.sock.setblocking(False)
        except Exception:
            self.sock.close()
            raise
        self.frames: list[Frame] = []
        self._buf = bytearray(128)

    def drain(self) -> int:
        """Read what is queued; returns how many frames were new."""
        n = 0
        while True:
            try:
                nbytes, anc, _flags, addr = self.sock.recvmsg_into(
                    [self._buf], socket.CMSG_SPACE(16), socket.MSG_TRUNC)
            except BlockingIOError:
                return n
            ts = 0
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", data[:16])
                    ts = sec * 1_000_000_000 + nsec
            frame = parse_frame(bytes(self._buf[:min(nbytes, len(self._buf))]), nbytes,
                                addr[2] == PACKET_OUTGOING, ts)
            if frame is not None:
                self.frames.append(frame)
                n += 1

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def linked(prefix: str, a_if: str, a_ip: str, b_if: str, b_ip: str):
    """Two namespaces <prefix>a-…, <prefix>b-… joined by a veth (a_if in the
    first, b_if in the second); both removed on exit, whatever happened."""
    a = Namespace(f"{prefix}a")
    b = None
    try:
        b = Namespace(f"{prefix}b")
        veth_pair(a, a_if, a_ip, b, b_if, b_ip)
        yield a, b
    finally:
        a.close()
        if b is not None:
            b.close()


def http_request_bytes(frames: list, port: int) -> list[tuple[int, int]]:
    """Per HTTP/1.1 request to `port` on one connection, from its first frame to
    the next request's: (bytes of frames towards the port, bytes from it), whole
    frames as TC counts them; frames without payload left out."""
    flow = [f for f in frames if port in (f.sport, f.dport) and f.payload_len > 0]
    starts = [i for i, f in enumerate(flow) if f.payload.startswith(b"POST ")]
    out = []
    for lo, hi in zip(starts, starts[1:] + [len(flow)]):
        part = flow[lo:hi]
        out.append((sum(f.length for f in part if f.dport == port),
                    sum(f.length for f in part if f.sport == port)))
    return out
