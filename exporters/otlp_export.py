"""Upstream OTLP export of the (enriched) spans the agent received: a bounded
queue, one worker sending batches over gRPC or HTTP/protobuf, and retries
with exponential backoff as the OTLP specification describes."""

from __future__ import annotations

import email.utils
import gzip
import logging
import math
import os
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence
from urllib.parse import unquote, urlsplit

import grpc
import requests
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans

from spanlet.config import ConfigError, OtlpConfig
from spanlet.exporters.otlp_receiver import PROTOBUF, STATUS_DETAILS_KEY, RateLimitedLog

log = logging.getLogger(__name__)

GRPC, HTTP_PROTOBUF = "grpc", "http/protobuf"
DEFAULT_PROTOCOL = HTTP_PROTOBUF   # the OTLP exporter specification's default
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

# The export queue's bound in bytes (serialized size of the queued spans), on
# top of cfg.queue_size in spans: a queue of large spans (attributes, span
# events) stays bounded in memory too. cfg.queue_max_bytes overrides it.
DEFAULT_QUEUE_MAX_BYTES = 64 * 1024 * 1024


# ---------------------------------------------------------------------------
# Where to send: config first, the OTEL_EXPORTER_OTLP_* variables fill the gaps.

@dataclass(frozen=True)
class Upstream:
    protocol: str                   # GRPC or HTTP_PROTOBUF
    endpoint: str                   # gRPC: host:port target; HTTP: the full URL
    insecure: bool                  # gRPC: plaintext (no TLS)
    headers: tuple[tuple[str, str], ...] = ()
    timeout_s: float = 10.0
    compression: str = "none"       # "gzip" or "none"
    certificate: str = ""           # CA bundle file for TLS; empty: system roots
    client_key: str = ""
    client_certificate: str = ""


def _env(environ: Mapping[str, str], name: str, signal: str = "traces") -> tuple[str, str] | None:
    """The signal's form of an OTEL_EXPORTER_OTLP_ variable (TRACES_,
    METRICS_), else the generic one, as (variable name, value); empty values
    count as unset."""
    for var in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_{name}", f"OTEL_EXPORTER_OTLP_{name}"):
        value = environ.get(var, "").strip()
        if value:
            return var, value
    return None


def parse_headers(text: str, source: str = "headers") -> dict[str, str]:
    """`k1=v1,k2=v2` (W3C baggage-like), keys and values URL-decoded; keys
    lower-cased (gRPC metadata requires it, HTTP ignores case). Entries
    without '=' or with an empty key are skipped with a warning."""
    out: dict[str, str] = {}
    for n, item in enumerate(text.split(","), 1):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = unquote(key).strip().lower()
        if not sep or not key:
            # Its position, not its text: a malformed entry may still be a token.
            log.warning("%s: ignoring malformed header entry %d (no 'key=value')", source, n)
            continue
        out[key] = unquote(value).strip()
    return out


def _parse_bool(var: str, value: str) -> bool | None:
    v = value.strip().lower()
    if v in ("true", "false"):
        return v == "true"
    log.warning("%s=%r is not true or false; ignored", var, value)
    return None


