"""OTLP wire names shared by the receiver and the exporters: the protobuf
content type, the gRPC status-details trailer, the signals' HTTP paths and
gRPC methods, and protobuf's varint."""

from __future__ import annotations

PROTOBUF = "application/x-protobuf"
# gRPC carries google.rpc.Status (with RetryInfo) in this trailer.
STATUS_DETAILS_KEY = "grpc-status-details-bin"
TRACES_PATH = "/v1/traces"
METRICS_PATH = "/v1/metrics"
TRACES_GRPC_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
TRACES_GRPC_METHOD = f"/{TRACES_GRPC_SERVICE}/Export"
METRICS_GRPC_METHOD = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"


def varint(n: int) -> bytes:
    """Protobuf's encoding of a non-negative int (a length, a tag), as
    ClickHouse's VarUInt too."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
