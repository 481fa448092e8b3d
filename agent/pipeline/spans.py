"""The span path: OTLP spans received, joined to the kernel facts of their
threads, named after their Kubernetes workload, and exported upstream."""

from __future__ import annotations

import logging
import time
from typing import Callable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from spanlet.config import Config
from spanlet.join import SpanJoin
from spanlet.k8s import K8sEnricher, PodWatcher

from spanlet.exporters.otlp.span_exporter import OtlpSpanExporter
from spanlet.exporters.otlp.receiver import OtlpReceiver

log = logging.getLogger("spanlet")


class SpanPath:
    """OTLP spans in → k8s resource names and kernel facts joined → upstream."""

    def __init__(self, cfg: Config, on_joined: Callable[[list], None] | None = None):
        self.cfg = cfg
        self.on_joined = on_joined
        self.exporter = OtlpSpanExporter(cfg.otlp)
        self.join = SpanJoin(cfg.join, on_late=self._export_late)
        self.pods = PodWatcher(cfg.node_name)
        self.enricher = K8sEnricher(cfg.node_name, pods=self.pods)
        self.receiver = OtlpReceiver(cfg.otlp, self.on_request)

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

    def on_request(self, request: ExportTraceServiceRequest) -> int:
        cgroups = self.join.join(request.resource_spans)
        for rs, cgroup in zip(request.resource_spans, cgroups):
            self._name_resource(rs, cgroup)
        if self.on_joined is not None:
            self.on_joined(request.resource_spans)
        self.exporter.export(request.resource_spans)
        return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)

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
        self.join.flush_late()
        remaining_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
        self.exporter.shutdown(timeout_millis=remaining_ms)
