"""Upstream OTLP export of the (enriched) spans the agent received: a bounded
queue, one worker sending batches over gRPC or HTTP/protobuf, and retries
with exponential backoff as the OTLP specification describes."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Mapping, Sequence

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans

from spanlet.config import OtlpConfig
from spanlet.exporters.otlp.transport import (
    INITIAL_BACKOFF_S,
    MAX_BACKOFF_S,
    RetryingSender,
    _Counters,
    _GrpcTransport,
    _HttpTransport,
)
from spanlet.exporters.otlp.upstream import GRPC, resolve_upstream
from spanlet.exporters.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

# The export queue's bound in bytes (serialized size of the queued spans), on
# top of cfg.queue_size in spans: a queue of large spans (attributes, span
# events) stays bounded in memory too. cfg.queue_max_bytes overrides it.
DEFAULT_QUEUE_MAX_BYTES = 64 * 1024 * 1024


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
