"""Who sent a request, from its connection: the connecting process's cgroup →
every cgroup of its pod (the cgroup path shapes of the systemd and cgroupfs
drivers with containerd and CRI-O), the pod of a pod IP where the kernel saw
no connect, and unknown otherwise (hostNetwork pods, the node's address,
no connection at all). The kernel side is in tests/kernel/test_senders.py."""

from __future__ import annotations

import os
import socket

import pytest
from kubernetes import client

from spanlet.cgroups import CgroupIndex, pod_directory
from spanlet.exporters.otlp.trust import Peer, grpc_peer, local_host_of, split_grpc_peer
from spanlet.k8s import PodWatcher, _pod_info
from spanlet.pipeline.senders import BY_POD_IP, BY_SOCKET, UNKNOWN, SenderOrigins

UID, UID2, UID3, UID4 = (f"{c * 8}-1b2c-4d5e-8f90-0123456789ab" for c in "5ace")
C1, C2, PAUSE, C3, C4, C5, C6 = (c * 64 for c in "1234567")


def slice_(uid: str, qos: str = "burstable") -> str:
    return f"kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{uid.replace('-', '_')}.slice"


PATHS = {
    # systemd driver, containerd: two containers and the sandbox of pod UID, one of pod UID2
    "c1": f"{slice_(UID)}/cri-containerd-{C1}.scope",
    "c2": f"{slice_(UID)}/cri-containerd-{C2}.scope",
    "pause": f"{slice_(UID)}/cri-containerd-{PAUSE}.scope",
    "c3": f"{slice_(UID2)}/cri-containerd-{C3}.scope",
    # cgroupfs driver: pod UID3
    "c4": f"kubepods/burstable/pod{UID3}/{C4}",
    "c5": f"kubepods/burstable/pod{UID3}/{C5}",
    # systemd driver, CRI-O: pod UID4, its container and conmon
    "c6": f"{slice_(UID4, 'besteffort')}/crio-{C6}.scope",
    "conmon": f"{slice_(UID4, 'besteffort')}/crio-conmon-{C6}.scope",
    # host services
    "svc": "system.slice/containerd.service",
    "user": "user.slice/user-0.slice/session-1.scope",
}


@pytest.fixture
def tree(tmp_path):
    """A cgroup tree of the real shapes: name → id, and the index over it."""
    for p in PATHS.values():
        (tmp_path / p).mkdir(parents=True)
    ids = {name: os.stat(tmp_path / p).st_ino for name, p in PATHS.items()}
    for name, p in (("pod1", slice_(UID)), ("pod3", f"kubepods/burstable/pod{UID3}"),
                    ("pod4", slice_(UID4, "besteffort"))):
        ids[name] = os.stat(tmp_path / p).st_ino
    return ids, CgroupIndex(root=tmp_path, rescan_s=0)


@pytest.mark.parametrize("name, expected", [
    ("c1", "/" + slice_(UID)), ("pause", "/" + slice_(UID)),
    ("c4", f"/kubepods/burstable/pod{UID3}"), ("c6", "/" + slice_(UID4, "besteffort")),
    ("conmon", "/" + slice_(UID4, "besteffort")), ("svc", None), ("user", None),
])
def test_the_pod_directory_of_each_shape(name, expected):
    assert pod_directory(PATHS[name]) == expected
    assert pod_directory("/" + slice_(UID)) == "/" + slice_(UID)     # the pod's own cgroup


@pytest.mark.parametrize("sender, pod", [
    ("c1", {"pod1", "c1", "c2", "pause"}), ("c2", {"pod1", "c1", "c2", "pause"}),
    ("c3", None), ("c4", {"pod3", "c4", "c5"}), ("c6", {"pod4", "c6", "conmon"}),
    ("svc", {"svc"}), ("user", {"user"}),
])
def test_the_same_pod_is_every_cgroup_under_the_pod(tree, sender, pod):
    ids, index = tree
    got = index.same_pod(ids[sender])
    if pod is None:      # the only container of its pod: the pod slice and itself
        assert ids[sender] in got and len(got) == 2 and not got & {ids["c1"], ids["pod1"]}
    else:
        assert got == {ids[n] for n in pod}


