"""How OTLP is sent: one Export over gRPC or HTTP/protobuf, its answer classified as the specification
says (success, partial, retryable with the server's delay, final), the retry policy and the exporters' books."""

from __future__ import annotations

import email.utils
import gzip
import logging
import math
import time
from dataclasses import dataclass

import grpc
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from spanlet.config import ConfigError
from spanlet.exporters.batching import EXPORTED, GAVE_UP, SHUTDOWN, Backoff, ExportResult
from spanlet.exporters.otlp.common import METRICS_GRPC_METHOD, PROTOBUF, STATUS_DETAILS_KEY, TRACES_GRPC_METHOD
from spanlet.exporters.otlp.upstream import GRPC, Upstream
from spanlet.exporters.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

USER_AGENT = "spanlet-otlp-exporter"

# Backoff between retries of one batch: initial * 2**attempt, capped, times
# a jitter factor drawn from JITTER so that agents do not retry in step.
INITIAL_BACKOFF_S = 1.0
MAX_BACKOFF_S = 32.0
JITTER = (0.8, 1.2)

# Per signal: the gRPC Export method, its response, and the count in the
# response's partial_success.
SIGNALS = {
    "traces": (TRACES_GRPC_METHOD, ExportTraceServiceResponse, "rejected_spans"),
    "metrics": (METRICS_GRPC_METHOD, ExportMetricsServiceResponse, "rejected_data_points"),
}

# OTLP/gRPC: retryable codes. RESOURCE_EXHAUSTED only with RetryInfo.
RETRYABLE_GRPC = frozenset({
    grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
})
# OTLP/HTTP: retryable statuses; every other 4xx/5xx is final.
RETRYABLE_HTTP = frozenset({429, 502, 503, 504})


@dataclass
class SendResult(ExportResult):
    rejected: int = 0                    # partial success: items (spans, points) refused


def _read_file(path: str) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"OTLP export TLS file {path!r} "
                          "(OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]CERTIFICATE/CLIENT_KEY/CLIENT_CERTIFICATE): "
                          f"{e.strerror}") from None


def retry_info_delay(status_bytes: bytes) -> float | None:
    """RetryInfo.retry_delay (seconds) from a serialized google.rpc.Status, if any."""
    try:
        st = status_pb2.Status.FromString(status_bytes)
    except Exception:
        return None
    for detail in st.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info.retry_delay.ToNanoseconds() / 1e9
    return None


def _wire(request: Message | bytes) -> bytes:
    """A request's bytes: a batch already serialized as it is, a message serialized."""
    return request if isinstance(request, bytes) else request.SerializeToString()


