"""Loader of bpf/tc_classify.bpf.c: attaches the TC classifier to clsact ingress
and egress of the node's interfaces (and of veths that appear later), pushes
the config into its maps, and reads the totals the kernel keeps per (protocol,
modality) as metrics 3 and 4: a scrape reads those few slots, never the
per-flow maps (which serve inspection and the deletion of idle flows)."""

from __future__ import annotations

import ctypes as C
import enum
import logging
import struct
import threading
import time

from spanlet import events
from spanlet.config import Config, TcConfig
from spanlet.probes.base import Probe, ProbeError
from spanlet.probes.maps import dump_table, read_batches
from spanlet.probes.tc.attach import (PROGRAMS, REQUEST_PARSER, Link, LinkMonitor, TcAttacher,
                                      _Attachment, _netlink_error_text, _prog_id, open_iproute,
                                      select_interfaces)
from spanlet.probes.tc.flows import (CLASSES, DIRECTIONS, PENDING_GRACE_S, JitterStats,
                                     JssWindow, _modality_name, _proto_name, class_jitter,
                                     class_traffic, idle_flows)

log = logging.getLogger(__name__)


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


# ---- pure parts: config → maps, hashing ------------------------------------------

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


# ---- map reading ----------------------------------------------------------------

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


KEY_PORTS_OFFSET = events.FlowKey.sport.offset


# ---- the probe ----------------------------------------------------------------