def test_pod_cgroups_by_uid_for_each_driver(tree):
    ids, index = tree
    assert index.pod_cgroups(UID) == {ids[n] for n in ("pod1", "c1", "c2", "pause")}
    assert index.pod_cgroups(UID3) == {ids[n] for n in ("pod3", "c4", "c5")}
    assert index.pod_cgroups(UID4) == {ids[n] for n in ("pod4", "c6", "conmon")}
    assert index.pod_cgroups("0" * 8 + UID[8:]) == frozenset()        # not on this node


def test_a_container_that_starts_later_is_part_of_its_pod(tree, tmp_path):
    ids, index = tree
    assert ids["c2"] in index.same_pod(ids["c1"])
    late = tmp_path / slice_(UID) / f"cri-containerd-{'9' * 64}.scope"
    late.mkdir()
    assert os.stat(late).st_ino in index.same_pod(ids["c1"])
    assert os.stat(late).st_ino in index.pod_cgroups(UID)


def v1pod(uid: str, ips: list[str], host_ip: str = "192.168.7.2", host_network: bool = False):
    return client.V1Pod(
        metadata=client.V1ObjectMeta(uid=uid, name=f"pod-{uid[:4]}", namespace="ns"),
        spec=client.V1PodSpec(containers=[client.V1Container(name="c")], host_network=host_network),
        status=client.V1PodStatus(pod_ip=ips[0] if ips else None, host_ip=host_ip,
                                  pod_ips=[client.V1PodIP(ip=ip) for ip in ips]))


@pytest.fixture
def pods():
    w = PodWatcher("node-a")
    w._replace(dict(_pod_info(p) for p in (
        v1pod(UID, ["10.1.0.5", "fd00::5"]),
        v1pod(UID3, ["10.1.0.7"]),
        v1pod(UID2, ["192.168.7.2"], host_network=True),     # hostNetwork: the node's address
        v1pod(UID4, ["192.168.7.2"]),                        # its IP is the node's: names no pod
        v1pod("0" * 8 + UID[8:], ["10.1.0.9"]),              # no cgroup on this node
    )))
    return w


def owners_of(table: dict):
    """A stand-in of SpanCtxProbe.sock_owner over a dict (the kernel side is
    tested against the real map in tests/kernel/test_senders.py)."""
    return lambda peer, local: table.get((peer, local))


def peer(host: str, port: int = 40000, local: str = "192.168.7.2", transport: str = "http") -> Peer:
    return Peer(transport, host, port, local, 4318)


def test_the_connecting_process_names_its_whole_pod(tree, pods):
    ids, index = tree
    senders = SenderOrigins(index, pods, owners_of({
        (("10.1.0.5", 40000), ("192.168.7.2", 4318)): (ids["c2"], 4242),
        (("127.0.0.1", 40001), ("127.0.0.1", 4318)): (ids["svc"], 77)}))
    # the socket wins over the pod IP (here the same pod), and over the payload: there is none
    assert senders.origin(peer("10.1.0.5")) == {ids[n] for n in ("pod1", "c1", "c2", "pause")}
    assert senders.origin(peer("127.0.0.1", 40001, "127.0.0.1")) == {ids["svc"]}
    assert senders.counts() == {BY_SOCKET: 2, BY_POD_IP: 0, UNKNOWN: 0}


def test_without_the_kernel_a_pod_ip_names_its_pod(tree, pods):
    ids, index = tree
    for owners in (None, owners_of({})):     # no probe; a connection the kernel did not see
        senders = SenderOrigins(index, pods, owners)
        assert senders.origin(peer("10.1.0.5")) == {ids[n] for n in ("pod1", "c1", "c2", "pause")}
        assert senders.origin(peer("fd00::5")) == {ids[n] for n in ("pod1", "c1", "c2", "pause")}
        assert senders.origin(peer("10.1.0.7")) == {ids[n] for n in ("pod3", "c4", "c5")}
        assert senders.counts() == {BY_SOCKET: 0, BY_POD_IP: 3, UNKNOWN: 0}