class _GrpcTransport:
    """One signal's Export over gRPC: `method` is its path, `response_cls`
    its response and `rejected_field` the count in that response's
    partial_success. A request goes as its bytes (a message is serialized
    here, a batch already serialized is sent as it is)."""

    def __init__(self, up: Upstream, method: str = TRACES_GRPC_METHOD,
                 response_cls=ExportTraceServiceResponse, rejected_field: str = "rejected_spans", *,
                 initial_backoff_s: float = INITIAL_BACKOFF_S,
                 max_backoff_s: float = MAX_BACKOFF_S) -> None:
        # Retries are ours (with the spec's rules); grpc's own stay off. Its
        # reconnection backoff follows ours: left at grpc's default (up to
        # 120 s) a channel that lost its upstream for a few minutes keeps
        # failing every send fast for up to two minutes after the upstream
        # came back, and batches run out of max_retry_s in the meantime.
        initial_ms = max(1, int(initial_backoff_s * 1000))
        options = [("grpc.enable_retries", 0),
                   ("grpc.initial_reconnect_backoff_ms", initial_ms),
                   ("grpc.max_reconnect_backoff_ms", max(initial_ms, int(max_backoff_s * 1000)))]
        compression = grpc.Compression.Gzip if up.compression == "gzip" else grpc.Compression.NoCompression
        if up.insecure:
            self._channel = grpc.insecure_channel(up.endpoint, options=options, compression=compression)
        else:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read_file(up.certificate),
                private_key=_read_file(up.client_key),
                certificate_chain=_read_file(up.client_certificate))
            self._channel = grpc.secure_channel(up.endpoint, creds, options=options,
                                                compression=compression)
        self._export = self._channel.unary_unary(method, request_serializer=None,
                                                 response_deserializer=response_cls.FromString)
        self._metadata = up.headers
        self._rejected_field = rejected_field

    def send(self, request: Message | bytes, timeout_s: float) -> SendResult:
        """One Export call of `request`, a message or its bytes (sent as they are)."""
        try:
            response = self._export(_wire(request), timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
            delay = None
            for key, value in (e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else ():
                if key == STATUS_DETAILS_KEY:
                    delay = retry_info_delay(value)
            retryable = code in RETRYABLE_GRPC or (
                code == grpc.StatusCode.RESOURCE_EXHAUSTED and delay is not None)
            details = e.details() if hasattr(e, "details") else str(e)
            return SendResult(False, retryable, delay, message=f"gRPC {code.name}: {details}")
        ps = response.partial_success
        return SendResult(True, rejected=getattr(ps, self._rejected_field), message=ps.error_message)

    def close(self) -> None:
        self._channel.close()


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from an HTTP Retry-After (delay-seconds or HTTP-date)."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class _HttpTransport:
    """One signal's Export over HTTP/protobuf: `response_cls` is its Export
    response and `rejected_field` the count in its partial_success."""

    def __init__(self, up: Upstream, response_cls: type[Message] = ExportTraceServiceResponse,
                 rejected_field: str = "rejected_spans") -> None:
        self._response_cls, self._rejected_field = response_cls, rejected_field
        self._url = up.endpoint
        self._gzip = up.compression == "gzip"
        import requests     # here: an agent with no HTTP upstream (the default) never loads it (35 ms of a start)
        self._session = requests.Session()
        self._session.headers.update({"Content-Type": PROTOBUF, "User-Agent": USER_AGENT})
        if self._gzip:
            self._session.headers["Content-Encoding"] = "gzip"
        self._session.headers.update(dict(up.headers))
        for path in (up.certificate, up.client_key, up.client_certificate):
            _read_file(path)            # unreadable is a configuration error, now
        if up.certificate:
            self._session.verify = up.certificate
        if up.client_certificate and up.client_key:
            self._session.cert = (up.client_certificate, up.client_key)

    def send(self, request: Message | bytes, timeout_s: float) -> SendResult:
        body = _wire(request)
        if self._gzip:
            body = gzip.compress(body, compresslevel=6)
        import requests     # loaded by __init__ already
        try:
            r = self._session.post(self._url, data=body, timeout=timeout_s)
        except (requests.ConnectionError, requests.Timeout) as e:
            return SendResult(False, True, message=f"HTTP {type(e).__name__}: {e}")
        except requests.RequestException as e:
            return SendResult(False, False, message=f"HTTP {type(e).__name__}: {e}")
        if 200 <= r.status_code < 300:
            rejected, message = 0, ""
            if r.content and r.headers.get("Content-Type", "").startswith(PROTOBUF):
                try:
                    ps = self._response_cls.FromString(r.content).partial_success
                    rejected, message = getattr(ps, self._rejected_field), ps.error_message
                except Exception:
                    pass
            return SendResult(True, rejected=rejected, message=message)
        message = r.text[:200]
        if r.headers.get("Content-Type", "").startswith(PROTOBUF):
            try:
                message = status_pb2.Status.FromString(r.content).message
            except Exception:
                pass
        return SendResult(False, r.status_code in RETRYABLE_HTTP,
                          parse_retry_after(r.headers.get("Retry-After")),
                          message=f"HTTP {r.status_code}: {message}")

    def close(self) -> None:
        self._session.close()


# ---------------------------------------------------------------------------
# Sending one request until it gets a final answer (both signals).

# ---------------------------------------------------------------------------
# One signal's export(batch) for the batching worker, and its books.

@dataclass
class OtlpBatch:
    request: Message | bytes | None     # None: the metrics collection it stands for is not made yet
    n: int = 0                  # items (spans, data points) in it


@dataclass
class _Counters:
    exported: int = 0                 # items (spans, data points) the upstream took
    rejected_upstream: int = 0        # items refused in a partial success
    dropped_queue_full: int = 0
    dropped_failed: int = 0           # non-retryable answer, or retries ran out
    dropped_shutdown: int = 0         # still queued at the shutdown deadline, or sent after it
    batches: int = 0                  # requests that got a final answer
    requests_exported: int = 0
    requests_failed: int = 0          # requests dropped (failed, or cut by the shutdown deadline)
    settled: int = 0                  # items with a final fate (exported, rejected or dropped)

    def settle(self, n: int, outcome: str, rejected: int = 0) -> None:
        if outcome == EXPORTED:
            self.exported += n - rejected
            self.rejected_upstream += rejected
            self.batches += 1
            self.requests_exported += 1
        elif outcome == SHUTDOWN:
            self.dropped_shutdown += n
            self.requests_failed += 1
        else:
            self.dropped_failed += n
            self.batches += 1
            self.requests_failed += 1
        self.settled += n


class OtlpSender:
    """One signal's transport to `upstream` (gRPC or HTTP/protobuf) as the
    batching worker's export(batch, timeout_s), and settle(), which counts
    what became of a batch (in `unit`s, the word the log lines use) in
    `counters`. The owner calls settle under the worker's condition."""

    def __init__(self, upstream: Upstream, signal: str = "traces", *,
                 initial_backoff_s: float = INITIAL_BACKOFF_S, max_backoff_s: float = MAX_BACKOFF_S,
                 unit: str = "spans", what: str = "OTLP export", logger: logging.Logger = log) -> None:
        method, response_cls, rejected_field = SIGNALS[signal]
        if upstream.protocol == GRPC:
            self.transport = _GrpcTransport(upstream, method, response_cls, rejected_field,
                                            initial_backoff_s=initial_backoff_s, max_backoff_s=max_backoff_s)
        else:
            self.transport = _HttpTransport(upstream, response_cls, rejected_field)
        self.upstream = upstream
        self._initial_backoff_s, self._max_backoff_s = initial_backoff_s, max_backoff_s
        self._unit, self._what = unit, what
        self._ratelog = RateLimitedLog(logger)
        self.counters = _Counters()

    def backoff(self, max_retry_s: float) -> Backoff:
        """The OTLP retry policy: exponential backoff, JITTER, for max_retry_s."""
        return Backoff(self._initial_backoff_s, self._max_backoff_s, JITTER, max_retry_s)

    def export(self, batch: OtlpBatch, timeout_s: float | None) -> SendResult:
        timeout = self.upstream.timeout_s if timeout_s is None else min(self.upstream.timeout_s, timeout_s)
        result = self.transport.send(batch.request, timeout)
        if result.ok and (result.rejected or result.message):
            self._ratelog(logging.WARNING, "partial", "OTLP upstream rejected %d of %d %s: %s",
                          result.rejected, batch.n, self._unit, result.message)
        return result

    def settle(self, batch: OtlpBatch, outcome: str, result: SendResult | None) -> None:
        if outcome == GAVE_UP:
            self._ratelog(logging.WARNING, "gave_up", "%s of %d %s dropped, retries ran out: %s",
                          self._what, batch.n, self._unit, result.message)
        elif outcome != EXPORTED and outcome != SHUTDOWN:
            self._ratelog(logging.WARNING, "final", "%s of %d %s refused, dropped: %s",
                          self._what, batch.n, self._unit, result.message if result else "export failed")
        rejected = min(getattr(result, "rejected", 0), batch.n) if outcome == EXPORTED else 0
        self.counters.settle(batch.n, outcome, rejected)

    def close(self) -> None:
        self.transport.close()
