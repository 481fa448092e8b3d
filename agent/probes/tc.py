"""Loader of bpf/tc_classify.bpf.c: attaches the TC classifier to clsact ingress
and egress of the node's interfaces (and of veths that appear later), pushes
the config into its maps, and turns its per-flow maps into monotonic totals
per (direction, protocol, modality) and Jitter Sensitivity Scores."""

from __future__ import annotations

import ctypes as C
import enum
import errno
import logging
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from spanlet import events
from spanlet.config import Config, TcConfig
from spanlet.probes.base import Probe, ProbeError

log = logging.getLogger(__name__)

FILTER_NAME = "spanlet_tc_classify"
PROGRAMS = {"ingress": "tc_classify_in", "egress": "tc_classify_eg"}
REQUEST_PARSER = "tc_classify_req"
# Where clsact (or the legacy ingress qdisc) hangs: TC_H_INGRESS, ffff:fff1.
QDISC_PARENT = 0xFFFFFFF1
# clsact's two hooks as filter parents (TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_INGRESS/EGRESS)).
PARENTS = {"ingress": 0xFFFFFFF2, "egress": 0xFFFFFFF3}
ETH_P_ALL = 0x0003
ARPHRD_ETHER = 1
IFF_LOOPBACK = 0x8
RTMGRP_LINK = 0x1
NETLINK_ROUTE = 0

DIRECTIONS = ("ingress", "egress")
# Flows whose TCP payload has not been seen yet are held back from the totals
# (so that their handshake counts under the class they end up with) until
# classified, idle, gone, or this old.
PENDING_GRACE_S = 10.0
# The link monitor re-reads the interfaces this often even without events
# (a netlink socket can overflow and lose them).
RECONCILE_EVERY_S = 30.0


class Method(enum.IntEnum):
    """HTTP methods of http_event.method (bpf/tc_classify.bpf.c: METHOD_*)."""
    unknown = 0
    GET = 1
    POST = 2
    PUT = 3
    DELETE = 4
    HEAD = 5
    OPTIONS = 6
    PATCH = 7
    CONNECT = 8
    TRACE = 9


class Uncounted(enum.IntEnum):
    """Why a TCP/UDP packet was not counted (tc_uncounted_packets_total index)."""
    fragment = 0      # IPv4 non-first fragment or IPv6 extension header
    nonlinear = 1     # headers outside the skb's linear data


class Rejected(enum.IntEnum):
    """What the classifier looked at and would not use (spanlet_tc_rejected_total
    index, bpf/tc_classify.bpf.c: REJECT_*). The packets are counted as usual,
    except those with an IP or L4 header cut by the packet's end or an IPv4
    header under 20 bytes (header_invalid: no flow to count them in)."""
    traceparent_invalid = 0       # not a valid W3C traceparent value: no ids taken
    traceparent_truncated = 1     # the value does not end in the scanned bytes of the packet
    traceparent_duplicate = 2     # several traceparent headers: none is used
    rtp_invalid = 3               # datagram of an RTP flow failing RFC 3550 A.1 (not media)
    rtp_unknown_payload_type = 4  # RTP data packet of a payload type not configured
    header_invalid = 5            # IPv4 header under 20 bytes, a header cut by the packet's
                                  # end, an IP length with no room for the L4 header, or a TCP
                                  # data offset under 5 words


# ---- pure parts: config → maps, hashing, interface choice, aggregation --------

def late_threshold_ns(tc: TcConfig) -> int:
    """tau_plc + delta_buffer in ns: a media packet whose |D| exceeds it is late."""
    return int(round((tc.tau_plc_ms + tc.delta_buffer_ms) * 1_000_000))


def port_map_entries(tc: TcConfig) -> dict[int, int]:
    """tc_port_modality contents: port → modality number."""
    return {port: int(events.Modality[m.value]) for port, m in tc.port_modality.items()}


def port_map_size(tc: TcConfig) -> int:
    return max(64, len(tc.port_modality))


