"""OTLP wire names shared by the receiver and the exporters: the protobuf
content type, the gRPC status-details trailer and the signals' HTTP paths."""

from __future__ import annotations

PROTOBUF = "application/x-protobuf"
# gRPC carries google.rpc.Status (with RetryInfo) in this trailer.
STATUS_DETAILS_KEY = "grpc-status-details-bin"
TRACES_PATH = "/v1/traces"
METRICS_PATH = "/v1/metrics"

