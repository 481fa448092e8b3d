"""OTLP trace receiver: gRPC TraceService/Export and OTLP/HTTP protobuf
POST /v1/traces, answering per the OTLP specification and passing on only
spans whose trace and span ids are well formed."""

from __future__ import annotations

import logging
import math
import re
import socket
import socketserver
import ssl
import threading
import time
import zlib
from collections import Counter
from concurrent import futures
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from typing import Callable, Iterable
from urllib.parse import urlsplit

import grpc
import h11
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans

from spanlet.config import OtlpConfig
from spanlet.exporters.http import serve_in_thread, stop_serving
from spanlet.exporters.otlp.common import PROTOBUF, STATUS_DETAILS_KEY, TRACES_GRPC_SERVICE, TRACES_PATH
from spanlet.exporters.otlp.trust import (BearerToken, Peer, SenderRateLimiter, grpc_peer,
                                          grpc_server_credentials, normal_sender, sender_of_peer,
                                          server_ssl_context)
from spanlet.exporters.ratelog import RateLimitedLog
from spanlet.osthreads import rename

try:
    from spanlet._wire import valid_spans as _valid_spans
except ImportError:        # a source tree without its build: the check in Python alone
    _valid_spans = None

log = logging.getLogger(__name__)

# The trailer the OTel SDKs read a RetryInfo from (besides the Status in
# STATUS_DETAILS_KEY, where the gRPC rules put it).
RETRY_INFO_KEY = "google.rpc.retryinfo-bin"
HTTP_PATH = TRACES_PATH

GRPC_WORKERS = 4
# A keep-alive connection idle (or a client sending slowly) this long is closed.
HTTP_IDLE_TIMEOUT_S = 30.0
# A request must arrive whole within this long (gRPC: from the call's start;
# HTTP: from the connection's start or its previous answer), else it is cut
# off: a client that trickles bytes cannot hold a worker or a thread forever.
REQUEST_TIMEOUT_S = 60.0
# Concurrent OTLP/HTTP connections (a thread each); more are closed at once.
MAX_HTTP_CONNECTIONS = 256
# The most one read from a connection takes.
_READ_CHUNK = 64 * 1024
# The most a request's line and headers may take together, and the most
# header fields it may have: more is refused (431).
MAX_HTTP_HEAD_BYTES = 64 * 1024
MAX_HTTP_HEADERS = 100
SERVER_NAME = "spanlet-otlp"
# Closing after an unread body: discard at most this much, this long.
LINGER_S = 2.0
LINGER_BYTES = 16 * 1024 * 1024

_ZERO_TRACE_ID = bytes(16)
_ZERO_SPAN_ID = bytes(8)

# Why a span was rejected (the `reason` of the rejected-spans counter).
REJECT_TRACE_ID_MISSING = "trace_id_missing"        # empty or all zero
REJECT_TRACE_ID_LENGTH = "trace_id_length"          # not 16 bytes
REJECT_SPAN_ID_MISSING = "span_id_missing"          # empty or all zero
REJECT_SPAN_ID_LENGTH = "span_id_length"            # not 8 bytes
REJECT_PARENT_ID_LENGTH = "parent_span_id_length"   # present but not 8 bytes
REJECT_NOT_ACCEPTED = "not_accepted"                # valid, but on_request took fewer

_REASON_TEXT = {
    REJECT_TRACE_ID_MISSING: "without trace_id",
    REJECT_TRACE_ID_LENGTH: "with a trace_id that is not 16 bytes",
    REJECT_SPAN_ID_MISSING: "without span_id",
    REJECT_SPAN_ID_LENGTH: "with a span_id that is not 8 bytes",
    REJECT_PARENT_ID_LENGTH: "with a parent_span_id that is not 8 bytes",
    REJECT_NOT_ACCEPTED: "not accepted by the agent (queue full)",
}


def count_spans(resource_spans: Iterable[ResourceSpans]) -> int:
    return sum(len(ss.spans) for rs in resource_spans for ss in rs.scope_spans)


def _span_problem(span) -> str | None:
    tid, sid, parent = span.trace_id, span.span_id, span.parent_span_id
    if len(tid) != 16:
        return REJECT_TRACE_ID_LENGTH if tid else REJECT_TRACE_ID_MISSING
    if tid == _ZERO_TRACE_ID:
        return REJECT_TRACE_ID_MISSING
    if len(sid) != 8:
        return REJECT_SPAN_ID_LENGTH if sid else REJECT_SPAN_ID_MISSING
    if sid == _ZERO_SPAN_ID:
        return REJECT_SPAN_ID_MISSING
    if parent and len(parent) != 8:
        return REJECT_PARENT_ID_LENGTH
    return None


def drop_invalid_spans(request: ExportTraceServiceRequest) -> tuple[int, Counter]:
    """Remove, in place, the spans whose ids are malformed (and the scope and
    resource entries left empty). Returns (valid spans left, rejections by reason)."""
    rejected: Counter = Counter()
    valid = 0
    all_rs = request.resource_spans
    for ri in reversed(range(len(all_rs))):
        scopes = all_rs[ri].scope_spans
        for si in reversed(range(len(scopes))):
            spans = scopes[si].spans
            bad = []
            for i, span in enumerate(spans):
                # Inlined common case (this loop is most of the receiver's CPU).
                tid, sid = span.trace_id, span.span_id
                if (len(tid) == 16 and len(sid) == 8 and tid != _ZERO_TRACE_ID
                        and sid != _ZERO_SPAN_ID and len(span.parent_span_id) in (0, 8)):
                    valid += 1
                else:
                    rejected[_span_problem(span)] += 1
                    bad.append(i)
            for i in reversed(bad):
                del spans[i]
            if not spans:
                del scopes[si]
        if not scopes:
            del all_rs[ri]
    return valid, rejected


