"""Pod names from a Kubernetes API server: the official client against a
test server that speaks the real list and watch protocol (no cluster here)."""

import json
import threading
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client

from spanlet.cgroups import CgroupIndex
from spanlet.k8s import K8sEnricher, PodWatcher
from loopback_http import LoopbackHttp, QuietHandler

UID = "5c1e3f4a-1b2c-4d5e-8f90-0123456789ab"
UID2 = "0a1e3f4a-1b2c-4d5e-8f90-0123456789ff"
CID = "ab" * 32


def pod(uid, name, ns="serving", cid=CID, container="vision", ips=(), host_network=False):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": uid, "resourceVersion": "10"},
            "spec": {"nodeName": "node-a", "containers": [{"name": container, "image": "x"}],
                     "hostNetwork": host_network},
            "status": {"phase": "Running", "hostIP": "192.168.7.2",
                       **({"podIP": ips[0], "podIPs": [{"ip": ip} for ip in ips]} if ips else {}),
                       "containerStatuses": [{
                "name": container, "containerID": f"containerd://{cid}", "image": "x",
                "imageID": "x", "ready": True, "restartCount": 0, "state": {}}]}}


class FakeApi(QuietHandler):
    """HTTP/1.1: the watch is a chunked stream, as the API server sends it."""
    queries: list = []
    watch_events: list = []
    release = threading.Event()

    def do_GET(self):
        q = parse_qs(urlparse(self.path).query)
        FakeApi.queries.append((urlparse(self.path).path, q))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if q.get("watch") == ["true"]:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for ev in FakeApi.watch_events:
                line = (json.dumps(ev) + "\n").encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            FakeApi.release.wait(5)
            self.wfile.write(b"0\r\n\r\n")
            return
        body = json.dumps({"apiVersion": "v1", "kind": "PodList",
                           "metadata": {"resourceVersion": "10"},
                           "items": [pod(UID, "asr-0")]}).encode()
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def api():
    FakeApi.queries, FakeApi.release = [], threading.Event()
    FakeApi.watch_events = [
        {"type": "ADDED", "object": pod(UID2, "vlm-1", cid="cd" * 32, container="llm")},
        {"type": "DELETED", "object": pod(UID, "asr-0")},
    ]
    srv = LoopbackHttp(FakeApi)
    conf = client.Configuration(host=f"http://127.0.0.1:{srv.port}")
    yield client.CoreV1Api(client.ApiClient(conf))
    FakeApi.release.set()
    srv.close()


def wait_for(pred, timeout=5.0):
    ev = threading.Event()
    for _ in range(int(timeout / 0.05)):
        if pred():
            return True
        ev.wait(0.05)
    return False


def test_list_then_watch_pods_of_this_node(api):
    w = PodWatcher("node-a", api=api)
    assert w.start()
    try:
        assert w.synced.wait(5)
        assert wait_for(lambda: UID2 in w.pods and UID not in w.pods)
        assert w.pods[UID2].name == "vlm-1" and w.pods[UID2].containers == {"cd" * 32: "llm"}
        paths = [p for p, _ in FakeApi.queries]
        assert set(paths) == {"/api/v1/pods"}
        for _, q in FakeApi.queries:               # this node only, every time
            assert q["fieldSelector"] == ["spec.nodeName=node-a"]
        assert any(q.get("watch") == ["true"] for _, q in FakeApi.queries)
    finally:
        FakeApi.release.set()
        w.stop()


def test_enricher_names_pod_namespace_and_container(api, tmp_path):
    leaf = tmp_path / "kubepods" / f"pod{UID}" / CID
    leaf.mkdir(parents=True)
    w = PodWatcher("node-a", api=api)
    FakeApi.watch_events = []
    w.start()
    try:
        assert w.synced.wait(5)
        e = K8sEnricher("node-a", CgroupIndex(root=tmp_path, rescan_s=0), w)
        assert e.attributes(leaf.stat().st_ino) == {
            "k8s.node.name": "node-a", "container.id": CID, "k8s.pod.uid": UID,
            "k8s.pod.name": "asr-0", "k8s.namespace.name": "serving",
            "k8s.container.name": "vision"}
        assert e.attributes(1) == {"k8s.node.name": "node-a"}
    finally:
        FakeApi.release.set()
        w.stop()


def test_not_in_cluster_is_not_an_error(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert PodWatcher("node-a").start() is False


def test_pod_ips_follow_the_watch_and_host_network_pods_have_none(api):
    FakeApi.watch_events = [
        {"type": "ADDED", "object": pod(UID2, "vlm-1", ips=["10.1.0.5", "fd00::5"])},
        {"type": "ADDED", "object": pod("1" * 8 + UID[8:], "agent", ips=["192.168.7.2"],
                                        host_network=True)},
        {"type": "MODIFIED", "object": pod(UID2, "vlm-1", ips=["10.1.0.6"])},   # a new IP
        {"type": "ADDED", "object": pod("2" * 8 + UID[8:], "gone", ips=["10.1.0.8"])},
        {"type": "DELETED", "object": pod("2" * 8 + UID[8:], "gone", ips=["10.1.0.8"])},
    ]
    w = PodWatcher("node-a", api=api)
    w.start()
    try:
        assert w.synced.wait(5)
        assert wait_for(lambda: w.pod_of_ip("10.1.0.6") == UID2 and "2" * 8 + UID[8:] not in w.pods)
        assert w.pod_of_ip("10.1.0.5") is None and w.pod_of_ip("fd00::5") is None
        assert w.pod_of_ip("192.168.7.2") is None        # the node's address names no pod
        assert w.pod_of_ip("10.1.0.8") is None
    finally:
        FakeApi.release.set()
        w.stop()
