"""Pure-Python parts of the TC classifier's loader: config → map contents and
-D flags, path hashing, interface choice, class slots → labelled totals, idle flows, JSS
windows, and the C/Python constants that must agree. No root, no BCC."""

from __future__ import annotations

import re
import socket

import pytest

from spanlet import config, events
from spanlet.probes.base import BPF_DIR, expand_source
from spanlet.probes.tc import attach as tcattach
from spanlet.probes.tc.attach import Link, select_interfaces
from spanlet.probes.tc.flows import (CLASSES, MOD_N, PROTO_N, JssWindow, class_jitter, class_name,
                                     class_traffic, idle_flows)
from spanlet.probes.tc.probe import (Method, TcProbe, Uncounted, fnv1a_32, late_threshold_ns,
                                     path_hash, payload_type_entries, port_map_entries)

TCP, UDP = socket.IPPROTO_TCP, socket.IPPROTO_UDP
P = events.Proto
M = events.Modality


def tc_cfg(**kw) -> config.TcConfig:
    return config.Config(tc=config.TcConfig(**kw)).tc


# ---- config → maps and flags ----------------------------------------------------

def test_late_threshold_is_tau_plus_delta_in_ns():
    assert late_threshold_ns(tc_cfg()) == 40_000_000
    assert late_threshold_ns(tc_cfg(tau_plc_ms=25.5, delta_buffer_ms=4.5)) == 30_000_000


def test_port_and_payload_type_maps_hold_modality_numbers():
    t = tc_cfg(port_modality={5004: "audio", 8554: "video", 8000: "text"},
               rtp_payload_types={0: {"modality": "audio", "clock_hz": 8000},
                                  96: {"modality": "video", "clock_hz": 90000}})
    assert port_map_entries(t) == {5004: 3, 8554: 4, 8000: 1}
    assert payload_type_entries(t) == {0: (8000, 3), 96: (90000, 4)}


def test_default_payload_types_reach_the_map():
    entries = payload_type_entries(tc_cfg())
    assert entries[0] == (8000, int(M.audio))
    assert entries[96] == (90000, int(M.video))
    assert entries[111] == (48000, int(M.audio))


def test_cflags_carry_the_tc_section():
    cfg = config.load(env={}, overrides=["tc.http_scan_bytes=256", "tc.max_flows=1024",
                                         "tc.tau_plc_ms=20", "tc.delta_buffer_ms=5"])
    flags = TcProbe(cfg).cflags()
    assert "-DSPANLET_TC_SCAN_BYTES=256" in flags
    assert "-DSPANLET_TC_MAX_FLOWS=1024" in flags
    assert "-DSPANLET_TC_LATE_NS=25000000ULL" in flags
    assert "-DSPANLET_TC_PORT_MAX=64" in flags
    assert f"-DSPANLET_RINGBUF_PAGES={cfg.ringbuf_pages}" in flags


def test_tc_config_from_environment():
    cfg = config.load(env={"SPANLET_TC_FLOW_IDLE_TIMEOUT_S": "30", "SPANLET_TC_JSS_WINDOW_S": "5",
                           "SPANLET_TC_INTERFACES": "eth0,eth1"})
    assert cfg.tc.flow_idle_timeout_s == 30
    assert cfg.tc.jss_window_s == 5
    assert cfg.tc.interfaces == ["eth0", "eth1"]


# ---- hashing -------------------------------------------------------------------

def test_fnv1a_reference_vectors():
    assert fnv1a_32(b"") == 0x811C9DC5
    assert fnv1a_32(b"a") == 0xE40C292C
    assert fnv1a_32(b"foobar") == 0xBF9CF968


def test_path_hash_ignores_query_and_caps_length():
    assert path_hash("/v1/images?size=512") == fnv1a_32(b"/v1/images")
    long = "/" + "x" * 300
    assert path_hash(long) == fnv1a_32(long.encode()[:128])


# ---- interfaces ----------------------------------------------------------------

LINKS = [Link(1, "lo", loopback=True, ether=False), Link(2, "eth0", False, True),
         Link(3, "veth1a2b", False, True), Link(4, "wg0", False, False),
         Link(5, "docker0", False, True)]


def test_default_is_every_non_loopback_ethernet_interface():
    wanted, problems = select_interfaces(LINKS, tc_cfg())
    assert wanted == {2: "eth0", 3: "veth1a2b", 5: "docker0"}
    assert problems == []


def test_exclusions_apply_to_the_default_set():
    wanted, _ = select_interfaces(LINKS, tc_cfg(exclude_interfaces=["lo", "docker0"]))
    assert wanted == {2: "eth0", 3: "veth1a2b"}


def test_configured_interfaces_report_the_missing_and_unusable():
    wanted, problems = select_interfaces(LINKS, tc_cfg(interfaces=["eth0", "eth9", "wg0"]))
    assert wanted == {2: "eth0"}
    assert problems == ["eth9: no such interface", "wg0: not an Ethernet interface"]


# ---- class totals ----------------------------------------------------------------

def slot(proto, mod) -> int:
    return int(proto) * MOD_N + int(mod)


