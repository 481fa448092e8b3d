"""The span path: OTLP spans received, joined to the kernel facts of their
threads (those of the sender's own pod: senders.py), their requests' totals
summed (request_totals.py), named after their Kubernetes workload, and
exported upstream."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet.config import Config
from spanlet.join import SpanJoin
from spanlet.k8s import K8sEnricher, PodWatcher
from spanlet.pipeline.senders import SenderOrigins
from spanlet.request_totals import RequestTotals

from spanlet.exporters.otlp.span_exporter import OtlpSpanExporter
from spanlet.exporters.otlp.receiver import OtlpReceiver
from spanlet.exporters.otlp.trust import Peer

log = logging.getLogger("spanlet")


class SpanPath:
    """OTLP spans in → kernel facts joined → request totals → k8s resource
    names → the serving metrics and the store (on_joined), and upstream."""

    def __init__(self, cfg: Config, on_joined: Callable[[list, list | None], None] | None = None):
        self.cfg = cfg
        self.on_joined = on_joined
        self.exporter = OtlpSpanExporter(cfg.otlp)
        self.join = SpanJoin(cfg.join, on_late=self._export_late)
        j = cfg.join
        self.request_totals = RequestTotals(j.request_totals_max_traces, j.request_totals_max_subtrees,
                                            j.request_totals_max_subtrees_per_trace, j.request_totals_ttl_s)
        self.pods = PodWatcher(cfg.node_name)
        self.enricher = K8sEnricher(cfg.node_name, pods=self.pods)
        self.senders = SenderOrigins(self.enricher.cgroups, self.pods)
        self.receiver = OtlpReceiver(cfg.otlp, self.on_request)
        self.receiver.origins = self.senders.counts
        # requests held back for their batched steps: (due, request, cgroups, held, origin), in due order
        self._held: deque = deque()
        self._held_cv = threading.Condition()
        self._releaser: threading.Thread | None = None
        self._stopping = False
        # Called before each request's join: the daemon drains the probes'
        # rings there, so that the sampled records of the request's spans
        # (written by the kernel before the spans ended) are in the join
        # before their spans, not after them at the read loop's next wake-up.
        self.before_join: Callable[[], None] | None = None

    def start(self) -> None:
        self.pods.start()
        try:
            self.receiver.start()
        except OSError as e:
            # Kernel facts are still worth having: say so loudly, keep going.
            log.error("OTLP receiver NOT started: %s; spans cannot be joined", e)
            return
        log.info("OTLP receiver on %s: gRPC %d, HTTP %d; upstream export %s",
                 self.cfg.otlp.receiver_address, self.receiver.grpc_port, self.receiver.http_port,
                 "on" if self.exporter.enabled else "off (no endpoint configured)")

    def watch_senders(self, span_ctx) -> None:
        """The span_ctx probe (attached) names the process that opened each
        connection to the receiver's ports from now on."""
        span_ctx.watch_ports([self.receiver.grpc_port, self.receiver.http_port])
        self.senders.owners = span_ctx.sock_owner

    def on_request(self, request: ExportTraceServiceRequest, peer: Peer | None = None) -> int:
        held: list = []
        blobs: list = []
        origin = self.senders.origin(peer)
        if self.before_join is not None:
            self.before_join()
        cgroups = self.join.join(request.resource_spans, held, origin=origin, blobs=blobs)
        if held:
            self._hold(request, cgroups, held, origin)
        else:
            self._finish(request, cgroups, blobs, origin)
        return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)

    def _finish(self, request: ExportTraceServiceRequest, cgroups: list[int], blobs: list | None = None,
                origin=None) -> None:
        """The joined spans summed into their requests (on the resource as it
        came: it names the process), named and passed on; `blobs` the join's
        bytes of them (SpanJoin.join), None for spans changed since (held
        ones), made current by the request totals."""
        resource_spans = request.resource_spans
        if blobs is None:
            blobs = [None] * len(resource_spans)
        self.request_totals.apply(resource_spans, blobs, origin)
        for rs, cgroup in zip(resource_spans, cgroups):
            self._name_resource(rs, cgroup)
        if self.on_joined is not None:
            self.on_joined(resource_spans, blobs)
        self.exporter.export(resource_spans)

    # -- requests held back for their batched steps (only once a step was seen) ------
    def _hold(self, request, cgroups: list[int], held: list, origin=None) -> None:
        """The whole export request waits join.batch_wait_s (its request spans
        for their steps), then goes on as any other; one thread releases them,
        started on the first hold."""
        with self._held_cv:
            if self._stopping:
                due = 0.0
            else:
                due = time.monotonic() + self.cfg.join.batch_wait_s
            self._held.append((due, request, cgroups, held, origin))
            if self._releaser is None:
                self._releaser = threading.Thread(target=self._release_loop, name="spanlet-batch-hold",
                                                  daemon=True)
                self._releaser.start()
            self._held_cv.notify()

    def _release_loop(self) -> None:
        while True:
            with self._held_cv:
                while True:
                    if self._held and (self._stopping or self._held[0][0] <= time.monotonic()):
                        entry = self._held.popleft()
                        break
                    if self._stopping:
                        return
                    self._held_cv.wait(self._held[0][0] - time.monotonic() if self._held else None)
            self._release(*entry[1:])

    def _release(self, request, cgroups: list[int], held: list, origin=None) -> None:
        try:
            self.join.release(held)
            self._finish(request, cgroups, None, origin)
        except Exception:
            log.exception("releasing held spans failed")

    def held_requests(self) -> int:
        """Export requests held back for their steps now."""
        with self._held_cv:
            return len(self._held)

    def release_held(self) -> None:
        """Every held request goes on now (the agent's stop)."""
        with self._held_cv:
            self._stopping = True
            self._held_cv.notify()
            releaser = self._releaser
        if releaser is not None:
            releaser.join(5.0)
        with self._held_cv:                   # what the thread did not reach
            rest, self._held = list(self._held), deque()
        for entry in rest:
            self._release(*entry[1:])

    def _name_resource(self, rs: trace_pb2.ResourceSpans, cgroup_id: int) -> None:
        """Kubernetes names of where the kernel events came from, unless the
        resource already carries them (the SDK or a collector set them)."""
        have = {kv.key for kv in rs.resource.attributes}
        attrs = self.enricher.attributes(cgroup_id) if cgroup_id > 1 else \
            {"k8s.node.name": self.cfg.node_name}
        for key, value in attrs.items():
            if key not in have:
                rs.resource.attributes.append(KeyValue(key=key, value=AnyValue(string_value=value)))

    def _export_late(self, records: list[tuple[int, trace_pb2.ResourceSpans]]) -> None:
        for cgroup, rs in records:
            self._name_resource(rs, cgroup)
        self.exporter.export([rs for _, rs in records])

    def tick(self) -> None:
        """Periodic: sweep the span facts map (rate-limited by the join) and
        send what came late."""
        self.join.sweep()
        self.join.flush_late()

    def stop(self, deadline: float) -> None:
        """Receiver first (no new spans), then what is late, then the export queue."""
        self.receiver.stop(grace=min(1.0, max(0.0, deadline - time.monotonic())))
        self.pods.stop()
        self.release_held()
        self.join.flush_late()
        remaining_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
        self.exporter.shutdown(timeout_millis=remaining_ms)