def shut_down(conns: Iterable[socket.socket]) -> None:
    """Shut both ways of each connection, which wakes a handler blocked on it;
    one already closed is passed over. A TLS connection's socket is shut
    under its TLS state, which the handler's thread is still using."""
    for conn in conns:
        try:
            socket.socket.shutdown(conn, socket.SHUT_RDWR)
        except OSError:
            pass


class Backpressure(Exception):
    """Raised by `on_request` when the agent cannot take spans now. The client
    is told to retry: gRPC UNAVAILABLE (with RetryInfo when `retry_after_s` is
    given), HTTP 503 (with Retry-After), as the OTLP throttling rules say."""

    def __init__(self, message: str = "agent busy, retry later", retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


# Transport-neutral result of one request; each transport maps it to its wire.
OK, PARTIAL, INVALID, TOO_LARGE, BUSY, ERROR, STOPPED = (
    "ok", "partial", "invalid", "too_large", "busy", "error", "stopped")
# HTTP-only outcomes.
UNSUPPORTED_MEDIA_TYPE, NOT_FOUND, METHOD_NOT_ALLOWED, LENGTH_REQUIRED = (
    "unsupported_media_type", "not_found", "method_not_allowed", "length_required")
# Not HTTP/1.1 (h11 refused it), or framing RFC 9112 lets a server refuse.
MALFORMED_HTTP = "malformed_http"
# Closed at accept: MAX_HTTP_CONNECTIONS already open.
TOO_MANY_CONNECTIONS = "too_many_connections"
# Cut off at REQUEST_TIMEOUT_S (both transports).
TIMEOUT = "timeout"
# Refused by the lock-down (trust.py): no or a wrong bearer token; the
# sender over its rate; (HTTP) a TLS handshake that failed: not TLS, no or
# an untrusted client certificate. gRPC refuses those handshakes itself,
# unseen by the handler: they are not counted.
UNAUTHENTICATED, RATE_LIMITED, TLS_HANDSHAKE_FAILED = (
    "unauthenticated", "rate_limited", "tls_handshake_failed")
# gRPC: the call ended without a whole message: over the size limit, in a
# compression grpc could not undo, cancelled by the client (grpc answers those
# itself: RESOURCE_EXHAUSTED, INTERNAL, CANCELLED), or none was sent
# (INVALID_ARGUMENT). grpc does not tell these apart to the handler.
NOT_RECEIVED = "not_received"


@dataclass
class _Outcome:
    kind: str
    message: str = ""
    response: bytes = b""
    retry_after_s: float | None = None


_GRPC_CODES = {
    INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    BUSY: grpc.StatusCode.UNAVAILABLE,
    STOPPED: grpc.StatusCode.UNAVAILABLE,
    ERROR: grpc.StatusCode.INTERNAL,
    UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    # the OTLP spec's answer to throttling: retryable, with RetryInfo
    RATE_LIMITED: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
_HTTP_STATUS = {
    OK: 200, PARTIAL: 200, INVALID: 400, TOO_LARGE: 413, BUSY: 503, STOPPED: 503,
    ERROR: 500, UNSUPPORTED_MEDIA_TYPE: 415, NOT_FOUND: 404, METHOD_NOT_ALLOWED: 405,
    LENGTH_REQUIRED: 411, UNAUTHENTICATED: 401, RATE_LIMITED: 429,
}
# google.rpc.Status.code for HTTP error bodies (informational per the spec).
_RPC_CODES = {
    INVALID: code_pb2.INVALID_ARGUMENT, TOO_LARGE: code_pb2.RESOURCE_EXHAUSTED,
    BUSY: code_pb2.UNAVAILABLE, STOPPED: code_pb2.UNAVAILABLE, ERROR: code_pb2.INTERNAL,
    UNSUPPORTED_MEDIA_TYPE: code_pb2.INVALID_ARGUMENT, NOT_FOUND: code_pb2.NOT_FOUND,
    METHOD_NOT_ALLOWED: code_pb2.UNIMPLEMENTED, LENGTH_REQUIRED: code_pb2.INVALID_ARGUMENT,
    UNAUTHENTICATED: code_pb2.UNAUTHENTICATED, RATE_LIMITED: code_pb2.RESOURCE_EXHAUSTED,
}
UNAUTHENTICATED_MESSAGE = "missing or wrong bearer token"


def _retry_info(retry_after_s: float) -> error_details_pb2.RetryInfo:
    info = error_details_pb2.RetryInfo()
    info.retry_delay.FromNanoseconds(int(max(retry_after_s, 0.0) * 1e9))
    return info


def _status_bytes(kind: str, message: str, retry_after_s: float | None = None) -> bytes:
    st = status_pb2.Status(code=_RPC_CODES.get(kind, code_pb2.UNKNOWN), message=message)
    if retry_after_s is not None:
        st.details.add().Pack(_retry_info(retry_after_s))
    return st.SerializeToString()


class OtlpReceiver:
    """Receives OTLP traces over gRPC (cfg.grpc_port) and HTTP/protobuf
    (cfg.http_port) on cfg.receiver_address; port 0 picks a free port, and the
    ports in use are `grpc_port` / `http_port` after start().

    `on_request(request, peer)` gets each request with its malformed spans
    removed (never called with zero spans) and the connection it came on
    (trust.Peer; None for a gRPC peer that is not an IP address), and
    returns how many spans it accepted; the
    rest are reported to the client in `partial_success`. It may raise
    `Backpressure` to make the client retry later. It runs on the server's
    threads, so it must be thread-safe."""

    def __init__(self, cfg: OtlpConfig,
                 on_request: Callable[[ExportTraceServiceRequest, Peer | None], int]) -> None:
        self._cfg = cfg
        self._on_request = on_request
        self.max_message_bytes = cfg.max_message_bytes
        self.grpc_port = cfg.grpc_port
        self.http_port = cfg.http_port
        self._lifecycle = threading.Lock()
        self._stats_lock = threading.Lock()
        self._grpc_server: grpc.Server | None = None
        self._httpd: _HttpServer | None = None
        self._http_thread: threading.Thread | None = None
        self._running = False
        self._accepting = False
        self._requests: Counter = Counter()       # (transport, outcome)
        self._spans_accepted = 0
        self._spans_rejected: Counter = Counter()  # reason
        self._ratelog = RateLimitedLog(log)
        self.request_timeout_s = REQUEST_TIMEOUT_S
        self.max_http_connections = MAX_HTTP_CONNECTIONS
        # gRPC calls waiting for their message: token -> (deadline, context, timed out?)
        self._calls: dict[int, list] = {}
        self._calls_lock = threading.Lock()
        self._reaper: threading.Thread | None = None
        # The reaper sleeps until the first deadline, or until one is set when
        # there was none (idle: no wake-ups); _reap_cv guards both flags.
        self._reap_cv = threading.Condition()
        self._reaper_stop = False
        self._reaper_idle = False
        self.reaper_wakeups = 0
        # The lock-down (trust.py), made by start() from the files named in cfg.
        self._ssl_context: ssl.SSLContext | None = None
        self._token: BearerToken | None = None
        # requests by how their sender was established (SpanPath sets it)
        self.origins: Callable[[], dict[str, int]] | None = None
        self._limiter = (SenderRateLimiter(cfg.rate_limit_spans_per_s, cfg.rate_limit_burst,
                                           cfg.rate_limit_max_senders)
                         if cfg.rate_limit_spans_per_s > 0 else None)

    # ---- lifecycle ----

    def start(self) -> None:
        """Bind both ports and serve; raises OSError naming the address when a
        port cannot be bound. Calling it again while running does nothing."""
        with self._lifecycle:
            if self._running:
                return
            # Files first: a bad one is an OSError naming its key, before any port opens.
            self._ssl_context = server_ssl_context(self._cfg)
            credentials = grpc_server_credentials(self._cfg)
            self._token = BearerToken(self._cfg.bearer_token_file) if self._cfg.bearer_token_file else None
            grpc_server = self._start_grpc(credentials)
            try:
                self._start_http()
            except BaseException:
                grpc_server.stop(None)
                raise
            self._grpc_server = grpc_server
            self._running = self._accepting = True
            self._reaper_stop = False
            self._reaper = threading.Thread(target=self._reap_loop, name="otlp-reaper", daemon=True)
            self._reaper.start()
            log.info("OTLP receiver on %s: gRPC port %d, HTTP port %d; %s",
                     self._cfg.receiver_address, self.grpc_port, self.http_port, self.lockdown())

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop both servers, letting in-flight requests finish for `grace`
        seconds. Safe to call twice, and before start()."""
        with self._lifecycle:
            if not self._running:
                return
            self._running = False
            # No new calls or connections; the ones in flight get the grace period.
            stopped = self._grpc_server.stop(grace)
            stop_serving(self._httpd)
            self._http_thread.join(timeout=5)
            stopped.wait(timeout=(grace or 0) + 5)
            # Requests still arriving on kept-alive HTTP connections are now
            # answered 503, and the connections are closed.
            self._accepting = False
            self._httpd.close_connections()
            self._httpd.server_close()
            with self._reap_cv:
                self._reaper_stop = True
                self._reap_cv.notify()
            self._reaper.join(timeout=5)
            self._grpc_server = self._httpd = self._http_thread = self._reaper = None

    @property
    def running(self) -> bool:
        return self._running

    def lockdown(self) -> str:
        """What the receiver asks of a sender, in words (no secret in them)."""
        cfg = self._cfg
        tls = ("plain (no TLS)" if not cfg.tls_cert_file else
               "TLS with client certificates" if cfg.tls_client_ca_file else "TLS")
        token = "a bearer token" if cfg.bearer_token_file else "no token"
        rate = (f"{cfg.rate_limit_spans_per_s:g} spans/s a sender (burst "
                f"{self._limiter.burst:g})" if self._limiter else "no rate limit")
        return f"{tls}, {token}, {rate}"

    def _start_grpc(self, credentials: grpc.ServerCredentials | None) -> grpc.Server:
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=GRPC_WORKERS, thread_name_prefix="otlp-grpc"),
            options=[
                ("grpc.max_receive_message_length", self.max_message_bytes),
                # Without this a second agent would silently share the port.
                ("grpc.so_reuseport", 0),
            ],
        )
        # Raw bytes in and out: we parse ourselves, so malformed protobuf is
        # answered INVALID_ARGUMENT (grpc's own deserializer would say INTERNAL).
        # Served as client-streaming (the same on the wire as unary): the
        # handler runs when the call starts, so it can bound how long the
        # message may take and count the calls gRPC ended before it arrived.
        handler = grpc.method_handlers_generic_handler(TRACES_GRPC_SERVICE, {
            "Export": grpc.stream_unary_rpc_method_handler(self._grpc_export),
        })
        server.add_generic_rpc_handlers((handler,))
        addr = self._cfg.receiver_address
        host = f"[{addr}]" if ":" in addr else addr
        target = f"{host}:{self._cfg.grpc_port}"
        try:
            port = (server.add_secure_port(target, credentials) if credentials is not None
                    else server.add_insecure_port(target))
        except RuntimeError as e:
            raise OSError(f"OTLP gRPC receiver cannot bind {host}:{self._cfg.grpc_port}: {e}") from None
        if not port:
            raise OSError(f"OTLP gRPC receiver cannot bind {host}:{self._cfg.grpc_port}")
        before = set(threading.enumerate())
        server.start()
        # gRPC's poll thread, otherwise "Thread-N (_serve)" in `top -H` and the soak's CPU.
        for t in set(threading.enumerate()) - before:
            if t.name.endswith("(_serve)"):
                rename(t, "otlp-grpc-serve")
        self.grpc_port = port
        return server

    def _start_http(self) -> None:
        addr = self._cfg.receiver_address
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        server_cls = type("_Server", (_HttpServer,), {"address_family": family, "receiver": self})
        handler_cls = type("_Handler", (_HttpHandler,), {"receiver": self})
        try:
            httpd = server_cls((addr, self._cfg.http_port), handler_cls)
        except OSError as e:
            raise OSError(e.errno, f"OTLP HTTP receiver cannot bind {addr}:{self._cfg.http_port}: "
                                   f"{e.strerror}") from None
        self.http_port = httpd.server_address[1]
        self._httpd = httpd
        self._http_thread = serve_in_thread(httpd, "otlp-http")

    # ---- counters ----

    def stats(self) -> dict:
        """Counters since construction: requests by transport and outcome,
        spans accepted, spans rejected by reason, requests by how their
        sender was established (when the span path counts them)."""
        with self._stats_lock:
            requests: dict[str, dict[str, int]] = {"grpc": {}, "http": {}}
            for (transport, outcome), n in self._requests.items():
                requests.setdefault(transport, {})[outcome] = n
            return {
                "requests": requests,
                "spans_accepted": self._spans_accepted,
                "spans_rejected": dict(self._spans_rejected),
                "origins": self.origins() if self.origins is not None else {},
            }

    def _count(self, transport: str, outcome: str) -> None:
        with self._stats_lock:
            self._requests[(transport, outcome)] += 1

    # ---- deadlines ----

    def _deadline_set(self) -> None:
        """A gRPC call or HTTP connection got a deadline: wake the reaper if
        it sleeps with none (it finds the deadline itself otherwise)."""
        with self._reap_cv:
            if self._reaper_idle:
                self._reaper_idle = False
                self._reap_cv.notify()

    def _reap_loop(self) -> None:
        while True:
            self.reaper_wakeups += 1
            now = time.monotonic()
            with self._calls_lock:
                late = [call for call in self._calls.values() if call[0] <= now and not call[2]]
                for call in late:
                    call[2] = True
            for call in late:
                call[1].cancel()          # the handler's read fails: its worker is free
            httpd = self._httpd
            if httpd is not None:
                for _ in httpd.close_expired(now):
                    self._count("http", TIMEOUT)
            with self._reap_cv:
                if self._reaper_stop:
                    return
                # Read under _reap_cv: a deadline set after this is announced by
                # _deadline_set, which waits for the lock until we sleep.
                with self._calls_lock:
                    first = min((call[0] for call in self._calls.values() if not call[2]),
                                default=math.inf)
                if httpd is not None:
                    first = min(first, httpd.first_deadline())
                self._reaper_idle = first == math.inf
                self._reap_cv.wait(None if self._reaper_idle else max(first - time.monotonic(), 0.0))

    # ---- the one request path both transports share ----

    def _handle_payload(self, payload: bytes, transport: str, sender: str,
                        peer: Peer | None) -> _Outcome:
        """Parse, validate and pass on one serialized ExportTraceServiceRequest."""
        outcome = self._handle(payload, sender, peer)
        self._count(transport, outcome.kind)
        return outcome

    def authorized(self, authorization: str | None) -> bool:
        """Whether a request with this `authorization` value may deliver."""
        return self._token is None or self._token.accepts(authorization)

    def _handle(self, payload: bytes, sender: str, peer: Peer | None) -> _Outcome:
        if not self._accepting:
            return _Outcome(STOPPED, "receiver is shutting down")
        if len(payload) > self.max_message_bytes:
            return _Outcome(TOO_LARGE, f"request of {len(payload)} bytes is over the limit "
                                       f"of {self.max_message_bytes} bytes")
        try:
            request = ExportTraceServiceRequest.FromString(payload)
        except (DecodeError, ValueError, RecursionError) as e:
            return _Outcome(INVALID, f"request is not a valid ExportTraceServiceRequest: {e}")
        # every span's ids checked in C on the bytes; only a request with a
        # span to drop (or an empty resource or scope) is walked from Python
        valid = _valid_spans(payload) if _valid_spans is not None else -1
        if self._limiter is not None:
            wait = self._limiter.take(sender, valid if valid >= 0 else count_spans(request.resource_spans))
            if wait is not None:
                return _Outcome(RATE_LIMITED, f"over the rate of {self._limiter.rate:g} spans/s "
                                              f"for this sender; retry in {wait:.2f} s",
                                retry_after_s=wait)
        if valid >= 0:
            rejected: Counter = Counter()
        else:
            valid, rejected = drop_invalid_spans(request)
        accepted = 0
        if valid:
            try:
                result = self._on_request(request, peer)
                accepted = valid if result is None else min(max(int(result), 0), valid)
            except Backpressure as e:
                return _Outcome(BUSY, str(e), retry_after_s=e.retry_after_s)
            except Exception:
                self._ratelog(logging.ERROR, "on_request", "OTLP receiver callback failed",
                              exc_info=True)
                return _Outcome(ERROR, "internal error while processing spans")
        if accepted < valid:
            rejected[REJECT_NOT_ACCEPTED] = valid - accepted
        with self._stats_lock:
            self._spans_accepted += accepted
            self._spans_rejected.update(rejected)
        response = ExportTraceServiceResponse()
        n_rejected = sum(rejected.values())
        if not n_rejected:
            return _Outcome(OK, response=response.SerializeToString())
        response.partial_success.rejected_spans = n_rejected
        response.partial_success.error_message = "rejected " + "; ".join(
            f"{n} span{'s' if n != 1 else ''} {_REASON_TEXT[r]}" for r, n in sorted(rejected.items()))
        return _Outcome(PARTIAL, response.partial_success.error_message,
                        response=response.SerializeToString())

    # ---- gRPC ----

    def _grpc_receive(self, request_iterator, context: grpc.ServicerContext) -> bytes | _Outcome:
        """The call's one message, or the outcome when there is none."""
        token = id(context)
        call = [time.monotonic() + self.request_timeout_s, context, False]
        with self._calls_lock:
            self._calls[token] = call
        self._deadline_set()
        try:
            return next(request_iterator)
        except (StopIteration, grpc.RpcError):
            pass
        finally:
            with self._calls_lock:
                self._calls.pop(token, None)
        if call[2]:
            return _Outcome(TIMEOUT, f"request not received within {self.request_timeout_s:g} s")
        return _Outcome(NOT_RECEIVED, "Export takes exactly one request message")

    def _grpc_export(self, request_iterator, context: grpc.ServicerContext) -> bytes:
        if self._token is not None:
            sent = [v for k, v in context.invocation_metadata() if k == "authorization"]
            if len(sent) != 1 or not self.authorized(sent[0]):
                self._count("grpc", UNAUTHENTICATED)
                context.abort(_GRPC_CODES[UNAUTHENTICATED], UNAUTHENTICATED_MESSAGE)
        payload = self._grpc_receive(request_iterator, context)
        if isinstance(payload, _Outcome):
            self._count("grpc", payload.kind)
            # where grpc has already answered, this changes nothing
            context.abort(_GRPC_CODES[INVALID], payload.message)
        try:
            peer = context.peer()
            outcome = self._handle_payload(payload, "grpc", sender_of_peer(peer),
                                           grpc_peer(peer, self._cfg.receiver_address,
                                                     self.grpc_port))
        except Exception:   # never let a request take a worker down
            self._ratelog(logging.ERROR, "grpc", "OTLP gRPC request failed", exc_info=True)
            outcome = _Outcome(ERROR, "internal error")
        if outcome.kind in (OK, PARTIAL):
            return outcome.response
        if outcome.retry_after_s is not None:
            context.set_trailing_metadata((
                (STATUS_DETAILS_KEY, _status_bytes(outcome.kind, outcome.message,
                                                   outcome.retry_after_s)),
                (RETRY_INFO_KEY, _retry_info(outcome.retry_after_s).SerializeToString())))
        context.abort(_GRPC_CODES[outcome.kind], outcome.message)


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    # listen() backlog: socketserver's 5 drops the SYNs of a burst of clients
    # (each then waits a 1 s retransmit); max_http_connections bounds the rest.
    request_queue_size = 128
    receiver: OtlpReceiver   # set on the per-receiver subclass

    def __init__(self, *args, **kwargs) -> None:
        self._conns: dict[socket.socket, float] = {}     # connection -> deadline (monotonic)
        self._conns_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:
        with self._conns_lock:
            full = len(self._conns) >= self.receiver.max_http_connections
            if not full:
                self._conns[request] = time.monotonic() + self.receiver.request_timeout_s
        if full:
            self.receiver._count("http", TOO_MANY_CONNECTIONS)
            self.shutdown_request(request)
            return
        self.receiver._deadline_set()
        try:
            super().process_request(request, client_address)
        except BaseException:          # no thread for it: forget it (serve_forever closes it)
            self.track(request, False)
            raise

    def finish_request(self, request, client_address) -> None:
        ctx = self.receiver._ssl_context
        if ctx is None:
            super().finish_request(request, client_address)
            return
        # The handshake runs here, on the connection's own thread (a slow
        # client holds no one else up), under the connection's deadline.
        conn = ctx.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
        self.rekey(request, conn)
        try:
            conn.settimeout(_HttpHandler.timeout)
            try:
                conn.do_handshake()
            except (OSError, ValueError) as e:   # ssl.SSLError is an OSError
                if not self.cut_off(conn):         # else counted as a timeout
                    self.receiver._count("http", TLS_HANDSHAKE_FAILED)
                log.debug("OTLP HTTP TLS handshake with %s failed: %s", client_address[0], e)
                return
            super().finish_request(conn, client_address)
        finally:
            self.track(conn, False)
            self.shutdown_request(conn)

    def rekey(self, raw: socket.socket, conn: socket.socket) -> None:
        """The TLS socket took over the raw one's descriptor: track it instead."""
        with self._conns_lock:
            if raw in self._conns:
                self._conns[conn] = self._conns.pop(raw)

    def cut_off(self, conn: socket.socket) -> bool:
        """Whether close_expired shut the connection (before its request was in)."""
        with self._conns_lock:
            return self._conns.get(conn) == float("inf")

    def track(self, conn: socket.socket, alive: bool) -> None:
        """Renew the connection's deadline (after an answer); forget it."""
        with self._conns_lock:
            if alive:
                self._conns[conn] = time.monotonic() + self.receiver.request_timeout_s
            else:
                self._conns.pop(conn, None)
        if alive:
            self.receiver._deadline_set()

    def hold(self, conn: socket.socket) -> None:
        """The request is in: no deadline while it is processed and answered."""
        with self._conns_lock:
            if conn in self._conns:
                self._conns[conn] = float("inf")

    def first_deadline(self) -> float:
        """The earliest deadline of a connection (inf: none)."""
        with self._conns_lock:
            return min(self._conns.values(), default=math.inf)

    def close_expired(self, now: float) -> list[socket.socket]:
        """Shut the connections whose request is not in by its deadline."""
        with self._conns_lock:
            expired = [c for c, deadline in self._conns.items() if deadline < now]
            for c in expired:
                self._conns[c] = float("inf")      # counted once
        shut_down(expired)
        return expired

    def close_connections(self) -> None:
        """End keep-alive connections so no handler outlives stop()."""
        with self._conns_lock:
            conns = list(self._conns)
        shut_down(conns)

    def handle_error(self, request, client_address) -> None:
        log.debug("OTLP HTTP connection from %s failed", client_address, exc_info=True)


class _ProtocolError(Exception):
    """A request the HTTP handler answers without reading further."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


# Methods answered 405/404 (a POST elsewhere than HTTP_PATH is a 404 too);
# any other is refused as malformed (501).
_OTHER_METHODS = frozenset((b"GET", b"HEAD", b"PUT", b"DELETE", b"PATCH", b"OPTIONS"))
# A header line that starts with a space or tab continues the one before.
_OBS_FOLD = re.compile(rb"\n[ \t]")


def _refused(message: str, status: int = 400) -> h11.RemoteProtocolError:
    return h11.RemoteProtocolError(message, error_status_hint=status)


def _header(request: h11.Request, name: bytes) -> list[str]:
    """The values of the request's header `name` (lower case), in order."""
    return [value.decode("latin-1") for key, value in request.headers if key == name]


def _request_problem(request: h11.Request, head: bytes) -> h11.RemoteProtocolError | None:
    """What h11 lets through and the receiver refuses: a head over the
    limits, a version or method it does not serve, and framing that RFC 9112
    lets a server refuse, which another parser (a proxy in front) could
    delimit differently."""
    # h11 stops at MAX_HTTP_HEAD_BYTES still incomplete; a whole head that came
    # in a few reads can be longer
    if len(head) > MAX_HTTP_HEAD_BYTES:
        return _refused(f"request line and headers over {MAX_HTTP_HEAD_BYTES} bytes", 431)
    if request.http_version not in (b"1.0", b"1.1"):
        return _refused(f"HTTP/{request.http_version.decode()} is not supported", 505)
    if len(request.headers) > MAX_HTTP_HEADERS:
        return _refused(f"more than {MAX_HTTP_HEADERS} header fields", 431)
    # h11 joins a folded line to the field before it (RFC 9112 5.2 allows
    # that or a 400): refused, so no folded Transfer-Encoding gets through.
    if _OBS_FOLD.search(head):
        return _refused("obsolete line folding in the headers")
    te, cl = _header(request, b"transfer-encoding"), _header(request, b"content-length")
    if te and cl:          # RFC 9112 6.3: may be refused, must be closed after
        return _refused("both Transfer-Encoding and Content-Length")
    if te and request.http_version == b"1.0":     # RFC 9112 6.1: faulty framing
        return _refused("Transfer-Encoding in an HTTP/1.0 request")
    if request.method != b"POST" and request.method not in _OTHER_METHODS:
        return _refused(f"method {request.method.decode()!r} is not served", 501)
    return None


class _HttpHandler(socketserver.BaseRequestHandler):
    """One connection: its requests parsed by h11, answered one at a time
    while the connection is kept alive."""

    server: _HttpServer
    timeout = HTTP_IDLE_TIMEOUT_S
    receiver: OtlpReceiver   # set on the per-receiver subclass

    def setup(self) -> None:
        self.connection = self.request
        self.connection.settimeout(self.timeout)
        # An answer is one write, but with Nagle on, the last segment of one
        # longer than a segment waits for the client's delayed ACK (40 ms).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        self.server.track(self.connection, True)
        local = self.connection.getsockname()
        self.peer = Peer("http", normal_sender(self.client_address[0]), self.client_address[1],
                         normal_sender(local[0]), local[1])
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HTTP_HEAD_BYTES)
        self.close_connection = False
        self.method = b""

    def finish(self) -> None:
        self.server.track(self.connection, False)

    def handle(self) -> None:
        try:
            while self._serve_one():
                self.h11.start_next_cycle()
        except h11.RemoteProtocolError as e:
            self._refuse(e)
        except _Gone:
            pass

    def _serve_one(self) -> bool:
        """Answer the next request; whether the connection stays open."""
        request = self._next_request()
        if request is None:
            return False
        if request.method != b"POST":
            self._other_method(request)
        else:
            self._post(request)
        if self.h11.states == {h11.CLIENT: h11.DONE, h11.SERVER: h11.DONE}:
            return True
        self._linger()
        return False

    # ---- reading ----

    def _recv(self) -> bytes:
        """What the client sent next (b"": it closed its side)."""
        try:
            return self.connection.recv(_READ_CHUNK)
        except OSError as e:        # idle past HTTP_IDLE_TIMEOUT_S, or reset
            raise _Gone from e

    def _next_event(self, seen: bytearray | None = None):
        """h11's next event, reading as it needs; what was read is added to `seen`."""
        while (event := self.h11.next_event()) is h11.NEED_DATA:
            data = self._recv()
            if seen is not None:
                seen += data
            self.h11.receive_data(data)
        return event

    def _next_request(self) -> h11.Request | None:
        """The next request's line and headers, or None when the client has
        closed the connection between requests."""
        self.method = b""
        seen = bytearray(self.h11.trailing_data[0])     # sent along with the request before
        event = self._next_event(seen)
        if type(event) is not h11.Request:
            return None
        self.method = event.method
        head = bytes(seen[:len(seen) - len(self.h11.trailing_data[0])])
        problem = _request_problem(event, head)
        if problem is not None:
            raise problem
        return event

    def _receive_body(self, keep: bool) -> bytes | None:
        """The body (b"" unless `keep`), or None once it is over the size
        limit; 100 Continue first where the client waits for it."""
        if self.h11.they_are_waiting_for_100_continue:
            self._send(h11.InformationalResponse(status_code=100, headers=[]))
        limit = self.receiver.max_message_bytes
        parts: list[bytes] = []
        total = 0
        while type(event := self._next_event()) is h11.Data:
            total += len(event.data)
            if total > limit:
                return None
            if keep:
                parts.append(event.data)
        return b"".join(parts)

    def _read_body(self, request: h11.Request) -> bytes:
        limit = self.receiver.max_message_bytes
        if _header(request, b"transfer-encoding"):
            length = None
        elif cl := _header(request, b"content-length"):
            length = int(cl[0])           # digits, one value: h11 checked
        else:
            self.close_connection = True
            raise _ProtocolError(LENGTH_REQUIRED, "Content-Length or chunked encoding is required")
        if length is not None and length > limit:
            self.close_connection = True
            raise _ProtocolError(TOO_LARGE, f"request of {length} bytes is over the limit "
                                            f"of {limit} bytes")
        body = self._receive_body(keep=True)
        if body is None:
            self.close_connection = True
            raise _ProtocolError(TOO_LARGE, f"request is over the limit of {limit} bytes")
        return body

    def _discard_body(self, request: h11.Request) -> None:
        """Read an unwanted body up to the size limit so the connection stays
        usable; close it otherwise (or when the client waits for a 100 Continue
        before sending it)."""
        cl = _header(request, b"content-length")
        if (self.close_connection or self.h11.they_are_waiting_for_100_continue
                or (cl and int(cl[0]) > self.receiver.max_message_bytes)
                or self._receive_body(keep=False) is None):
            self.close_connection = True

    # ---- requests ----

    def _post(self, request: h11.Request) -> None:
        try:
            authorization = _header(request, b"authorization")
            if not self.receiver.authorized(authorization[0] if len(authorization) == 1 else None):
                raise _ProtocolError(UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
            path = urlsplit(request.target.decode("ascii")).path
            if path != HTTP_PATH:
                raise _ProtocolError(NOT_FOUND, f"no such path {path!r}; traces go to {HTTP_PATH}")
            ctype = (_header(request, b"content-type") or [""])[0].split(";")[0].strip().lower()
            if ctype != PROTOBUF:
                raise _ProtocolError(UNSUPPORTED_MEDIA_TYPE,
                                     f"Content-Type {ctype or '(none)'!r} is not supported; "
                                     f"send {PROTOBUF}")
            encoding = (_header(request, b"content-encoding") or [""])[0].strip().lower()
            if encoding not in ("", "identity", "gzip"):
                raise _ProtocolError(UNSUPPORTED_MEDIA_TYPE,
                                     f"Content-Encoding {encoding!r} is not supported; use gzip")
            body = self._read_body(request)
            self.server.hold(self.connection)
            if encoding == "gzip":
                body = _gunzip(body, self.receiver.max_message_bytes)
        except _ProtocolError as e:
            self.receiver._count("http", e.kind)
            self._reply_error(request, _Outcome(e.kind, str(e)))
            return
        try:
            outcome = self.receiver._handle_payload(body, "http", self.peer.host, self.peer)
        except Exception:
            self.receiver._ratelog(logging.ERROR, "http", "OTLP HTTP request failed", exc_info=True)
            outcome = _Outcome(ERROR, "internal error")
        if outcome.kind in (OK, PARTIAL):
            self._reply(200, outcome.response)
        else:
            self._reply_error(request, outcome)

    def _other_method(self, request: h11.Request) -> None:
        path = urlsplit(request.target.decode("ascii")).path
        kind = METHOD_NOT_ALLOWED if path == HTTP_PATH else NOT_FOUND
        self.receiver._count("http", kind)
        self._reply_error(request, _Outcome(kind, f"{request.method.decode()} {path} is not served; "
                                                  f"POST {HTTP_PATH} takes traces"))

    def _refuse(self, error: h11.RemoteProtocolError) -> None:
        """Answer a request that breaks HTTP/1.1 (counted) and close: nothing
        after it on the connection can be told apart from its body."""
        if self.server.cut_off(self.connection):
            return                                 # counted as a timeout
        self.receiver._count("http", MALFORMED_HTTP)
        log.debug("OTLP HTTP %s: malformed request: %s", self.client_address[0], error)
        self.close_connection = True
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        status = error.error_status_hint if 400 <= error.error_status_hint < 600 else 400
        try:
            self._reply(status, _status_bytes(INVALID, f"malformed HTTP request: {str(error)[:200]}"))
        except _Gone:
            return
        self._linger()

    # ---- replies ----

    def _reply_error(self, request: h11.Request, outcome: _Outcome) -> None:
        if outcome.kind in (NOT_FOUND, METHOD_NOT_ALLOWED, UNSUPPORTED_MEDIA_TYPE, UNAUTHENTICATED):
            self._discard_body(request)
        headers = {}
        if outcome.kind == METHOD_NOT_ALLOWED:
            headers["Allow"] = "POST"
        if outcome.kind == UNAUTHENTICATED:
            headers["WWW-Authenticate"] = "Bearer"
        if outcome.retry_after_s is not None:
            headers["Retry-After"] = str(max(0, math.ceil(outcome.retry_after_s)))
        self._reply(_HTTP_STATUS[outcome.kind],
                    _status_bytes(outcome.kind, outcome.message, outcome.retry_after_s), headers)

    def _reply(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        fields = [("Content-Type", PROTOBUF), ("Content-Length", str(len(body))),
                  ("Server", SERVER_NAME), ("Date", formatdate(usegmt=True)),
                  *(headers or {}).items()]
        if self.close_connection:
            fields.append(("Connection", "close"))
        events = [h11.Response(status_code=code, headers=fields, reason=HTTPStatus(code).phrase)]
        if self.method != b"HEAD":
            events.append(h11.Data(data=body))
        events.append(h11.EndOfMessage())
        self._send(*events)
        if self.h11.our_state is h11.DONE:
            self.server.track(self.connection, True)   # the next request's deadline

    def _send(self, *events) -> None:
        data = b"".join(self.h11.send(event) for event in events)
        try:
            self.connection.sendall(data)
        except OSError as e:
            self.h11.send_failed()
            raise _Gone from e

    def _linger(self) -> None:
        """Before closing on a body we did not read, half-close and discard
        what the client is still sending (bounded), so that its kernel does
        not get a reset and lose our answer before the client reads it."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(LINGER_S)
            budget = LINGER_BYTES
            while budget > 0:
                got = self.connection.recv(min(budget, _READ_CHUNK))
                if not got:
                    break
                budget -= len(got)
        except OSError:
            pass


class _Gone(Exception):
    """The connection failed, timed out or was shut: nothing more to answer."""


def _gunzip(body: bytes, limit: int) -> bytes:
    """Decompress one or more gzip members, refusing output over `limit`
    bytes before producing it (a small bomb cannot blow up memory)."""
    out: list[bytes] = []
    total = 0
    data = body
    try:
        while True:
            d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            chunk = d.decompress(data, limit - total + 1)
            total += len(chunk)
            if total > limit:
                raise _ProtocolError(TOO_LARGE, f"request is over the limit of {limit} bytes "
                                                "once decompressed")
            out.append(chunk)
            if not d.eof:
                raise _ProtocolError(INVALID, "gzip body is truncated")
            data = d.unused_data
            if not data:
                break
    except zlib.error as e:
        raise _ProtocolError(INVALID, f"gzip body is not valid: {e}") from None
    return b"".join(out)