def resolve_upstream(cfg: OtlpConfig, environ: Mapping[str, str] = os.environ,
                     signal: str = "traces") -> Upstream | None:
    """Where and how to export `signal` ("traces" or "metrics"), or None when
    no endpoint is configured.

    Explicit configuration wins and the environment fills what it leaves
    empty, key by key (shown for traces; for metrics read METRICS_ for
    TRACES_ and /v1/metrics for /v1/traces; the other signal's forms play
    no part):
      endpoint   cfg.upstream_endpoint, else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
                 (used as-is), else OTEL_EXPORTER_OTLP_ENDPOINT (for
                 http/protobuf the path /v1/traces is appended to it). A
                 config endpoint with no path gets /v1/traces too.
      protocol   cfg.upstream_protocol, else OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL,
                 else http/protobuf (the specification's default).
      headers    OTEL_EXPORTER_OTLP_[TRACES_]HEADERS, with cfg.upstream_headers
                 set on top (a key in both takes the config value).
      timeout    cfg.upstream_timeout_s when set in the config, else
                 OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT (milliseconds), else
                 the config default.
      TLS        an http:// endpoint is plaintext, https:// is TLS; a gRPC
                 endpoint without a scheme is plaintext only when
                 OTEL_EXPORTER_OTLP_[TRACES_]INSECURE=true.
                 OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE, _CLIENT_KEY and
                 _CLIENT_CERTIFICATE name PEM files.
      compression OTEL_EXPORTER_OTLP_[TRACES_]COMPRESSION: gzip or none.
    The TRACES_ form of a variable wins over the generic one. Invalid values
    in the environment are logged and ignored, as the OTel SDK specification
    asks."""
    def env(name: str) -> tuple[str, str] | None:
        return _env(environ, name, signal)

    env_protocol = env("PROTOCOL")
    protocol = cfg.upstream_protocol
    if not protocol and env_protocol:
        var, value = env_protocol
        if value in (GRPC, HTTP_PROTOBUF):
            protocol = value
        else:
            log.warning("%s=%r is not supported (grpc, http/protobuf); using %s",
                        var, value, DEFAULT_PROTOCOL)
    protocol = protocol or DEFAULT_PROTOCOL

    signal_endpoint = f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"
    append_path = False
    if cfg.upstream_endpoint.strip():
        endpoint = cfg.upstream_endpoint.strip()
        append_path = urlsplit(endpoint).path in ("", "/") if "://" in endpoint else True
    elif environ.get(signal_endpoint, "").strip():
        endpoint = environ[signal_endpoint].strip()
    elif environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        endpoint = environ["OTEL_EXPORTER_OTLP_ENDPOINT"].strip()
        append_path = True
    else:
        return None

    env_insecure = env("INSECURE")
    insecure_flag = _parse_bool(*env_insecure) if env_insecure else None
    scheme = endpoint.split("://", 1)[0].lower() if "://" in endpoint else ""
    insecure = scheme == "http" if scheme else bool(insecure_flag)
    if protocol == GRPC:
        target = urlsplit(endpoint).netloc if scheme else endpoint.rstrip("/")
    else:
        target = endpoint if scheme else ("http://" if insecure else "https://") + endpoint
        if append_path:
            target = target.rstrip("/") + f"/v1/{signal}"

    env_headers = env("HEADERS")
    headers = parse_headers(env_headers[1], env_headers[0]) if env_headers else {}
    headers.update({k.lower(): v for k, v in cfg.upstream_headers.items()})

    timeout_s = cfg.upstream_timeout_s
    env_timeout = env("TIMEOUT")
    if "upstream_timeout_s" not in cfg.model_fields_set and env_timeout:
        var, value = env_timeout
        try:
            ms = float(value)
            if not (ms > 0 and math.isfinite(ms)):
                raise ValueError
            timeout_s = ms / 1000.0
        except ValueError:
            log.warning("%s=%r is not a positive number of milliseconds; ignored", var, value)

    compression = "none"
    env_compression = env("COMPRESSION")
    if env_compression:
        var, value = env_compression
        if value.lower() in ("gzip", "none"):
            compression = value.lower()
        else:
            log.warning("%s=%r is not supported (gzip, none); ignored", var, value)

    def path(name: str) -> str:
        found = env(name)
        return found[1] if found else ""

    return Upstream(protocol=protocol, endpoint=target, insecure=insecure,
                    headers=tuple(sorted(headers.items())), timeout_s=timeout_s,
                    compression=compression, certificate=path("CERTIFICATE"),
                    client_key=path("CLIENT_KEY"), client_certificate=path("CLIENT_CERTIFICATE"))


# ---------------------------------------------------------------------------
# Transports: one send, classified as success, retryable or final.

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
# Batching in span units.

def _spans_in(rs: ResourceSpans) -> int:
    return sum(len(ss.spans) for ss in rs.scope_spans)


def split_resource_spans(rs: ResourceSpans, first: int, rest: int) -> list[ResourceSpans]:
    """`rs` cut, in span order, into a piece of `first` spans followed by
    pieces of at most `rest` spans; each piece keeps the resource and scopes."""
    pieces: list[ResourceSpans] = []
    room = 0
    for ss in rs.scope_spans:
        piece_ss = None
        for span in ss.spans:
            if room == 0:
                piece = ResourceSpans(schema_url=rs.schema_url)
                piece.resource.CopyFrom(rs.resource)
                pieces.append(piece)
                room = first if len(pieces) == 1 else rest
                piece_ss = None
            if piece_ss is None:
                piece_ss = pieces[-1].scope_spans.add(schema_url=ss.schema_url)
                piece_ss.scope.CopyFrom(ss.scope)
            piece_ss.spans.append(span)
            room -= 1
    return pieces


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


