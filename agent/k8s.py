"""Kubernetes names for kernel facts: cgroup id → container id and pod UID
(agent/cgroups.py) → pod name, namespace and container name from the API
server, for the pods of this node only, kept current by one watch; and pod
IP → pod UID, for telling which pod sent a connection."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

from spanlet.cgroups import CgroupIndex

log = logging.getLogger(__name__)


@dataclass
class PodInfo:
    name: str
    namespace: str
    # container id (runtime prefix stripped) → container name
    containers: dict[str, str] = field(default_factory=dict)
    # the pod's own IPs (status.podIPs); none for a hostNetwork pod, whose
    # address is the node's and so names no one pod
    ips: tuple[str, ...] = ()


def _pod_info(pod) -> tuple[str, PodInfo]:
    """(uid, PodInfo) of a V1Pod."""
    containers: dict[str, str] = {}
    status = pod.status
    for group in (status.container_statuses if status else None,
                  status.init_container_statuses if status else None):
        for cs in group or []:
            if cs.container_id:
                containers[cs.container_id.split("://", 1)[-1]] = cs.name
    return pod.metadata.uid, PodInfo(pod.metadata.name, pod.metadata.namespace, containers,
                                     _pod_ips(pod))


def _pod_ips(pod) -> tuple[str, ...]:
    """status.podIPs (status.podIP where the list is absent), less any that is
    the node's own address (status.hostIP: a hostNetwork pod's)."""
    spec, status = pod.spec, pod.status
    if status is None or (spec is not None and spec.host_network):
        return ()
    ips = [p.ip for p in status.pod_ips or [] if p.ip] or ([status.pod_ip] if status.pod_ip else [])
    host = {status.host_ip, *(h.ip for h in status.host_ips or [])}
    return tuple(ip for ip in ips if ip not in host)


class PodWatcher:
    """Pods of one node by UID, from a list then a watch (re-listed when the
    watch ends or its resourceVersion expires). Not started outside a cluster."""

    def __init__(self, node_name: str, api=None, watch_timeout_s: int = 300):
        self.node_name = node_name
        self.api = api
        self.watch_timeout_s = watch_timeout_s
        self.pods: dict[str, PodInfo] = {}
        self._by_ip: dict[str, str] = {}          # pod IP -> pod uid
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch = None

    @staticmethod
    def in_cluster() -> bool:
        return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))

    def start(self) -> bool:
        if self.api is None:
            if not self.in_cluster():
                log.info("k8s: not running in a cluster; pod names come from nowhere")
                return False
            from kubernetes import client, config as kconfig
            kconfig.load_incluster_config()
            self.api = client.CoreV1Api()
        self._thread = threading.Thread(target=self._run, name="k8s-pods", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        from kubernetes import watch

        selector = f"spec.nodeName={self.node_name}"
        while not self._stop.is_set():
            try:
                listed = self.api.list_pod_for_all_namespaces(field_selector=selector)
                self._replace(dict(_pod_info(p) for p in listed.items))
                self.synced.set()
                self._watch = watch.Watch()
                for item in self._watch.stream(self.api.list_pod_for_all_namespaces,
                                               field_selector=selector,
                                               resource_version=listed.metadata.resource_version,
                                               timeout_seconds=self.watch_timeout_s):
                    if self._stop.is_set():
                        break
                    uid, info = _pod_info(item["object"])
                    self._put(uid, None if item["type"] == "DELETED" else info)
            except Exception as e:  # API errors, expired versions, network: re-list
                if self._stop.is_set():
                    break
                log.warning("k8s: pod watch failed (%s); re-listing in 2 s", e)
                self._stop.wait(2)


    def _replace(self, pods: dict[str, PodInfo]) -> None:
        self._by_ip = {ip: uid for uid, info in pods.items() for ip in info.ips}
        self.pods = pods

    def _put(self, uid: str, info: PodInfo | None) -> None:
        """A pod added or changed (info), or deleted (None)."""
        old = self.pods.pop(uid, None) if info is None else self.pods.get(uid)
        for ip in old.ips if old else ():
            if self._by_ip.get(ip) == uid:
                del self._by_ip[ip]
        if info is not None:
            self.pods[uid] = info
            self._by_ip.update((ip, uid) for ip in info.ips)

    def pod_of_ip(self, ip: str) -> str | None:
        """The uid of this node's pod that has `ip` as its own address."""
        return self._by_ip.get(ip)


class K8sEnricher:
    """OTel resource attributes for a cgroup id."""

    def __init__(self, node_name: str, cgroups: CgroupIndex | None = None,
                 pods: PodWatcher | None = None):
        self.node_name = node_name
        self.cgroups = cgroups or CgroupIndex()
        self.pods = pods

    def attributes(self, cgroup_id: int) -> dict[str, str]:
        out = {"k8s.node.name": self.node_name}
        c = self.cgroups.container(cgroup_id)
        if c.container_id:
            out["container.id"] = c.container_id
        if c.pod_uid:
            out["k8s.pod.uid"] = c.pod_uid
            info = self.pods.pods.get(c.pod_uid) if self.pods else None
            if info is not None:
                out["k8s.pod.name"] = info.name
                out["k8s.namespace.name"] = info.namespace
                name = info.containers.get(c.container_id)
                if name:
                    out["k8s.container.name"] = name
        return out