def payload_type_entries(tc: TcConfig) -> dict[int, tuple[int, int]]:
    """tc_rtp_payload_types contents: payload type → (clock_hz, modality number)."""
    return {pt: (t.clock_hz, int(events.Modality[t.modality.value]))
            for pt, t in tc.rtp_payload_types.items()}


def fnv1a_32(data: bytes) -> int:
    h = 0x811C9DC5
    for b in data:
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


PATH_HASH_MAX = 128  # TC_PATH_MAX in the C


def path_hash(target: str | bytes) -> int:
    """http_event.path_hash of a request target: FNV-1a of the path, query excluded."""
    raw = target.encode() if isinstance(target, str) else target
    return fnv1a_32(raw.split(b"?", 1)[0][:PATH_HASH_MAX])


@dataclass(frozen=True)
class Link:
    index: int
    name: str
    loopback: bool
    ether: bool


def select_interfaces(links: Iterable[Link], tc: TcConfig) -> tuple[dict[int, str], list[str]]:
    """Which interfaces to attach to ({ifindex: name}) and which configured ones
    cannot be used ("name: why"). No configured list: every non-loopback
    Ethernet interface not excluded."""
    links = list(links)
    wanted: dict[int, str] = {}
    problems: list[str] = []
    if tc.interfaces:
        by_name = {l.name: l for l in links}
        for name in tc.interfaces:
            link = by_name.get(name)
            if link is None:
                problems.append(f"{name}: no such interface")
            elif not link.ether:
                problems.append(f"{name}: not an Ethernet interface")
            else:
                wanted[link.index] = name
        return wanted, problems
    for link in links:
        if link.loopback or not link.ether or link.name in tc.exclude_interfaces:
            continue
        wanted[link.index] = link.name
    return wanted, problems


@dataclass
class FlowSample:
    """One flow as read from the maps."""
    key: bytes
    l4proto: int
    proto: int          # events.Proto; 0 while a TCP flow has carried no payload
    modality: int
    packets: tuple[int, int]   # by direction
    bytes: tuple[int, int]
    media: int = 0
    late: int = 0

    def values(self) -> tuple[int, ...]:
        return (*self.packets, *self.bytes, self.media, self.late)


_ZERO = (0, 0, 0, 0, 0, 0)


@dataclass
class _FlowState:
    first_seen: float
    last_change: float
    attributed: tuple[int, ...] = _ZERO
    seen: tuple[int, ...] = _ZERO
    proto: int = 0
    modality: int = 0
    l4proto: int = 0


def _proto_name(proto: int, l4proto: int) -> str:
    if proto:
        return events.Proto(proto).name
    return "tcp" if l4proto == socket.IPPROTO_TCP else "udp"


def _modality_name(m: int) -> str:
    return events.Modality(m).name if m < len(events.Modality) else "other"


