"""Upstream OTLP export of the (enriched) spans the agent received: a queue bounded in spans and in bytes
behind the batching worker, which sends batches and retries them as the OTLP specification describes."""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Mapping, Sequence

from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans

from spanlet.config import OtlpConfig
from spanlet.exporters.batching import BatchWorker, ExportResult
from spanlet.exporters.otlp.common import varint
from spanlet.exporters.otlp.transport import (INITIAL_BACKOFF_S, MAX_BACKOFF_S, OtlpBatch, OtlpSender,
                                              _Counters)
from spanlet.exporters.otlp.upstream import resolve_upstream
from spanlet.exporters.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

# The export queue's bound in bytes (serialized size of the queued spans), on
# top of cfg.queue_size in spans: a queue of large spans (attributes, span
# events) stays bounded in memory too. cfg.queue_max_bytes overrides it.
DEFAULT_QUEUE_MAX_BYTES = 64 * 1024 * 1024

# ExportTraceServiceRequest.resource_spans: field 1, length-delimited
_RESOURCE_SPANS_TAG = b"\x0a"


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



class _SpanQueue:
    """The batching worker's queue of spans: at most `queue_size` spans and
    `queue_max_bytes` of them (serialized); what does not fit is dropped and
    counted (dropped_queue_full). Batches are cut at `batch_size` spans,
    keeping each piece's resource and scopes. Runs under the worker's lock."""

    def __init__(self, queue_size: int, queue_max_bytes: int, batch_size: int,
                 sender: OtlpSender | None) -> None:
        self.queue_size, self.queue_max_bytes, self.batch_size = queue_size, queue_max_bytes, batch_size
        self._sender = sender
        self.counters = sender.counters if sender is not None else _Counters()
        # (piece serialized, spans, bytes): serialized once when queued, so a
        # batch is its pieces' bytes joined, never a copy of each piece
        self._queue: deque[tuple[bytes, int, int]] = deque()
        self.queued = 0             # spans in _queue
        self.queued_bytes = 0       # their serialized size
        self._enqueued_total = 0    # spans ever accepted into the queue
        self.dequeued_total = 0     # spans ever taken out of it
        self._send_through = 0      # due until dequeued_total reaches this
        self._ratelog = RateLimitedLog(log)

    def put(self, resource_spans: Sequence[ResourceSpans]) -> bool:
        overflow = 0
        for rs in resource_spans:
            n = _spans_in(rs)
            if not n:
                continue
            room = self.queue_size - self.queued
            if n > room:
                overflow += n - room
                if not room:
                    continue
                rs, n = split_resource_spans(rs, room, n)[0], room
            pieces = split_resource_spans(rs, self.batch_size, self.batch_size) if n > self.batch_size else [rs]
            for piece in pieces:
                overflow += self._append(piece)
        if overflow:
            self.counters.dropped_queue_full += overflow
            self._ratelog(logging.WARNING, "queue_full",
                          "OTLP export queue full (%d spans, %d bytes): dropped %d spans, %d so far",
                          self.queue_size, self.queue_max_bytes, overflow, self.counters.dropped_queue_full)
        return not overflow

    def _append(self, piece: ResourceSpans) -> int:
        """Queue one piece; returns the spans dropped (all of it past the byte bound, else 0)."""
        k, data = _spans_in(piece), piece.SerializeToString()
        size = len(data)
        if self.queued_bytes + size > self.queue_max_bytes:
            return k
        self._queue.append((data, k, size))
        self.queued += k
        self.queued_bytes += size
        self._enqueued_total += k
        return 0

    def refuse(self, resource_spans: Sequence[ResourceSpans]) -> None:
        n = sum(_spans_in(rs) for rs in resource_spans)
        if n:
            self.counters.dropped_shutdown += n
            self._ratelog(logging.WARNING, "closed", "OTLP exporter is shut down; spans dropped")

    def ready(self) -> bool:
        return bool(self._queue) and (self.queued >= self.batch_size
                                      or self.dequeued_total < self._send_through)

    def seal(self) -> None:
        self._send_through = max(self._send_through, self._enqueued_total)

    def take(self) -> OtlpBatch | None:
        """The next batch: a serialized ExportTraceServiceRequest (its
        resource_spans, field 1, are the queued pieces' bytes) of at most
        batch_size spans; a piece larger than the room left is cut in two."""
        if not self.ready():
            return None
        parts = []
        room = self.batch_size
        while self._queue and room:
            data, n, size = self._queue[0]
            if n > room:
                head, tail = (p.SerializeToString() for p in
                              split_resource_spans(ResourceSpans.FromString(data), room, n))
                self._queue[0] = (tail, n - room, len(tail))
                self.queued_bytes += len(head) + len(tail) - size
                data, n, size = head, room, len(head)
            else:
                self._queue.popleft()
            parts += (_RESOURCE_SPANS_TAG, varint(size), data)
            self.queued_bytes -= size
            room -= n
        taken = self.batch_size - room
        self.queued -= taken
        self.dequeued_total += taken
        return OtlpBatch(b"".join(parts), taken)

    def idle(self) -> bool:
        return self.counters.settled >= self._enqueued_total

    def settle(self, batch: OtlpBatch, outcome: str, result: ExportResult | None) -> None:
        self._sender.settle(batch, outcome, result)

    def close(self) -> None:
        if self.queued:
            log.warning("OTLP export: %d spans still queued at the shutdown deadline were dropped",
                        self.queued)
            self.counters.dropped_shutdown += self.queued
            self.counters.settled += self.queued
            self.dequeued_total += self.queued
            self._queue.clear()
            self.queued = 0
            self.queued_bytes = 0


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
    and the one batch being retried, no more. The batching worker sends
    batches of up to cfg.batch_size spans every cfg.batch_interval_s, or as
    soon as a batch is full; a retryable failure is retried with exponential
    backoff and jitter (or after the delay the server asked for) for up to
    cfg.max_retry_s, after which the batch is dropped and counted, as is a
    batch refused for good.
    """

    def __init__(self, cfg: OtlpConfig, environ: Mapping[str, str] = os.environ, *,
                 initial_backoff_s: float = INITIAL_BACKOFF_S,
                 max_backoff_s: float = MAX_BACKOFF_S,
                 queue_max_bytes: int | None = None) -> None:
        if queue_max_bytes is None:
            queue_max_bytes = getattr(cfg, "queue_max_bytes", DEFAULT_QUEUE_MAX_BYTES)
        self.upstream = resolve_upstream(cfg, environ)
        self.enabled = self.upstream is not None
        self._cond = threading.Condition()
        self._sender: OtlpSender | None = None
        self._worker: BatchWorker[OtlpBatch] | None = None
        if not self.enabled:
            self._queue = _SpanQueue(cfg.queue_size, queue_max_bytes, cfg.batch_size, None)
            log.info("no OTLP upstream configured (upstream_endpoint, OTEL_EXPORTER_OTLP_ENDPOINT): "
                     "span export is off")
            return
        up = self.upstream
        self._sender = OtlpSender(up, "traces", initial_backoff_s=initial_backoff_s,
                                  max_backoff_s=max_backoff_s)
        self._queue = _SpanQueue(cfg.queue_size, queue_max_bytes, cfg.batch_size, self._sender)
        self._worker = BatchWorker(self._queue, self._sender.export, self._sender.backoff(cfg.max_retry_s),
                                   schedule_delay_s=cfg.batch_interval_s, name="otlp-export",
                                   cond=self._cond, logger=log)
        self._worker.start()
        log.info("exporting spans over OTLP %s to %s", up.protocol, up.endpoint)

    # ---- the OTel exporter shape ----

    def export(self, resource_spans: Sequence[ResourceSpans]) -> bool:
        """Queue the spans; False when any had to be dropped (queue full or
        after shutdown). Never blocks on the network."""
        if self._worker is None:
            return True
        return self._worker.put(resource_spans)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Send everything queued now; True when all of it got a final
        answer (exported or dropped) within the timeout."""
        if self._worker is None:
            return True
        return self._worker.force_flush(timeout_millis / 1000.0)

    def shutdown(self, timeout_millis: int = 30000) -> None:
        """Flush what is queued within the deadline, drop (and count) what is
        left, stop the worker and close the connection. Safe to call twice."""
        if self._worker is not None and self._worker.shutdown(timeout_millis / 1000.0):
            self._sender.close()

    def stats(self) -> dict:
        with self._cond:
            q, c = self._queue, self._queue.counters
            return {
                "enabled": self.enabled,
                "exported": c.exported,
                "rejected_upstream": c.rejected_upstream,
                "dropped_queue_full": c.dropped_queue_full,
                "dropped_failed": c.dropped_failed,
                "dropped_shutdown": c.dropped_shutdown,
                "retries": self._worker.retries if self._worker is not None else 0,
                "batches": c.batches,
                "queue_spans": q.queued,
                "queue_capacity": q.queue_size,
                "queue_bytes": q.queued_bytes,
                "queue_bytes_capacity": q.queue_max_bytes,
                # taken from the queue, not yet settled: the batch being sent or retried
                "inflight_spans": q.dequeued_total - c.settled,
            }

    @property
    def retry_delays(self) -> list[float]:
        """The last planned retry delays in seconds, oldest first."""
        with self._cond:
            return list(self._worker.retry_delays) if self._worker is not None else []
