"""Pure-Python parts of the TC classifier's loader: config → map contents and
-D flags, path hashing, interface choice, per-flow → monotonic totals, JSS
windows, and the C/Python constants that must agree. No root, no BCC."""

from __future__ import annotations

import re
import socket

import pytest

from spanlet import config, events
from spanlet.probes.base import BPF_DIR, expand_source
from spanlet.probes.tc import attach as tcattach
from spanlet.probes.tc.attach import Link, select_interfaces
from spanlet.probes.tc.flows import FlowAggregator, FlowSample, JssWindow
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


# ---- aggregation -----------------------------------------------------------------

def sample(key=b"k1", proto=P.http1, mod=M.text, l4=TCP, pk=(0, 0), by=(0, 0), media=0, late=0):
    return FlowSample(key=key, l4proto=l4, proto=int(proto), modality=int(mod),
                      packets=pk, bytes=by, media=media, late=late)


def test_totals_sum_flows_per_direction_class_and_modality():
    agg = FlowAggregator(idle_timeout_s=60)
    agg.update(0, [sample(b"a", P.http1, M.image, pk=(3, 2), by=(300, 200)),
                   sample(b"b", P.http1, M.image, pk=(1, 1), by=(100, 50)),
                   sample(b"c", P.udp, M.other, l4=UDP, pk=(5, 0), by=(500, 0))])
    assert agg.traffic == {("ingress", "http1", "image"): [4, 400],
                           ("egress", "http1", "image"): [3, 250],
                           ("ingress", "udp", "other"): [5, 500]}


def test_handshake_waits_for_the_class_the_flow_ends_up_with():
    agg = FlowAggregator(idle_timeout_s=60, pending_grace_s=10)
    agg.update(0, [sample(proto=P.unknown, pk=(2, 1), by=(120, 60))])  # SYN, SYN-ACK, ACK
    assert agg.traffic == {}
    agg.update(1, [sample(proto=P.websocket, mod=M.other, pk=(3, 1), by=(400, 60))])
    assert agg.traffic == {("ingress", "websocket", "other"): [3, 400],
                           ("egress", "websocket", "other"): [1, 60]}


def test_a_flow_that_never_carries_payload_counts_as_tcp_after_the_grace():
    agg = FlowAggregator(idle_timeout_s=60, pending_grace_s=10)
    syn = sample(proto=P.unknown, mod=M.other, pk=(1, 0), by=(60, 0))
    agg.update(0, [syn])
    agg.update(9, [syn])
    assert agg.traffic == {}
    agg.update(10, [syn])
    assert agg.traffic == {("ingress", "tcp", "other"): [1, 60]}


def test_an_evicted_flow_keeps_what_was_counted_and_pending_ones_fall_back():
    agg = FlowAggregator(idle_timeout_s=60)
    agg.update(0, [sample(b"a", P.http2, pk=(5, 5), by=(500, 500)),
                   sample(b"u", P.unknown, l4=UDP, pk=(1, 0), by=(70, 0))])
    agg.update(1, [])  # both evicted from the LRU maps
    assert agg.traffic == {("ingress", "http2", "text"): [5, 500],
                           ("egress", "http2", "text"): [5, 500],
                           ("ingress", "udp", "text"): [1, 70]}
    assert len(agg) == 0


def test_counters_never_go_down_when_a_flow_is_recreated_between_reads():
    agg = FlowAggregator(idle_timeout_s=60)
    agg.update(0, [sample(pk=(10, 0), by=(1000, 0))])
    agg.update(1, [sample(pk=(2, 0), by=(200, 0))])  # evicted, then new packets
    assert agg.traffic[("ingress", "http1", "text")] == [12, 1200]
    agg.update(2, [sample(pk=(3, 0), by=(300, 0))])
    assert agg.traffic[("ingress", "http1", "text")] == [13, 1300]


def test_a_change_of_modality_moves_only_later_packets():
    agg = FlowAggregator(idle_timeout_s=60)
    agg.update(0, [sample(mod=M.other, pk=(2, 0), by=(200, 0))])
    agg.update(1, [sample(mod=M.audio, pk=(5, 0), by=(500, 0))])
    assert agg.traffic == {("ingress", "http1", "other"): [2, 200],
                           ("ingress", "http1", "audio"): [3, 300]}


def test_idle_flows_are_returned_for_deletion_and_keep_their_counts():
    agg = FlowAggregator(idle_timeout_s=30)
    assert agg.update(0, [sample(b"a", pk=(1, 0), by=(10, 0)), sample(b"b", pk=(1, 0), by=(10, 0))]) == []
    assert agg.update(20, [sample(b"a", pk=(1, 0), by=(10, 0)), sample(b"b", pk=(2, 0), by=(20, 0))]) == []
    idle = agg.update(30, [sample(b"a", pk=(1, 0), by=(10, 0)), sample(b"b", pk=(2, 0), by=(20, 0))])
    assert idle == [b"a"]
    agg.forget(idle)
    assert len(agg) == 1
    assert agg.traffic[("ingress", "http1", "text")] == [3, 30]
    # A new flow with the same key later starts from zero without double counting.
    agg.update(40, [sample(b"a", pk=(1, 0), by=(10, 0)), sample(b"b", pk=(2, 0), by=(20, 0))])
    assert agg.traffic[("ingress", "http1", "text")] == [4, 40]


def test_jitter_counts_follow_the_flow_class_and_modality():
    agg = FlowAggregator(idle_timeout_s=60)
    agg.update(0, [sample(b"r", P.rtp, M.audio, l4=UDP, pk=(50, 0), by=(5000, 0), media=50, late=5)])
    agg.update(1, [sample(b"r", P.rtp, M.audio, l4=UDP, pk=(100, 0), by=(10000, 0), media=100, late=10)])
    assert agg.jitter == {("rtp", "audio"): [100, 10]}


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