class TcProbe(Probe):
    name = "tc_classify"

    def __init__(self, cfg: Config, sink=None, clock=None, netns: str | None = None):
        super().__init__(cfg, sink=sink, clock=clock)
        self.netns = netns or cfg.tc.netns or None
        tc = cfg.tc
        self._traffic: dict[tuple[str, str, str], tuple[int, int]] = {}
        # Old pending TCP flows the agent took out of tc_pending (tcp, by port modality).
        self._swept: dict[tuple[str, str, str], list[int]] = {}
        self._jss = JssWindow(horizon_s=max(900.0, 2 * tc.jss_window_s))
        self._read_lock = threading.Lock()
        self._attach_lock = threading.Lock()
        self._attacher: TcAttacher | None = None
        self._attached: dict[int, _Attachment] = {}
        self._failed: dict[str, str] = {}
        self._monitor = LinkMonitor(self.netns, self.reconcile)
        self.prog_ids: dict[str, int] = {}
        self._port_modality = port_map_entries(tc)
        # refresh() records the JSS history and looks for idle flows this often.
        self._read_every_s = min(5.0, tc.flow_idle_timeout_s / 4)
        self._last_read = 0.0
        self._last_sweep = 0.0

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

    def start_compile(self, pin_dir: str | None = None) -> bool:
        """Probe.start_compile, except that a configured interface list naming
        nothing usable fails at once, without a compile."""
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
                return False
        return super().start_compile(pin_dir)

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
        self._monitor.start()
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
        self._monitor.stop()
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

    def refresh(self) -> None:
        """Periodic: fold the maps into the totals, delete idle flows; re-read
        the interfaces if the link monitor is not running."""
        if self.bpf is None or not self.status.attached:
            return
        if not self._monitor.running():
            self.reconcile()
        if time.monotonic() - self._last_read >= self._read_every_s:
            self._read()
        if time.monotonic() - self._last_sweep >= self._read_every_s:
            self._last_sweep = time.monotonic()
            self._sweep_idle()
            self._sweep_pending()

    # -- reading ---------------------------------------------------------------------
    def _class_rows(self, name: str) -> list[tuple[int, list[int]]]:
        """(slot, its u64 fields summed over the CPUs) of a class map, read in
        one batch."""
        table = self.bpf[name]
        fields = C.sizeof(table.sLeaf) // 8
        keys, values = read_batches(table, chunk=CLASSES)
        n = len(keys) // 4
        ncpu = len(values) // (n * fields * 8) if n else 0
        sums = [[0] * fields for _ in range(n)]
        for i, row in enumerate(struct.iter_unpack(f"={fields}Q", values)):
            acc = sums[i // ncpu]
            for f in range(fields):
                acc[f] += row[f]
        return list(zip(struct.unpack(f"={n}I", keys), sums))

    def _read(self) -> None:
        """Read the class totals (two maps of CLASSES slots); a read younger
        than MIN_READ_GAP_S is fresh enough (a scrape asks for totals and
        jitter one after the other)."""
        with self._read_lock:
            if self.bpf is None or time.monotonic() - self._last_read < MIN_READ_GAP_S:
                return
            now = self._last_read = time.monotonic()
            traffic = class_traffic((index, (v[0], v[1]), (v[2], v[3]))
                                    for index, v in self._class_rows("spanlet_network_bytes_total"))
            for key, (p, b) in self._swept.items():
                p0, b0 = traffic.get(key, (0, 0))
                traffic[key] = (p0 + p, b0 + b)
            self._traffic = traffic
            jitter = class_jitter((index, v[0], v[1])
                                  for index, v in self._class_rows("spanlet_jitter_sensitivity_score"))
            self._jss.record(now, jitter)

    def _port_modality_of(self, key: bytes) -> int:
        """The port map applied as the kernel does (source port first)."""
        sport, dport = struct.unpack_from("=HH", key, KEY_PORTS_OFFSET)
        ports = self._port_modality
        return ports.get(sport, ports.get(dport, 0))

    def _sweep_idle(self) -> None:
        """Delete the flows idle for tc.flow_idle_timeout_s from the per-flow
        maps (their packets stay in the class totals)."""
        table = self.bpf["tc_flow_counters"]
        keys, values = read_batches(table)
        k_size, cpu_size = C.sizeof(table.Key), C.sizeof(table.sLeaf)
        ncpu = C.sizeof(table.Leaf) // cpu_size
        last_at = table.sLeaf.last_ns.offset
        last = [v for (v,) in struct.iter_unpack(f"={last_at}xQ{cpu_size - last_at - 8}x", values)]
        counters = zip((keys[i:i + k_size] for i in range(0, len(keys), k_size)),
                       zip(*(last[c::ncpu] for c in range(ncpu))))
        idle = idle_flows(counters, time.monotonic_ns(),
                          int(self.cfg.tc.flow_idle_timeout_s * 1e9))
        for name in ("tc_flow_counters", "flow_info"):
            t = self.bpf[name]
            for key in idle:
                try:
                    del t[t.Key.from_buffer_copy(key)]
                except KeyError:
                    pass

    def _sweep_pending(self) -> None:
        """TCP flows pending longer than PENDING_GRACE_S (no payload, no FIN
        or RST: a SYN left unanswered, say) count as tcp: the entry is taken
        out of tc_pending, and counted only if this deletion is the one that
        removed it (the kernel adds it to a class the same way)."""
        table = self.bpf["tc_pending"]
        now = time.monotonic_ns()
        old = [(k, v) for k, v in dump_table(table).items()
               if now - v.first_ns >= PENDING_GRACE_S * 1e9]
        for key, v in old:
            try:
                del table[table.Key.from_buffer_copy(key)]
            except KeyError:
                continue  # classified meanwhile: the kernel counted it
            mod = _modality_name(self._port_modality_of(key))
            with self._read_lock:
                for d, direction in enumerate(DIRECTIONS):
                    if v.packets[d] or v.bytes[d]:
                        t = self._swept.setdefault((direction, "tcp", mod), [0, 0])
                        t[0] += v.packets[d]
                        t[1] += v.bytes[d]
                self._last_read = 0.0  # the next totals() shows them

    def totals(self) -> dict[tuple[str, str, str], tuple[int, int]]:
        """{(direction, protocol, modality): (packets, bytes)}, cumulative since
        start; read at scrape time (metric 3, spanlet_network_bytes_total)."""
        self._read()
        with self._read_lock:
            return dict(self._traffic)

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
        counters = dump_table(self.bpf["tc_flow_counters"])
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