@pytest.mark.parametrize("host", [
    "192.168.7.2",      # the node's own address: hostNetwork pods, SNAT, the node itself
    "10.1.0.9",         # a pod's IP, but the pod has no cgroup here
    "10.9.9.9",         # nobody this node knows (a remote host, or behind NAT)
    "127.0.0.1",        # loopback the kernel did not see connect
])
def test_a_sender_that_cannot_be_established_is_unknown(tree, pods, host):
    ids, index = tree
    senders = SenderOrigins(index, pods, owners_of({}))
    assert senders.origin(peer(host)) is None
    assert senders.origin(None) is None       # not an IP connection (a unix socket)
    assert senders.counts() == {BY_SOCKET: 0, BY_POD_IP: 0, UNKNOWN: 2}


def test_no_cluster_no_kernel_is_unknown(tree):
    _, index = tree
    senders = SenderOrigins(index, None)
    assert senders.origin(peer("10.1.0.5")) is None
    assert senders.counts()[UNKNOWN] == 1


def test_grpc_peers():
    assert split_grpc_peer("ipv4:10.1.2.3:4711") == ("10.1.2.3", 4711)
    assert split_grpc_peer("ipv6:[::ffff:10.1.2.3]:4711") == ("10.1.2.3", 4711)
    assert split_grpc_peer("ipv6:[FD00::5]:1") == ("fd00::5", 1)
    assert split_grpc_peer("unix:/run/x.sock") is None
    assert grpc_peer("unix:/run/x.sock", "127.0.0.1", 4317) is None
    assert grpc_peer("ipv4:10.1.2.3:4711", "10.0.0.1", 4317) == Peer("grpc", "10.1.2.3", 4711,
                                                                     "10.0.0.1", 4317)
    # a wildcard bind: the receiver's own address is not known from the call
    assert grpc_peer("ipv4:10.1.2.3:4711", "0.0.0.0", 4317).local_host == ""
    assert grpc_peer("ipv6:[::1]:4711", "::", 4317).local_host == ""


@pytest.mark.parametrize("family, host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_the_receivers_own_address_of_a_connection_from_the_kernels_list(family, host):
    with socket.socket(family) as srv, socket.socket(family) as cli:
        srv.bind((host, 0))
        srv.listen()
        cli.connect(srv.getsockname()[:2])
        conn, _ = srv.accept()
        with conn:
            cport = cli.getsockname()[1]
            assert local_host_of(host, cport, srv.getsockname()[1]) == host
            assert local_host_of(host, cport, srv.getsockname()[1] ^ 1) == ""


def test_a_wildcard_grpc_connection_is_found_by_its_local_address(tree, tmp_path):
    """gRPC on 0.0.0.0 names no local address: it is read from the socket
    list (an IPv4 line of /proc/net/tcp: 10.1.0.5:40000 → 192.168.7.2:4317)."""
    ids, index = tree
    net = tmp_path / "net"
    net.mkdir()
    (net / "tcp").write_text(
        "  sl  local_address rem_address   st\n"
        "   0: 0207A8C0:10DD 0500010A:9C40 01 00000000:00000000\n")
    seen = []

    def owners(peer_, local):
        seen.append((peer_, local))
        return (ids["c1"], 1) if local == ("192.168.7.2", 4317) else None

    senders = SenderOrigins(index, None, owners, proc_net=str(net))
    p = Peer("grpc", "10.1.0.5", 40000, "", 4317)
    assert senders.origin(p) == {ids[n] for n in ("pod1", "c1", "c2", "pause")}
    (net / "tcp").write_text("  sl  local_address rem_address   st\n")
    assert senders.origin(p) == {ids[n] for n in ("pod1", "c1", "c2", "pause")}   # kept per connection
    assert seen == [(("10.1.0.5", 40000), ("192.168.7.2", 4317))] * 2
