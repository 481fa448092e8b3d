"""How OTLP is sent: one Export request over gRPC or HTTP/protobuf, its
answer classified as the OTLP specification says (success, partial success,
retryable with the server's delay, final), and the retrying sender."""

from __future__ import annotations

import email.utils
import gzip
import logging
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import grpc
import requests
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

from spanlet.config import ConfigError
from spanlet.exporters.otlp.common import PROTOBUF, STATUS_DETAILS_KEY
from spanlet.exporters.otlp.upstream import Upstream
from spanlet.exporters.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

USER_AGENT = "spanlet-otlp-exporter"

# Backoff between retries of one batch: initial * 2**attempt, capped, times
# a jitter factor drawn from JITTER so that agents do not retry in step.
INITIAL_BACKOFF_S = 1.0
MAX_BACKOFF_S = 32.0
JITTER = (0.8, 1.2)

# OTLP/gRPC: retryable codes. RESOURCE_EXHAUSTED only with RetryInfo.
RETRYABLE_GRPC = frozenset({
    grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
})
# OTLP/HTTP: retryable statuses; every other 4xx/5xx is final.
RETRYABLE_HTTP = frozenset({429, 502, 503, 504})


@dataclass
class SendResult:
    ok: bool
    retryable: bool = False
    retry_after_s: float | None = None   # server-asked delay (RetryInfo, Retry-After)
    rejected: int = 0                    # partial success: items (spans, points) refused
    message: str = ""


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


class _GrpcTransport:
    """One signal's Export over gRPC: `stub_cls` is its service stub and
    `rejected_field` the count in its response's partial_success."""

    def __init__(self, up: Upstream, stub_cls=TraceServiceStub,
                 rejected_field: str = "rejected_spans", *,
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
        self._stub = stub_cls(self._channel)
        self._metadata = up.headers
        self._rejected_field = rejected_field

    def send(self, request: Message, timeout_s: float) -> SendResult:
        try:
            response = self._stub.Export(request, timeout=timeout_s, metadata=self._metadata)
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

    def send(self, request: Message, timeout_s: float) -> SendResult:
        body = request.SerializeToString()
        if self._gzip:
            body = gzip.compress(body, compresslevel=6)
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

@dataclass
class _Counters:
    exported: int = 0                 # items (spans, data points) the upstream took
    rejected_upstream: int = 0        # items refused in a partial success
    dropped_queue_full: int = 0
    dropped_failed: int = 0           # non-retryable answer, or retries ran out
    dropped_shutdown: int = 0         # still queued at the shutdown deadline, or sent after it
    retries: int = 0                  # re-sends of a request
    batches: int = 0                  # requests that got a final answer
    requests_exported: int = 0
    requests_failed: int = 0          # requests dropped (failed, or cut by the shutdown deadline)
    settled: int = 0                  # items with a final fate (exported, rejected or dropped)
    retry_delays: deque = field(default_factory=lambda: deque(maxlen=64))


class RetryingSender:
    """Sends one request until it gets a final answer: a retryable failure is
    retried with exponential backoff and jitter (or after the delay the
    server asked for) for up to `max_retry_s`, after which the request is
    dropped and counted, as is a request refused for good.

    `cond` is the owner's condition: every count in `counters` (in `unit`s,
    the word the log lines use) changes under it, and it is notified when a
    request is settled. stop_by(deadline) (shutdown) bounds the retries and
    their waits; after the deadline a request is dropped as "dropped_shutdown"."""

    def __init__(self, upstream: Upstream, transport, cond: threading.Condition, *,
                 max_retry_s: float, initial_backoff_s: float = INITIAL_BACKOFF_S,
                 max_backoff_s: float = MAX_BACKOFF_S, unit: str = "spans",
                 what: str = "OTLP export", logger: logging.Logger = log) -> None:
        self.upstream, self.transport = upstream, transport
        self._cond = cond
        self._max_retry_s = max_retry_s
        self._initial_backoff_s, self._max_backoff_s = initial_backoff_s, max_backoff_s
        self._unit, self._what = unit, what
        self._ratelog = RateLimitedLog(logger)
        self.deadline: float | None = None   # shutdown deadline (monotonic)
        self.counters = _Counters()

    def stop_by(self, deadline: float) -> None:
        with self._cond:
            self.deadline = deadline
            self._cond.notify_all()

    def send(self, request: Message, n: int) -> str:
        """Deliver `request` (`n` units); returns its fate: "exported",
        "dropped_failed" or "dropped_shutdown". One caller at a time."""
        try:
            return self._deliver(request, n)
        except Exception:   # a bug here must not kill the caller's worker
            self._ratelog(logging.ERROR, "deliver", "%s failed", self._what, exc_info=True)
            return self.settle(n, "dropped_failed")

    def settle(self, n: int, outcome: str, rejected: int = 0) -> str:
        with self._cond:
            c = self.counters
            if outcome == "exported":
                c.exported += n - rejected
                c.rejected_upstream += rejected
                c.batches += 1
                c.requests_exported += 1
            elif outcome == "dropped_failed":
                c.dropped_failed += n
                c.batches += 1
                c.requests_failed += 1
            else:
                c.dropped_shutdown += n
                c.requests_failed += 1
            c.settled += n
            self._cond.notify_all()
        return outcome

    def _backoff(self, attempt: int) -> float:
        nominal = min(self._initial_backoff_s * (2 ** attempt), self._max_backoff_s)
        return nominal * random.uniform(*JITTER)

    def _deliver(self, request: Message, n: int) -> str:
        give_up = time.monotonic() + self._max_retry_s
        attempt = 0
        while True:
            timeout = self.upstream.timeout_s
            with self._cond:
                hard = self.deadline
            if hard is not None:
                left = hard - time.monotonic()
                if left <= 0:
                    return self.settle(n, "dropped_shutdown")
                timeout = min(timeout, left)
            result = self.transport.send(request, timeout)
            if result.ok:
                if result.rejected or result.message:
                    self._ratelog(logging.WARNING, "partial",
                                  "OTLP upstream rejected %d of %d %s: %s",
                                  result.rejected, n, self._unit, result.message)
                return self.settle(n, "exported", min(result.rejected, n))
            if not result.retryable:
                self._ratelog(logging.WARNING, "final", "%s of %d %s refused, dropped: %s",
                              self._what, n, self._unit, result.message)
                return self.settle(n, "dropped_failed")
            # A server-given delay is a floor: never sooner than asked, and
            # still backing off when it keeps failing (a RetryInfo of 0 is common).
            delay = max(result.retry_after_s or 0.0, self._backoff(attempt))
            now = time.monotonic()
            if now + delay > give_up:
                self._ratelog(logging.WARNING, "gave_up",
                              "%s of %d %s dropped after %d retries: %s",
                              self._what, n, self._unit, attempt, result.message)
                return self.settle(n, "dropped_failed")
            if hard is not None and now + delay > hard:
                return self.settle(n, "dropped_shutdown")
            with self._cond:
                self.counters.retries += 1
                self.counters.retry_delays.append(delay)
                # Woken early only by shutdown, which may shorten the wait.
                end = now + delay
                while True:
                    left = end - time.monotonic()
                    if self.deadline is not None:
                        left = min(left, self.deadline - time.monotonic())
                    if left <= 0:
                        break
                    self._cond.wait(left)
            attempt += 1