# ---------------------------------------------------------------------------

class OtlpSpanExporter:
    """Exports ResourceSpans protos to an upstream OTLP collector.

    Where to send comes from `resolve_upstream(cfg, environ)` (config first,
    then the OTEL_EXPORTER_OTLP_* variables). With no endpoint anywhere the
    exporter is disabled: `enabled` is False, no thread runs, export() does
    nothing and returns True.

    export() hands the protos over (do not change them afterwards) and never
    blocks: at most cfg.queue_size spans, and at most queue_max_bytes of them
    (serialized), wait; the spans that do not fit are dropped and counted
    (dropped_queue_full). While the upstream is away memory holds the queue
    and the one batch being retried, no more. One worker sends batches of up
    to cfg.batch_size spans every cfg.batch_interval_s, or as soon as a batch
    is full; a retryable failure is retried with exponential backoff and
    jitter (or after the delay the server asked for) for up to
    cfg.max_retry_s, after which the batch is dropped and counted, as is a
    batch refused for good.
    """

    def __init__(self, cfg: OtlpConfig, environ: Mapping[str, str] = os.environ, *,
                 initial_backoff_s: float = INITIAL_BACKOFF_S,
                 max_backoff_s: float = MAX_BACKOFF_S,
                 queue_max_bytes: int | None = None) -> None:
        self._queue_size = cfg.queue_size
        if queue_max_bytes is None:
            queue_max_bytes = getattr(cfg, "queue_max_bytes", DEFAULT_QUEUE_MAX_BYTES)
        self._queue_max_bytes = queue_max_bytes
        self._batch_size = cfg.batch_size
        self._interval_s = cfg.batch_interval_s
        self.upstream = resolve_upstream(cfg, environ)
        self.enabled = self.upstream is not None
        self._cond = threading.Condition()
        self._queue: deque[tuple[ResourceSpans, int, int]] = deque()   # (piece, spans, bytes)
        self._queued = 0            # spans in _queue
        self._queued_bytes = 0      # their serialized size
        self._enqueued_total = 0    # spans ever accepted into the queue
        self._dequeued_total = 0    # spans ever taken out of it
        self._send_through = 0      # send at once until _dequeued_total reaches this
        self._closing = False
        self._deadline: float | None = None   # shutdown deadline (monotonic)
        self._c = _Counters()       # the sender's, once there is one
        self._ratelog = RateLimitedLog(log)
        self._sender: RetryingSender | None = None
        self._thread: threading.Thread | None = None
        if not self.enabled:
            log.info("no OTLP upstream configured (upstream_endpoint, OTEL_EXPORTER_OTLP_ENDPOINT): "
                     "span export is off")
            return
        up = self.upstream
        if up.protocol == GRPC:
            transport = _GrpcTransport(up, initial_backoff_s=initial_backoff_s, max_backoff_s=max_backoff_s)
        else:
            transport = _HttpTransport(up)
        self._sender = RetryingSender(up, transport, self._cond, max_retry_s=cfg.max_retry_s,
                                      initial_backoff_s=initial_backoff_s,
                                      max_backoff_s=max_backoff_s)
        self._c = self._sender.counters
        self._thread = threading.Thread(target=self._run, name="otlp-export", daemon=True)
        self._thread.start()
        log.info("exporting spans over OTLP %s to %s", up.protocol, up.endpoint)

    # ---- the OTel exporter shape ----

    def export(self, resource_spans: Sequence[ResourceSpans]) -> bool:
        """Queue the spans; False when any had to be dropped (queue full or
        after shutdown). Never blocks on the network."""
        if not self.enabled:
            return True
        all_queued = True
        overflow = 0
        with self._cond:
            for rs in resource_spans:
                n = _spans_in(rs)
                if not n:
                    continue
                if self._closing:
                    self._c.dropped_shutdown += n
                    all_queued = False
                    continue
                room = self._queue_size - self._queued
                if n > room:
                    self._c.dropped_queue_full += n - room
                    overflow += n - room
                    all_queued = False
                    if not room:
                        continue
                    rs, n = split_resource_spans(rs, room, n)[0], room
                if n > self._batch_size:
                    pieces = split_resource_spans(rs, self._batch_size, self._batch_size)
                else:
                    pieces = [rs]
                for piece in pieces:
                    k, size = _spans_in(piece), piece.ByteSize()
                    if self._queued_bytes + size > self._queue_max_bytes:
                        self._c.dropped_queue_full += k
                        overflow += k
                        all_queued = False
                        continue
                    self._queue.append((piece, k, size))
                    self._queued += k
                    self._queued_bytes += size
                    self._enqueued_total += k
            if self._queued >= self._batch_size:
                self._cond.notify_all()
            dropped_so_far = self._c.dropped_queue_full
        if overflow:
            self._ratelog(logging.WARNING, "queue_full",
                          "OTLP export queue full (%d spans, %d bytes): dropped %d spans, %d so far",
                          self._queue_size, self._queue_max_bytes, overflow, dropped_so_far)
        elif not all_queued:
            self._ratelog(logging.WARNING, "closed", "OTLP exporter is shut down; spans dropped")
        return all_queued

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Send everything queued now; True when all of it got a final
        answer (exported or dropped) within the timeout."""
        if not self.enabled:
            return True
        deadline = time.monotonic() + timeout_millis / 1000.0
        with self._cond:
            target = self._enqueued_total
            self._send_through = max(self._send_through, target)
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._c.settled >= target,
                                       timeout=max(0.0, deadline - time.monotonic()))

    def shutdown(self, timeout_millis: int = 30000) -> None:
        """Flush what is queued within the deadline, drop (and count) what is
        left, stop the worker and close the connection. Safe to call twice."""
        if not self.enabled:
            return
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._deadline = time.monotonic() + timeout_millis / 1000.0
            self._sender.stop_by(self._deadline)
        # The worker bounds every wait and send by the deadline itself.
        self._thread.join(timeout=max(0.0, self._deadline - time.monotonic()) + 2.0)
        if self._thread.is_alive():
            log.warning("OTLP export worker did not stop by the shutdown deadline")
        self._sender.transport.close()

    def stats(self) -> dict:
        with self._cond:
            c = self._c
            return {
                "enabled": self.enabled,
                "exported": c.exported,
                "rejected_upstream": c.rejected_upstream,
                "dropped_queue_full": c.dropped_queue_full,
                "dropped_failed": c.dropped_failed,
                "dropped_shutdown": c.dropped_shutdown,
                "retries": c.retries,
                "batches": c.batches,
                "queue_spans": self._queued,
                "queue_capacity": self._queue_size,
                "queue_bytes": self._queued_bytes,
                "queue_bytes_capacity": self._queue_max_bytes,
                # taken from the queue, not yet settled: the batch being sent or retried
                "inflight_spans": self._dequeued_total - c.settled,
            }

    @property
    def retry_delays(self) -> list[float]:
        """The last planned retry delays in seconds, oldest first."""
        with self._cond:
            return list(self._c.retry_delays)

    # ---- worker ----

    def _run(self) -> None:
        next_tick = time.monotonic() + self._interval_s
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    if self._closing and (not self._queue or now >= self._deadline):
                        self._drop_queue_locked()
                        return
                    if now >= next_tick:
                        next_tick = now + self._interval_s
                        self._send_through = max(self._send_through, self._enqueued_total)
                    if self._queue and (self._queued >= self._batch_size or self._closing
                                        or self._dequeued_total < self._send_through):
                        break
                    wait = next_tick - now
                    if self._closing:
                        wait = min(wait, self._deadline - now)
                    self._cond.wait(wait)
                batch, n = self._take_locked()
            self._sender.send(batch, n)

    def _take_locked(self) -> tuple[ExportTraceServiceRequest, int]:
        request = ExportTraceServiceRequest()
        room = self._batch_size
        while self._queue and room:
            rs, n, size = self._queue[0]
            if n > room:
                head, tail = split_resource_spans(rs, room, n)
                tail_size = tail.ByteSize()
                self._queue[0] = (tail, n - room, tail_size)
                rs, n, size = head, room, size - tail_size
            else:
                self._queue.popleft()
            request.resource_spans.append(rs)
            self._queued_bytes -= size
            room -= n
        taken = self._batch_size - room
        self._queued -= taken
        self._dequeued_total += taken
        return request, taken

    def _drop_queue_locked(self) -> None:
        if self._queued:
            log.warning("OTLP export: %d spans still queued at the shutdown deadline were dropped",
                        self._queued)
            self._c.dropped_shutdown += self._queued
            self._c.settled += self._queued
            self._dequeued_total += self._queued
            self._queue.clear()
            self._queued = 0
            self._queued_bytes = 0
            self._cond.notify_all()
