"""Cost of the TC classifier per packet: a UDP flood through a veth pair between
two namespaces made here, without and with the probe on the receiving end
(alternating rounds, one run), printing both rates, their ratio and the ns
added per packet; also the program's own run time from BPF run stats, and the
cost of each path (plain UDP, TCP ACK, RTP, HTTP request) from
BPF_PROG_TEST_RUN on a warm flow.

    sudo .venv/bin/python bench/tc_bench.py [--seconds 2] [--rounds 3] [--flows 1]
"""

from __future__ import annotations

import argparse
import ctypes as C
import json
import socket
import os
import re
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "support"))

from spanlet import config  # noqa: E402
from spanlet.probes.tc.probe import TcProbe  # noqa: E402
from netns import Namespace, eth, ipv4, socket_in, tcp, udp, veth_pair  # noqa: E402

SENDER_IP, RECEIVER_IP, PORT = "169.254.88.1", "169.254.88.2", 9999
BATCH = 64
STATS_SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")


class _IoVec(C.Structure):
    _fields_ = [("base", C.c_void_p), ("len", C.c_size_t)]


class _MsgHdr(C.Structure):
    _fields_ = [("name", C.c_void_p), ("namelen", C.c_uint32), ("iov", C.POINTER(_IoVec)),
                ("iovlen", C.c_size_t), ("control", C.c_void_p), ("controllen", C.c_size_t),
                ("flags", C.c_int)]


class _MMsgHdr(C.Structure):
    _fields_ = [("hdr", _MsgHdr), ("len", C.c_uint)]


class Flood:
    """sendmmsg() of BATCH datagrams at a time on connected UDP sockets (one per flow)."""

    def __init__(self, sockets: list[socket.socket], size: int):
        self.libc = C.CDLL(None, use_errno=True)
        self.sockets = sockets
        self.payload = C.create_string_buffer(b"\x00" * size, size)
        self.iov = _IoVec(C.cast(self.payload, C.c_void_p), size)
        self.msgs = (_MMsgHdr * BATCH)()
        for m in self.msgs:
            m.hdr.iov = C.pointer(self.iov)
            m.hdr.iovlen = 1

    def run(self, seconds: float) -> tuple[float, float]:
        """(packets per second, CPU ns per packet of this thread) during `seconds`.
        The receive side runs in this thread's softirq (veth), so its CPU time
        counts the whole path and, unlike the rate, not the time other
        processes of a busy machine take."""
        fds = [s.fileno() for s in self.sockets]
        sent = 0
        i = 0
        start, cpu0 = time.perf_counter(), time.thread_time_ns()
        end = start + seconds
        while True:
            for _ in range(16):
                n = self.libc.sendmmsg(fds[i % len(fds)], self.msgs, BATCH, 0)
                if n > 0:
                    sent += n
                i += 1
            now = time.perf_counter()
            if now >= end:
                return sent / (now - start), (time.thread_time_ns() - cpu0) / max(sent, 1)


def prog_stats(prog_id: int) -> tuple[int, int]:
    out = subprocess.run(["bpftool", "-j", "prog", "show", "id", str(prog_id)], check=True,
                         capture_output=True, text=True).stdout
    p = json.loads(out)
    return p.get("run_time_ns", 0), p.get("run_cnt", 0)


def ipv4_frame(l4proto: int, sport: int, dport: int, payload: bytes, tcp_flags: int = 0x10) -> bytes:
    l4 = tcp(sport, dport, payload, tcp_flags) if l4proto == socket.IPPROTO_TCP else udp(sport, dport, payload)
    return eth("02:00:00:00:00:02", "02:00:00:00:00:04", 0x0800,
               ipv4(l4proto, l4, src="10.9.0.1", dst="10.9.0.2"))


PATHS = {
    "UDP, settled flow": (ipv4_frame(socket.IPPROTO_UDP, 40000, 9999, b"\x00" * 64), 1_000_000),
    "TCP ACK, flow with no payload yet": (ipv4_frame(socket.IPPROTO_TCP, 40001, 8080, b""), 1_000_000),
    "TCP ACK, HTTP/1.1 flow": (ipv4_frame(socket.IPPROTO_TCP, 40004, 8080, b""), 1_000_000),
    "RTP audio (jitter)": (ipv4_frame(socket.IPPROTO_UDP, 40002, 5004,
                                      struct.pack("!BBHII", 0x80, 0, 1, 160, 7) + b"\xd5" * 160), 1_000_000),
    # Fewer runs: each emits an http_event, and a full ring buffer is a cheaper path.
    "HTTP/1.1 request + traceparent": (ipv4_frame(socket.IPPROTO_TCP, 40003, 8080, (
        "POST /v1/images/generate HTTP/1.1\r\nHost: model\r\nUser-Agent: bench\r\n"
        "Content-Type: image/png\r\nAccept: */*\r\n"
        "traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"
        "Content-Length: 4\r\n\r\nabcd").encode(), tcp_flags=0x18), 4_000),
}


# Frames run once before a path's frame, to put its flow in the state named.
WARM = {"TCP ACK, HTTP/1.1 flow": ipv4_frame(socket.IPPROTO_TCP, 40004, 8080,
                                          b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
                                          tcp_flags=0x18)}


