"""The one batching worker in the OpenTelemetry SDK's shape (its BatchProcessor) behind span export,
metric export and the store: a bounded queue strategy, one thread, retries with backoff, flush and shutdown."""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generic, Protocol, TypeVar

from spanlet.exporters.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

B = TypeVar("B")

# What became of a batch: the `outcome` BatchQueue.settle gets.
EXPORTED = "exported"    # the destination took it
REFUSED = "refused"      # a final answer (or a bug in export): not retried
GAVE_UP = "gave_up"      # retryable, but the next try would start past the policy's max_elapsed_s
SHUTDOWN = "shutdown"    # the shutdown deadline came first


@dataclass
class ExportResult:
    """One export attempt's answer."""
    ok: bool
    retryable: bool = False
    retry_after_s: float | None = None    # the delay the destination asked for (RetryInfo, Retry-After)
    message: str = ""


def backoff_delay(failures: int, min_s: float, max_s: float, rng: random.Random,
                  jitter: tuple[float, float] = (0.5, 1.0)) -> float:
    """Wait before retry number `failures` (1, 2, ...): steps doubling from min_s, capped at max_s, each
    scaled by a factor drawn from `jitter` so that agents that lost their destination together do not
    come back together (the default is equal jitter: half the step fixed, half random)."""
    step = min(max_s, min_s * (2 ** min(failures - 1, 32)))
    low, high = jitter
    return step * low + rng.uniform(0, step * (high - low))


@dataclass(frozen=True)
class Backoff:
    """The retry policy: exponential backoff with jitter, never sooner than the destination asked, for at
    most max_elapsed_s after a batch's first try (then the batch is given up)."""
    initial_s: float
    max_s: float
    jitter: tuple[float, float] = (0.5, 1.0)
    max_elapsed_s: float = math.inf
    rng: random.Random = field(default_factory=random.Random)

    def delay(self, attempt: int, asked_s: float | None) -> float:
        """Seconds before retry `attempt` (0 for the first retry)."""
        return max(asked_s or 0.0, backoff_delay(attempt + 1, self.initial_s, self.max_s, self.rng, self.jitter))


class BatchQueue(Protocol[B]):
    """What one worker batches: its bounds, its batches and its books. Every method runs under the
    worker's `cond`. put and refuse are the producers' side (both never wait, and count and log what they
    drop); the rest is the worker's."""

    def put(self, item) -> bool: ...            # False when some of it was dropped
    def refuse(self, item) -> None: ...         # offered after shutdown began
    def ready(self) -> bool: ...                # take() would return a batch now
    # seal: the schedule delay passed, or a flush or shutdown began: what is queued now is due
    def seal(self) -> None: ...
    def take(self) -> B | None: ...             # a full batch, or a sealed one; None when nothing is due
    def idle(self) -> bool: ...                 # nothing queued and nothing in flight
    def settle(self, batch: B, outcome: str, result: ExportResult | None) -> None: ...
    def close(self) -> None: ...                # the worker stopped for good: drop (or keep) what is left


