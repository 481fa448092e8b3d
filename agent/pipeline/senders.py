"""Who sent an OTLP request, from its connection alone (never from what the
payload claims): the cgroups whose kernel facts its spans may get (the join's
`origin`). The connecting process, where the kernel saw it connect
(sock_owner of the span_ctx probe), and every cgroup of its pod; else the pod
whose own IP the connection came from; else nobody (None: unknown)."""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from typing import Callable

from spanlet.cgroups import CgroupIndex
from spanlet.exporters.otlp.trust import Peer, local_host_of
from spanlet.k8s import PodWatcher

# How an origin was established (the `reason` of the self-metric).
BY_SOCKET, BY_POD_IP, UNKNOWN = "socket", "pod_ip", "unknown"
REASONS = (BY_SOCKET, BY_POD_IP, UNKNOWN)
# A pod's cgroups are looked at again after this long (its containers come and go).
POD_CGROUPS_TTL_S = 1.0
MAX_CACHED = 4096

# (peer (host, port), local (host, port)) -> (cgroup id, tgid) of the connecting process, or None
SockOwners = Callable[[tuple[str, int], tuple[str, int]], "tuple[int, int] | None"]


class _Bounded(OrderedDict):
    """The least recently used entries go past `limit`."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class SenderOrigins:
    """peer -> origin, counted by how it was established. `owners` is the
    span_ctx probe's sock_owner while that probe is attached (the daemon
    wires it), else None: then only the pod IP can name a sender."""

    def __init__(self, cgroups: CgroupIndex, pods: PodWatcher | None,
                 owners: SockOwners | None = None, proc_net: str = "/proc/self/net",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cgroups = cgroups
        self.pods = pods
        self.owners = owners
        self.proc_net = proc_net
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        # The kernel's entry is read on every request (a connection's port
        # may be reused by another process); what is slow to find is kept:
        # the receiver's own address of a gRPC connection (wildcard bind),
        # by connection, and the cgroups of a pod, for a second.
        self._local_hosts = _Bounded(MAX_CACHED)
        self._pods = _Bounded(MAX_CACHED)

    def origin(self, peer: Peer | None) -> frozenset[int] | None:
        reason, origin = self._establish(peer)
        with self._lock:
            self._counts[reason] += 1
        return origin

    def counts(self) -> dict[str, int]:
        """Requests by how their sender was established, since start."""
        with self._lock:
            return {r: self._counts.get(r, 0) for r in REASONS}

    def _establish(self, peer: Peer | None) -> tuple[str, frozenset[int] | None]:
        if peer is None:
            return UNKNOWN, None
        owner = self._socket_owner(peer)
        if owner is not None:
            cgroup = owner[0]
            return BY_SOCKET, self._cached(cgroup, lambda: self.cgroups.same_pod(cgroup))
        uid = self.pods.pod_of_ip(peer.host) if self.pods is not None else None
        if uid:
            cgroups = self._cached(("pod", uid), lambda: self.cgroups.pod_cgroups(uid))
            if cgroups:
                return BY_POD_IP, cgroups
        return UNKNOWN, None

    def _socket_owner(self, peer: Peer) -> tuple[int, int] | None:
        owners = self.owners
        if owners is None:
            return None
        local = peer.local_host or self._local_host(peer)
        return owners((peer.host, peer.port), (local, peer.local_port)) if local else None

    def _local_host(self, peer: Peer) -> str:
        key = peer.connection
        with self._lock:
            found = self._local_hosts.get(key)
        if found is None:
            found = local_host_of(peer.host, peer.port, peer.local_port, self.proc_net)
            if found:
                with self._lock:
                    self._local_hosts.put(key, found)
        return found

    def _cached(self, key, find: Callable[[], frozenset[int]]) -> frozenset[int]:
        """A pod's cgroups (by sending cgroup, or by pod uid), found again
        once POD_CGROUPS_TTL_S old."""
        now = self._clock()
        with self._lock:
            hit = self._pods.get(key)
        if hit is not None and now - hit[0] < POD_CGROUPS_TTL_S:
            return hit[1]
        found = find()
        with self._lock:
            self._pods.put(key, (now, found))
        return found