def prog_run(probe: TcProbe, tmp: str, frame: bytes, repeat: int) -> int | None:
    """Average ns per run of tc_classify_in on `frame`, from bpftool."""
    path = os.path.join(tmp, "frame.bin")
    with open(path, "wb") as f:
        f.write(frame)
    probe.drain()
    res = subprocess.run(["bpftool", "prog", "run", "id", str(probe.prog_ids["ingress"]),
                          "data_in", path, "repeat", str(repeat)],
                         capture_output=True, text=True, timeout=60)
    m = re.search(r"duration \(average\): (\d+)ns", res.stdout)
    return int(m.group(1)) if m else None


def path_costs(probe: TcProbe) -> dict[str, int]:
    """Average ns per run of tc_classify_in on each kind of packet (warm flow)."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="tc_bench-") as tmp:
        for name, (frame, repeat) in PATHS.items():
            if name in WARM:
                prog_run(probe, tmp, WARM[name], 1)
            ns = prog_run(probe, tmp, frame, repeat)
            if ns is not None:
                out[name] = ns
    probe.drain()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="length of each round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds without and with the probe")
    ap.add_argument("--size", type=int, default=64, help="UDP payload bytes")
    ap.add_argument("--flows", type=int, default=1, help="distinct 5-tuples")
    args = ap.parse_args()
    if args.seconds * args.rounds * 2 > 45:
        ap.error("--seconds × --rounds × 2 must stay under 45 s")

    made = []
    sockets: list[socket.socket] = []
    probe = None
    stats_before = STATS_SYSCTL.read_text().strip() if STATS_SYSCTL.exists() else None
    try:
        tx, rx = Namespace("tcbench-tx"), None
        made.append(tx)
        rx = Namespace("tcbench-rx")
        made.append(rx)
        veth_pair(tx, "tbt0", SENDER_IP, rx, "tbr0", RECEIVER_IP)
        sink = socket_in(rx.name, type=socket.SOCK_DGRAM)
        sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # never read: drops there
        sink.bind((RECEIVER_IP, PORT))
        sockets.append(sink)
        senders = []
        for _ in range(args.flows):
            s = socket_in(tx.name, type=socket.SOCK_DGRAM)
            s.connect((RECEIVER_IP, PORT))
            senders.append(s)
        sockets += senders
        flood = Flood(senders, args.size)
        flood.run(0.5)  # warm caches

        cfg = config.load(env={}, overrides=["tc.interfaces=[tbr0]"])
        probe = TcProbe(cfg, netns=rx.name)
        t = time.perf_counter()
        status = probe.start()
        if not status.attached:
            print(f"probe did not attach: {status.reason}", file=sys.stderr)
            return 1
        compile_s = time.perf_counter() - t
        costs = path_costs(probe)
        prog = probe.prog_ids["ingress"]

        without, with_probe = [], []
        for _ in range(args.rounds):
            # The probe's own detach/attach code toggles the filters (and the
            # clsact it added); the programs stay loaded, so no recompile.
            probe._detach()
            without.append(flood.run(args.seconds))
            probe.reconcile()  # filters back
            with_probe.append(flood.run(args.seconds))
        # Run stats last and on their own: their clock reads cost per run too.
        run_ns = run_cnt = 0
        if stats_before is not None:
            STATS_SYSCTL.write_text("1")
            r0, c0 = prog_stats(prog)
            flood.run(min(args.seconds, 1.0))
            r1, c1 = prog_stats(prog)
            STATS_SYSCTL.write_text(stats_before)
            run_ns, run_cnt = r1 - r0, c1 - c0
        off = statistics.median(r for r, _ in without)
        on = statistics.median(r for r, _ in with_probe)
        cpu_off = statistics.median(c for _, c in without)
        cpu_on = statistics.median(c for _, c in with_probe)
        print(f"tc_classify bench: {args.flows} flow(s), {args.size}-byte UDP payload, "
              f"{args.rounds} × {args.seconds:.1f} s per side (compile+attach {compile_s:.1f} s)")
        print(f"  without probe : {off / 1e6:8.3f} Mpps  {cpu_off:6.0f} CPU ns/packet   "
              f"rounds {[f'{r / 1e6:.3f}' for r, _ in without]}")
        print(f"  with probe    : {on / 1e6:8.3f} Mpps  {cpu_on:6.0f} CPU ns/packet   "
              f"rounds {[f'{r / 1e6:.3f}' for r, _ in with_probe]}")
        print(f"  ratio with/without: {on / off:.3f} (rate)   {cpu_on / cpu_off:.3f} (CPU per packet)")
        print(f"  ns added per packet: {(1 / on - 1 / off) * 1e9:.0f} from the rates, "
              f"{cpu_on - cpu_off:.0f} from CPU time (clsact hook + program)")
        if run_cnt:
            print(f"  tc_classify_in run time (BPF stats, their own clock reads included): "
                  f"{run_ns / run_cnt:.0f} ns/packet over {run_cnt} runs")
        if costs:
            print("  per path, BPF_PROG_TEST_RUN on a warm flow (ns per packet):")
            for name, ns in costs.items():
                print(f"    {name:32s} {ns:5d}")
        return 0
    finally:
        if stats_before is not None:
            STATS_SYSCTL.write_text(stats_before)
        if probe is not None:
            probe.stop()
        for s in sockets:
            s.close()
        for ns in reversed(made):
            ns.close()


if __name__ == "__main__":
    sys.exit(main())