def test_class_slots_name_protocol_and_modality():
    assert class_name(slot(P.http1, M.image)) == ("http1", "image")
    assert class_name(slot(P.rtp, M.audio)) == ("rtp", "audio")
    assert class_name(slot(P.udp, M.video)) == ("udp", "video")
    assert [class_name(slot(P.tcp, m)) for m in M] == [("tcp", m.name) for m in M]
    assert CLASSES == PROTO_N * MOD_N and len(P) <= PROTO_N and len(M) == MOD_N


def test_class_traffic_is_per_direction_and_leaves_out_empty_slots():
    rows = [(slot(P.http1, M.image), (3, 2), (300, 200)), (slot(P.udp, M.other), (5, 0), (500, 0)),
            (slot(P.tcp, M.text), (0, 0), (0, 0))]
    assert class_traffic(rows) == {("ingress", "http1", "image"): (3, 300),
                                   ("egress", "http1", "image"): (2, 200),
                                   ("ingress", "udp", "other"): (5, 500)}


def test_class_jitter_keeps_slots_with_media():
    rows = [(slot(P.rtp, M.audio), 100, 10), (slot(P.tcp, M.video), 0, 0)]
    assert class_jitter(rows) == {("rtp", "audio"): (100, 10)}


def test_idle_flows_go_by_the_latest_cpu():
    counters = [(b"a", (100, 900)), (b"b", (100, 200)), (b"c", (0, 0))]
    assert idle_flows(counters, now_ns=1000, idle_ns=800) == [b"b", b"c"]
    assert idle_flows(counters, now_ns=1000, idle_ns=2000) == []


# ---- JSS window -------------------------------------------------------------------

def test_jss_is_late_over_media_within_the_window():
    w = JssWindow()
    w.record(0, {})
    w.record(10, {("rtp", "audio"): (100, 10)})
    s = w.stats(10, window_s=60)[("rtp", "audio")]
    assert (s.media_packets, s.late_packets, s.jss) == (100, 10, 0.10)
    w.record(20, {("rtp", "audio"): (300, 12)})
    s = w.stats(20, window_s=10)[("rtp", "audio")]
    assert (s.window_media_packets, s.window_late_packets) == (200, 2)
    assert s.jss == 0.01
    assert (s.media_packets, s.late_packets) == (300, 12)


def test_jss_is_zero_without_media_in_the_window():
    w = JssWindow()
    w.record(0, {("rtp", "video"): (50, 1)})
    w.record(100, {("rtp", "video"): (50, 1)})
    assert w.stats(100, window_s=10)[("rtp", "video")].jss == 0.0


def test_jss_history_is_bounded():
    w = JssWindow(horizon_s=100)
    for t in range(0, 1000, 1):
        w.record(t, {("rtp", "audio"): (t, 0)})
    assert len(w._hist) <= 102


# ---- C and Python agree ------------------------------------------------------------

def _c_defines(prefix: str) -> dict[str, int]:
    text = expand_source(BPF_DIR / "tc_classify.bpf.c")
    return {m.group(1): int(m.group(2)) for m in re.finditer(rf"#define {prefix}(\w+) (\d+)\b", text)}


def test_method_numbers_match_the_c():
    assert _c_defines("METHOD_") == {m.name: int(m) for m in Method if m.name != "unknown"}


def test_class_slots_match_the_c():
    c = _c_defines("TC_")
    assert (c["MOD_N"], c["PROTO_N"]) == (MOD_N, PROTO_N)


def test_uncounted_reasons_match_the_c():
    c = _c_defines("SKIP_")
    assert c.pop("N") == len(Uncounted)
    assert c == {"FRAGMENT": Uncounted.fragment, "NONLINEAR": Uncounted.nonlinear}


def test_program_names_fit_the_kernel_and_exist_in_the_c():
    text = (BPF_DIR / "tc_classify.bpf.c").read_text()
    for name in [*tcattach.PROGRAMS.values(), tcattach.REQUEST_PARSER]:
        assert len(name) <= 15, name  # BPF_OBJ_NAME_LEN - 1: bpftool shows it whole
        assert re.search(rf"^int {name}\(struct __sk_buff \*skb\)", text, re.M), name


@pytest.mark.parametrize("field", ["flow_key", "http_event", "flow_event"])
def test_the_c_uses_the_shared_structs(field):
    assert f"struct {field}" in (BPF_DIR / "tc_classify.bpf.c").read_text()


def test_flows_without_payload_take_the_port_modality_in_user_space():
    cfg = config.load(env={}, overrides=['tc.port_modality={"5004": "audio", "9000": "video"}'])
    probe = TcProbe(cfg)
    key = events.FlowKey(sport=40000, dport=5004, l4proto=TCP, family=4)
    assert probe._port_modality_of(bytes(key)) == int(M.audio)
    key = events.FlowKey(sport=9000, dport=5004, l4proto=TCP, family=4)
    assert probe._port_modality_of(bytes(key)) == int(M.video)  # source port first, as in the C
    key = events.FlowKey(sport=1, dport=2, l4proto=TCP, family=4)
    assert probe._port_modality_of(bytes(key)) == int(M.other)