class FlowAggregator:
    """Per-flow kernel counters → cumulative totals that never go down.

    Each read adds what a flow gained since the previous read to the class and
    modality the flow has at that read; a flow that vanished (evicted) or was
    re-created (its counters went down) keeps what was already counted."""

    def __init__(self, idle_timeout_s: float, pending_grace_s: float = PENDING_GRACE_S):
        self.idle_timeout_s = idle_timeout_s
        self.pending_grace_s = pending_grace_s
        self._flows: dict[bytes, _FlowState] = {}
        self.traffic: dict[tuple[str, str, str], list[int]] = {}
        self.jitter: dict[tuple[str, str], list[int]] = {}

    def _attribute(self, st: _FlowState) -> None:
        delta = [s - a for s, a in zip(st.seen, st.attributed)]
        st.attributed = st.seen
        if not any(delta):
            return
        proto, mod = _proto_name(st.proto, st.l4proto), _modality_name(st.modality)
        for d, direction in enumerate(DIRECTIONS):
            if delta[d] or delta[2 + d]:
                t = self.traffic.setdefault((direction, proto, mod), [0, 0])
                t[0] += delta[d]
                t[1] += delta[2 + d]
        if delta[4] or delta[5]:
            j = self.jitter.setdefault((proto, mod), [0, 0])
            j[0] += delta[4]
            j[1] += delta[5]

    def update(self, now: float, samples: Iterable[FlowSample]) -> list[bytes]:
        """Fold one read of the maps in; return the keys idle for idle_timeout_s
        (delete them from the maps, then call forget())."""
        present = set()
        for s in samples:
            present.add(s.key)
            vals = s.values()
            st = self._flows.get(s.key)
            if st is None:
                st = self._flows[s.key] = _FlowState(first_seen=now, last_change=now)
            elif any(v < o for v, o in zip(vals, st.seen)):
                # Evicted and re-created between two reads: close the old one.
                self._attribute(st)
                st.attributed = st.seen = _ZERO
                st.first_seen = now
            if vals != st.seen:
                st.last_change = now
            st.seen, st.proto, st.modality, st.l4proto = vals, s.proto, s.modality, s.l4proto
            if st.proto or now - st.first_seen >= self.pending_grace_s:
                self._attribute(st)
        for key in [k for k in self._flows if k not in present]:
            self._attribute(self._flows.pop(key))
        return [k for k, st in self._flows.items() if now - st.last_change >= self.idle_timeout_s]

    def forget(self, keys: Iterable[bytes]) -> None:
        """The flows were deleted from the maps: count what they still held."""
        for key in keys:
            st = self._flows.pop(key, None)
            if st is not None:
                self._attribute(st)

    def __len__(self) -> int:
        return len(self._flows)


class JitterStats(NamedTuple):
    media_packets: int         # cumulative
    late_packets: int          # cumulative
    jss: float                 # late / media over the window (0.0 with no media)
    window_media_packets: int
    window_late_packets: int


class JssWindow:
    """History of the cumulative (media, late) counts, for JSS over a window."""

    def __init__(self, horizon_s: float = 900.0):
        self.horizon_s = horizon_s
        self._hist: deque[tuple[float, dict[tuple[str, str], tuple[int, int]]]] = deque()

    def record(self, now: float, totals: dict[tuple[str, str], list[int] | tuple[int, int]]) -> None:
        snap = {k: (v[0], v[1]) for k, v in totals.items()}
        if self._hist and self._hist[-1][1] == snap:
            return  # nothing moved: the older point serves as well
        self._hist.append((now, snap))
        while len(self._hist) > 2 and self._hist[1][0] <= now - self.horizon_s:
            self._hist.popleft()

    def stats(self, now: float, window_s: float) -> dict[tuple[str, str], JitterStats]:
        if not self._hist:
            return {}
        current = self._hist[-1][1]
        base = self._hist[0][1]
        for t, snap in self._hist:
            if t <= now - window_s:
                base = snap
            else:
                break
        out = {}
        for key, (media, late) in current.items():
            m0, l0 = base.get(key, (0, 0))
            wm, wl = media - m0, late - l0
            out[key] = JitterStats(media, late, wl / wm if wm else 0.0, wm, wl)
        return out


# ---- map reading ----------------------------------------------------------------

def _bcc_lib():
    from bcc.libbcc import lib
    return lib


def dump_table(table, chunk: int = 4096) -> dict[bytes, object]:
    """All entries of a BCC hash table, read in batches (one syscall per chunk
    instead of two per key); falls back to iteration where batches are refused."""
    lib = _bcc_lib()
    n = max(1, min(chunk, table.max_entries))
    keys = (table.Key * n)()
    values = (table.Leaf * n)()
    token = C.c_uint32(0)
    count = C.c_uint32(0)
    out: dict[bytes, object] = {}
    first = True
    while True:
        count.value = n
        res = lib.bpf_lookup_batch(table.map_fd, None if first else C.byref(token),
                                   C.byref(token), C.byref(keys), C.byref(values),
                                   C.byref(count))
        err = C.get_errno()
        if res != 0 and err not in (errno.ENOENT,):
            if first and err in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                return {bytes(k): v for k, v in table.items()}
            raise OSError(err, f"BPF_MAP_LOOKUP_BATCH on {table.name}: {os.strerror(err)}")
        for i in range(count.value):
            out[bytes(keys[i])] = type(values[i]).from_buffer_copy(values[i])
        if res != 0 or count.value == 0:
            return out
        first = False