class BatchWorker(Generic[B]):
    """One thread that takes batches from `queue` when one is full or the schedule delay passed, and hands
    each to `export(batch, timeout_s)` (timeout_s: what is left before the shutdown deadline, else None)
    until it is settled: a retryable answer is retried as `backoff` says, bounded by the shutdown deadline.

    force_flush(timeout_s) exports what is queued now; shutdown(timeout_s) does the same against one
    deadline, then stops and closes the queue (safe twice). Producers call put(), which never blocks.

    While the queue is idle the thread sleeps until a put, a flush or shutdown (an idle agent's threads
    do not wake each schedule delay), then keeps the schedule's grid; `ticks_when_idle` keeps it waking
    at every tick, for a queue whose batches fall due by the schedule alone (the metric collections)."""

    def __init__(self, queue: BatchQueue[B], export: Callable[[B, float | None], ExportResult],
                 backoff: Backoff, *, schedule_delay_s: float, name: str,
                 cond: threading.Condition | None = None, join_grace_s: float = 2.0,
                 logger: logging.Logger = log, ticks_when_idle: bool = False) -> None:
        self.cond = cond if cond is not None else threading.Condition()
        self._queue, self._export, self._backoff = queue, export, backoff
        self._delay_s, self.name, self._join_grace_s = schedule_delay_s, name, join_grace_s
        self._ratelog = RateLimitedLog(logger)
        self._closing = False
        self._deadline: float | None = None          # shutdown deadline (monotonic)
        self._flush_wanted = self._flush_sealed = self._flush_done = 0
        self._ticks_when_idle = ticks_when_idle
        self._asleep = False                         # the thread waits, idle, for a put
        self._delivering = threading.Lock()          # one batch in export at a time
        self.retries = 0                             # re-sends planned (each followed by a wait)
        self.retry_delays: deque[float] = deque(maxlen=64)   # the last planned waits, oldest first
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.thread.start()

    @property
    def closing(self) -> bool:
        """Shutdown began (read it under `cond`)."""
        return self._closing

    # ---- producers ----

    def put(self, item) -> bool:
        """Queue `item` without waiting; False when some of it was dropped."""
        with self.cond:
            if self._closing:
                self._queue.refuse(item)
                return False
            accepted = self._queue.put(item)
            if self._queue.ready() or self._asleep:
                self._asleep = False
                self.cond.notify_all()
        return accepted

    # ---- flush and shutdown ----

    def force_flush(self, timeout_s: float) -> bool:
        """Export what is queued now; True when all of it was settled within the timeout."""
        with self.cond:
            if self.thread is None or self._closing:
                return self._queue.idle() and not (self.thread is not None and self.thread.is_alive())
            self._flush_wanted += 1
            target = self._flush_wanted
            self.cond.notify_all()
            self.cond.wait_for(lambda: self._flush_done >= target or not self.thread.is_alive(),
                               timeout=max(0.0, timeout_s))
            return self._flush_done >= target

    def shutdown(self, timeout_s: float) -> bool:
        """Export what is queued within `timeout_s`, stop the thread and close the queue. Safe to call
        twice: the second call does nothing and returns False."""
        with self.cond:
            if self._closing:
                return False
            self._closing = True
            self._deadline = time.monotonic() + timeout_s
            self._flush_wanted += 1
            self.cond.notify_all()
        grace_end = self._deadline + self._join_grace_s
        if self.thread is not None:
            self.thread.join(timeout=max(0.0, grace_end - time.monotonic()))
            if self.thread.is_alive():
                log.warning("%s: an export outlived the shutdown deadline; its batch is settled when it ends",
                            self.name)
        if self._delivering.acquire(timeout=max(0.0, grace_end - time.monotonic())):
            self._delivering.release()              # a deliver() on a caller's thread ended too
        with self.cond:
            self._queue.close()
            self.cond.notify_all()
        return True

    # ---- delivery ----

    def deliver(self, batch: B) -> str:
        """Export `batch` until it is settled, on the calling thread (the worker's, or a caller's that
        sends at once); returns its outcome."""
        with self._delivering:
            try:
                outcome, result = self._attempts(batch)
            except Exception:   # a bug in export must not kill the worker or the caller
                self._ratelog(logging.ERROR, "deliver", "%s: export failed", self.name, exc_info=True)
                outcome, result = REFUSED, None
        with self.cond:
            self._queue.settle(batch, outcome, result)
            self.cond.notify_all()
        return outcome

    def _attempts(self, batch: B) -> tuple[str, ExportResult | None]:
        give_up = time.monotonic() + self._backoff.max_elapsed_s
        attempt = 0
        while True:
            with self.cond:
                deadline = self._deadline
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                return SHUTDOWN, None
            result = self._export(batch, timeout)
            if result.ok:
                return EXPORTED, result
            if not result.retryable:
                return REFUSED, result
            delay = self._backoff.delay(attempt, result.retry_after_s)
            now = time.monotonic()
            if now + delay > give_up:
                return GAVE_UP, result
            with self.cond:
                if self._deadline is not None and now + delay > self._deadline:
                    return SHUTDOWN, result
                self.retries += 1
                self.retry_delays.append(delay)
                self._sleep_locked(now + delay)
            attempt += 1

    def _sleep_locked(self, until: float) -> None:
        """Wait until `until`; only the shutdown deadline cuts the wait short."""
        while True:
            left = until - time.monotonic()
            if self._deadline is not None:
                left = min(left, self._deadline - time.monotonic())
            if left <= 0:
                return
            self.cond.wait(left)

    # ---- the thread ----

    def _run(self) -> None:
        next_tick = time.monotonic() + self._delay_s
        try:
            while True:
                with self.cond:
                    batch, next_tick = self._next_locked(next_tick)
                if batch is None or self.deliver(batch) == SHUTDOWN:
                    # after SHUTDOWN the destination is away and the deadline near: close() keeps the rest
                    return
        finally:
            with self.cond:
                self.cond.notify_all()              # flushes waiting on a thread that is gone

    def _next_locked(self, next_tick: float) -> tuple[B | None, float]:
        """The next batch due, waiting for one; None when shutdown is done (nothing due or deadline)."""
        while True:
            now = time.monotonic()
            if self._closing and now >= self._deadline:
                return None, next_tick
            if now >= next_tick:      # keep the schedule's grid; skip ticks missed while busy
                next_tick += self._delay_s * (math.floor((now - next_tick) / self._delay_s) + 1)
                self._queue.seal()
            if self._flush_wanted > self._flush_sealed:
                self._flush_sealed = self._flush_wanted
                self._queue.seal()
            batch = self._queue.take()
            if batch is not None:
                return batch, next_tick
            if self._flush_done < self._flush_sealed:     # all that was sealed for it is settled
                self._flush_done = self._flush_sealed
                self.cond.notify_all()
            if self._closing:
                return None, next_tick
            if self._ticks_when_idle or not self._queue.idle():
                self.cond.wait(next_tick - now)
                continue
            self._asleep = True
            self.cond.wait()
            self._asleep = False
            now = time.monotonic()
            if now >= next_tick:      # the ticks slept through had nothing to seal: on to the next
                next_tick += self._delay_s * (math.floor((now - next_tick) / self._delay_s) + 1)