def _counter_sums(leaf) -> tuple[tuple[int, int], tuple[int, int]]:
    p0 = p1 = b0 = b1 = 0
    for cpu in leaf:
        p0 += cpu.packets[0]
        p1 += cpu.packets[1]
        b0 += cpu.bytes[0]
        b1 += cpu.bytes[1]
    return (p0, p1), (b0, b1)


MIN_READ_GAP_S = 0.05


def _reversed(flow: events.FlowKey) -> events.FlowKey:
    r = events.FlowKey.from_buffer_copy(bytes(flow))
    r.saddr[:], r.daddr[:] = list(flow.daddr), list(flow.saddr)
    r.sport, r.dport = flow.dport, flow.sport
    return r


KEY_L4PROTO_OFFSET = events.FlowKey.l4proto.offset
KEY_PORTS_OFFSET = events.FlowKey.sport.offset


# ---- attaching ----------------------------------------------------------------

def _prog_id(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("prog_id:"):
                return int(line.split()[1])
    raise ProbeError(f"no prog_id for fd {fd}")


@dataclass
class _Attachment:
    index: int
    name: str
    owns_clsact: bool


def open_iproute(netns: str | None):
    from pyroute2 import IPRoute
    # flags=0: never create the namespace if it is gone.
    return IPRoute(netns=netns, flags=0) if netns else IPRoute()


def _filter_name(msg) -> str | None:
    if msg.get_attr("TCA_KIND") != "bpf":
        return None
    opts = msg.get_attr("TCA_OPTIONS")
    return opts.get_attr("TCA_BPF_NAME") if opts is not None else None


class TcAttacher:
    """clsact + cls_bpf filters through pyroute2, in one network namespace.

    Our filters carry the name FILTER_NAME, priority cfg.tc.filter_priority and
    as handle the id of our ingress program, so that a filter left by a killed
    agent (same name, other handle) is told apart from ours."""

    def __init__(self, netns: str | None, prio: int, fds: dict[str, int], handle: int):
        self.netns = netns
        self.prio = prio
        self.fds = fds
        self.handle = handle

    def iproute(self):
        return open_iproute(self.netns)

    @staticmethod
    def links(ipr) -> list[Link]:
        out = []
        for m in ipr.get_links():
            out.append(Link(index=m["index"], name=m.get_attr("IFLA_IFNAME"),
                            loopback=bool(m["flags"] & IFF_LOOPBACK),
                            ether=m["ifi_type"] == ARPHRD_ETHER))
        return out

    @staticmethod
    def _qdisc_kinds(ipr, index: int) -> set[str]:
        return {q.get_attr("TCA_KIND") for q in ipr.get_qdiscs(index)
                if q["index"] == index and q["parent"] == QDISC_PARENT}

    @staticmethod
    def _filters(ipr, index: int, parent: int) -> list:
        return [f for f in ipr.get_filters(index=index, parent=parent)
                if f["handle"] != 0 and f["index"] == index and f["parent"] == parent]

    def _remove_named(self, ipr, index: int, handle: int | None) -> int:
        """Delete our-named filters (all of them, or those with `handle`)."""
        removed = 0
        for parent in PARENTS.values():
            for f in self._filters(ipr, index, parent):
                if _filter_name(f) != FILTER_NAME or (handle is not None and f["handle"] != handle):
                    continue
                ipr.tc("del-filter", "bpf", index=index, handle=f["handle"], parent=parent,
                       info=f["info"])
                removed += 1
        return removed

    def _other_filters(self, ipr, index: int) -> int:
        return sum(len(self._filters(ipr, index, p)) for p in PARENTS.values())

    def remove_stale(self, ipr, index: int, name: str, drop_clsact: bool) -> bool:
        """Remove filters named like ours (a killed agent's). True when the
        clsact held nothing else: it was that agent's (deleted if drop_clsact)."""
        if "clsact" not in self._qdisc_kinds(ipr, index):
            return False
        stale = self._remove_named(ipr, index, None)
        if not stale:
            return False
        log.info("tc_classify: removed %d stale %s filter(s) on %s", stale, FILTER_NAME, name)
        if self._other_filters(ipr, index):
            return False
        if drop_clsact:
            ipr.tc("del", "clsact", index)
        return True

    def attach(self, ipr, index: int, name: str) -> _Attachment:
        owns = self.remove_stale(ipr, index, name, drop_clsact=False)
        kinds = self._qdisc_kinds(ipr, index)
        if "clsact" not in kinds:
            if "ingress" in kinds:
                raise ProbeError("an ingress qdisc is present (clsact cannot be added)")
            ipr.tc("add", "clsact", index)
            owns = True
        try:
            for direction, parent in PARENTS.items():
                ipr.tc("add-filter", "bpf", index=index, handle=self.handle, fd=self.fds[direction],
                       name=FILTER_NAME, parent=parent, prio=self.prio, protocol=ETH_P_ALL,
                       direct_action=True)
        except Exception:
            self.detach(ipr, _Attachment(index, name, owns))
            raise
        return _Attachment(index, name, owns)

    def detach(self, ipr, att: _Attachment) -> None:
        self._remove_named(ipr, att.index, self.handle)
        if att.owns_clsact and self._other_filters(ipr, att.index) == 0:
            ipr.tc("del", "clsact", att.index)


def _netlink_error_text(e: Exception) -> str:
    code = getattr(e, "code", None)
    if isinstance(code, int) and code > 0:
        return f"{os.strerror(code)} ({e})"
    return str(e) or type(e).__name__


# ---- the probe ----------------------------------------------------------------

class TcProbe(Probe):
    name = "tc_classify"

    def __init__(self, cfg: Config, sink=None, clock=None, netns: str | None = None):
        super().__init__(cfg, sink=sink, clock=clock)
        self.netns = netns or cfg.tc.netns or None
        tc = cfg.tc
        self._agg = FlowAggregator(idle_timeout_s=tc.flow_idle_timeout_s)
        self._jss = JssWindow(horizon_s=max(900.0, 2 * tc.jss_window_s))
        self._read_lock = threading.Lock()
        self._attach_lock = threading.Lock()
        self._attacher: TcAttacher | None = None
        self._attached: dict[int, _Attachment] = {}
        self._failed: dict[str, str] = {}
        self._monitor: threading.Thread | None = None
        self._monitor_stop = threading.Event()
        self._wake_w: int | None = None
        self.prog_ids: dict[str, int] = {}
        self._port_modality = port_map_entries(tc)
        # refresh() folds the maps in this often (scrapes read them anyway).
        self._read_every_s = min(5.0, tc.flow_idle_timeout_s / 4)
        self._last_read = 0.0

    # -- compile-time switches -----------------------------------------------------
    def cflags(self) -> list[str]:
        tc = self.cfg.tc
        return super().cflags() + [
            f"-DSPANLET_TC_MAX_FLOWS={tc.max_flows}",
            f"-DSPANLET_TC_SCAN_BYTES={tc.http_scan_bytes}",
            f"-DSPANLET_TC_LATE_NS={late_threshold_ns(tc)}ULL",
            f"-DSPANLET_TC_PORT_MAX={port_map_size(tc)}",
        ]

    # -- attach / detach -------------------------------------------------------------
    def _push_config(self) -> None:
        ports = self.bpf["tc_port_modality"]
        for port, mod in port_map_entries(self.cfg.tc).items():
            ports[ports.Key(port)] = ports.Leaf(mod)
        pts = self.bpf["tc_rtp_payload_types"]
        for pt, (clock_hz, mod) in payload_type_entries(self.cfg.tc).items():
            leaf = pts.Leaf()
            leaf.clock_hz = clock_hz
            leaf.modality = mod
            pts[pts.Key(pt)] = leaf

    def start(self, shared_span_ctx: bool = False):
        """Probe.start, except that a configured interface list naming nothing
        usable fails at once, without a compile."""
        tc = self.cfg.tc
        if tc.interfaces:
            try:
                with open_iproute(self.netns) as ipr:
                    wanted, problems = select_interfaces(TcAttacher.links(ipr), tc)
            except Exception as e:
                wanted, problems = {}, [f"netlink: {_netlink_error_text(e)}"]
            if not wanted:
                self.status.attached = False
                self.status.failed_attachments = problems
                self.status.reason = ("none of the configured interfaces could be attached: "
                                      + "; ".join(problems))
                return self.status
        return super().start(shared_span_ctx)

    def _attach(self) -> None:
        from bcc import BPF

        fns = {d: self.bpf.load_func(p, BPF.SCHED_CLS) for d, p in PROGRAMS.items()}
        parser = self.bpf.load_func(REQUEST_PARSER, BPF.SCHED_CLS)
        self.bpf["tc_request_parser"][C.c_int(0)] = C.c_int(parser.fd)
        self.prog_ids = {d: _prog_id(f.fd) for d, f in fns.items()}
        self.prog_ids["request"] = _prog_id(parser.fd)
        self._push_config()
        self._attacher = TcAttacher(self.netns, self.cfg.tc.filter_priority,
                                    {d: f.fd for d, f in fns.items()},
                                    handle=self.prog_ids["ingress"])
        self._jss.record(time.monotonic(), {})
        self._start_monitor()
        self.reconcile(sweep=True)
        if self.cfg.tc.interfaces and not self._attached:
            raise ProbeError("none of the configured interfaces could be attached: "
                             + "; ".join(self.status.failed_attachments))

    def reconcile(self, sweep: bool = False) -> None:
        """Attach to wanted interfaces not yet attached; forget vanished ones.
        sweep: also clear a killed agent's filters from the other interfaces."""
        if self._attacher is None:
            return
        with self._attach_lock:
            try:
                with self._attacher.iproute() as ipr:
                    links = self._attacher.links(ipr)
                    wanted, problems = select_interfaces(links, self.cfg.tc)
                    if sweep:
                        self._sweep(ipr, [l for l in links if l.index not in wanted])
                    present = {l.index for l in links}
                    for index in [i for i in self._attached if i not in present or i not in wanted]:
                        att = self._attached.pop(index)
                        if index in present:  # no longer wanted (renamed, say)
                            self._detach_one(ipr, att)
                    self._failed = {p.split(":", 1)[0]: p for p in problems}
                    for index, name in wanted.items():
                        if index in self._attached:
                            self._attached[index].name = name
                            continue
                        try:
                            self._attached[index] = self._attacher.attach(ipr, index, name)
                            log.info("tc_classify: attached to %s", name)
                        except Exception as e:
                            self._failed[name] = f"{name}: {_netlink_error_text(e)}"
            except FileNotFoundError as e:
                self._failed = {"netns": f"network namespace {self.netns}: {e.strerror}"}
            except Exception as e:
                log.warning("tc_classify: reading interfaces: %s", e)
                self._failed["netlink"] = f"netlink: {_netlink_error_text(e)}"
            self._publish_status()

    def _sweep(self, ipr, links: list[Link]) -> None:
        for link in links:
            try:
                self._attacher.remove_stale(ipr, link.index, link.name, drop_clsact=True)
            except Exception as e:
                log.warning("tc_classify: stale filters on %s: %s", link.name, _netlink_error_text(e))

    def _publish_status(self) -> None:
        self.status.attachments = [f"{a.name}/{d}" for a in self._attached.values() for d in DIRECTIONS]
        self.status.failed_attachments = sorted(self._failed.values())

    def _detach_one(self, ipr, att: _Attachment) -> None:
        try:
            self._attacher.detach(ipr, att)
        except Exception as e:
            # The interface may have gone meanwhile: its filters went with it.
            log.debug("tc_classify: detach %s: %s", att.name, e)

    def _detach(self) -> None:
        self._stop_monitor()
        if self._attacher is None:
            return
        with self._attach_lock:
            if self._attached:
                try:
                    with self._attacher.iproute() as ipr:
                        for att in self._attached.values():
                            self._detach_one(ipr, att)
                except Exception as e:
                    log.warning("tc_classify: detach: %s", _netlink_error_text(e))
            self._attached.clear()
            self._publish_status()

    # -- link monitor ------------------------------------------------------------------
    def _link_socket(self) -> socket.socket:
        if self.netns:
            from pyroute2 import netns as pr_netns
            sock = pr_netns.create_socket(self.netns, socket.AF_NETLINK, socket.SOCK_RAW,
                                          NETLINK_ROUTE, flags=0)
        else:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        sock.bind((0, RTMGRP_LINK))
        sock.setblocking(False)
        return sock

    def _start_monitor(self) -> None:
        try:
            sock = self._link_socket()
        except OSError as e:
            log.warning("tc_classify: no link monitor (%s); interfaces are re-read on refresh", e)
            return
        wake_r, self._wake_w = os.pipe()
        self._monitor_stop.clear()
        self._monitor = threading.Thread(target=self._monitor_loop, args=(sock, wake_r),
                                         name="tc_classify-links", daemon=True)
        self._monitor.start()

    def _monitor_loop(self, sock: socket.socket, wake_r: int) -> None:
        try:
            while not self._monitor_stop.is_set():
                ready, _, _ = select.select([sock, wake_r], [], [], RECONCILE_EVERY_S)
                if wake_r in ready or self._monitor_stop.is_set():
                    break
                if sock in ready:
                    try:
                        while sock.recv(65536):
                            pass
                    except (BlockingIOError, InterruptedError):
                        pass
                    except OSError as e:  # ENOBUFS: events lost, so re-read all
                        log.debug("tc_classify: link monitor: %s", e)
                self.reconcile()
        except Exception as e:
            log.warning("tc_classify: link monitor stopped: %s", e)
        finally:
            sock.close()
            os.close(wake_r)

    def _stop_monitor(self) -> None:
        self._monitor_stop.set()
        if self._wake_w is not None:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
        if self._monitor is not None:
            self._monitor.join(timeout=10)
            self._monitor = None
        if self._wake_w is not None:
            os.close(self._wake_w)
            self._wake_w = None

    def refresh(self) -> None:
        """Periodic: fold the maps into the totals, delete idle flows; re-read
        the interfaces if the link monitor is not running."""
        if self.bpf is None or not self.status.attached:
            return
        if self._monitor is None or not self._monitor.is_alive():
            self.reconcile()
        if time.monotonic() - self._last_read >= self._read_every_s:
            self._read()

    # -- reading ---------------------------------------------------------------------
    def _samples(self) -> list[FlowSample]:
        counters = dump_table(self.bpf["spanlet_network_bytes_total"])
        info = dump_table(self.bpf["flow_info"])
        jitter = dump_table(self.bpf["spanlet_jitter_sensitivity_score"])
        out = []
        for key, leaf in counters.items():
            packets, nbytes = _counter_sums(leaf)
            fi = info.get(key)
            jl = jitter.get(key)
            media = late = 0
            if jl is not None:
                for cpu in jl:
                    media += cpu.media_packets
                    late += cpu.late_packets
            if fi is not None:
                proto, modality = fi.proto, fi.modality
            else:  # no payload yet: the kernel made no flow_info
                proto, modality = 0, self._port_modality_of(key)
            out.append(FlowSample(key=key, l4proto=key[KEY_L4PROTO_OFFSET], proto=proto,
                                  modality=modality, packets=packets, bytes=nbytes,
                                  media=media, late=late))
        return out

    def _port_modality_of(self, key: bytes) -> int:
        """The port map applied as the kernel does (source port first)."""
        sport, dport = struct.unpack_from("=HH", key, KEY_PORTS_OFFSET)
        ports = self._port_modality
        return ports.get(sport, ports.get(dport, 0))

    def _read(self) -> None:
        """Fold the maps into the totals; a read younger than MIN_READ_GAP_S
        is fresh enough (a scrape asks for totals and jitter one after the
        other: one pass over the maps serves both)."""
        with self._read_lock:
            if self.bpf is None or time.monotonic() - self._last_read < MIN_READ_GAP_S:
                return
            now = self._last_read = time.monotonic()
            idle = self._agg.update(now, self._samples())
            if idle:
                self._delete_flows(idle)
                self._agg.forget(idle)
            self._jss.record(now, self._agg.jitter)

    def _delete_flows(self, keys: list[bytes]) -> None:
        for name in ("spanlet_network_bytes_total", "flow_info", "spanlet_jitter_sensitivity_score"):
            table = self.bpf[name]
            for key in keys:
                try:
                    del table[table.Key.from_buffer_copy(key)]
                except KeyError:
                    pass

    def totals(self) -> dict[tuple[str, str, str], tuple[int, int]]:
        """{(direction, protocol, modality): (packets, bytes)}, cumulative since
        start; read at scrape time (metric 3, spanlet_network_bytes_total)."""
        self._read()
        with self._read_lock:
            return {k: (v[0], v[1]) for k, v in self._agg.traffic.items()}

    def jitter(self, window_s: float | None = None) -> dict[tuple[str, str], JitterStats]:
        """{(protocol, modality): JitterStats} for media flows (metric 4): cumulative
        media and late packets, and the JSS over the last window_s seconds
        (cfg.tc.jss_window_s by default)."""
        self._read()
        window = self.cfg.tc.jss_window_s if window_s is None else window_s
        with self._read_lock:
            return self._jss.stats(time.monotonic(), window)

    def uncounted(self) -> dict[str, int]:
        """TCP/UDP packets not counted, by reason (fragments, non-linear headers)."""
        if self.bpf is None:
            return {}
        return self._by_reason("tc_uncounted_packets_total", Uncounted)

    def rejected(self) -> dict[str, int]:
        """Headers and datagrams looked at and not used, by reason (Rejected)."""
        if self.bpf is None:
            return {}
        return self._by_reason("spanlet_tc_rejected_total", Rejected)

    def _by_reason(self, name: str, reasons: type[enum.IntEnum]) -> dict[str, int]:
        table = self.bpf[name]
        return {r.name: sum(int(v) for v in table[table.Key(int(r))]) for r in reasons}

    def request_bytes(self, flow: events.FlowKey) -> tuple[bytes, int, tuple[int, int]] | None:
        """The HTTP request in progress on the connection of `flow` (either
        orientation): (trace id, parent span id, (rx, tx) wire bytes so far)."""
        if self.bpf is None:
            return None
        table = self.bpf["http_request_bytes"]
        for key in (flow, _reversed(flow)):
            try:
                r = table[table.Key.from_buffer_copy(bytes(key))]
            except KeyError:
                continue
            d = r.req_dir & 1
            return bytes(r.trace_id), r.parent_id, (r.bytes[d], r.bytes[1 - d])
        return None

    def flows(self) -> list[dict]:
        """The flows in the maps now (for inspection): ends, class, modality,
        counters, and the RFC 3550 jitter estimate per direction in ms."""
        if self.bpf is None:
            return []
        info = dump_table(self.bpf["flow_info"])
        counters = dump_table(self.bpf["spanlet_network_bytes_total"])
        out = []
        for key, leaf in counters.items():
            k = events.FlowKey.from_buffer_copy(key)
            packets, nbytes = _counter_sums(leaf)
            fi = info.get(key)
            proto = _proto_name(fi.proto, k.l4proto) if fi is not None and fi.proto else "pending"
            out.append({**k.as_dict(),
                        "protocol": proto,
                        "modality": _modality_name(fi.modality if fi is not None else 0),
                        "packets": dict(zip(DIRECTIONS, packets)),
                        "bytes": dict(zip(DIRECTIONS, nbytes)),
                        "jitter_ms": {d: (fi.jit[i].jitter_x16_ns / 16 / 1e6 if fi is not None else 0.0)
                                      for i, d in enumerate(DIRECTIONS)}})
        return out
