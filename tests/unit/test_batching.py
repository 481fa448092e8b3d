"""The one batching worker (exporters/batching.py) on a plain queue of its own:
batches by size and by schedule, flush, retries with backoff, a refusal, an
export that raises, producers that never wait, and shutdown against one
deadline (safe twice, what comes later refused)."""

from __future__ import annotations

import random
import threading
import time

from spanlet.exporters.batching import (EXPORTED, REFUSED, SHUTDOWN, Backoff, BatchWorker,
                                        ExportResult)


class ListQueue:
    """A BatchQueue of ints: at most `bound` queued, batches of `batch` items."""

    def __init__(self, bound: int = 100, batch: int = 4):
        self.bound, self.batch = bound, batch
        self.items: list[int] = []
        self.sealed = 0            # items due because the schedule, a flush or shutdown said so
        self.in_flight = 0
        self.dropped = self.refused = 0
        self.settled: list[tuple[list[int], str]] = []
        self.closed_with: list[int] | None = None

    def put(self, item: int) -> bool:
        if len(self.items) >= self.bound:
            self.dropped += 1
            return False
        self.items.append(item)
        return True

    def refuse(self, item: int) -> None:
        self.refused += 1

    def ready(self) -> bool:
        return len(self.items) >= self.batch or self.sealed > 0

    def seal(self) -> None:
        self.sealed = len(self.items)

    def take(self):
        n = self.batch if len(self.items) >= self.batch else min(self.sealed, len(self.items))
        if not n:
            return None
        batch, self.items = self.items[:n], self.items[n:]
        self.sealed = max(0, self.sealed - n)
        self.in_flight += n
        return batch

    def idle(self) -> bool:
        return not self.items and not self.in_flight

    def settle(self, batch, outcome, result) -> None:
        self.in_flight -= len(batch)
        self.settled.append((batch, outcome))

    def close(self) -> None:
        self.closed_with = list(self.items)


def worker(queue, export, delay_s=60.0, backoff=None) -> BatchWorker:
    w = BatchWorker(queue, export, backoff or Backoff(0.01, 0.02, rng=random.Random(1)),
                    schedule_delay_s=delay_s, name="test-batching", join_grace_s=0.5)
    w.start()
    return w


def test_full_batches_go_at_once_and_a_flush_sends_the_rest():
    sent: list[list[int]] = []
    q = ListQueue(batch=4)
    w = worker(q, lambda b, _t: sent.append(list(b)) or ExportResult(True))
    for i in range(10):
        assert w.put(i)
    deadline = time.monotonic() + 5
    while len(sent) < 2 and time.monotonic() < deadline:   # no schedule tick within the test: size alone
        time.sleep(0.01)
    assert sent == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert w.force_flush(5.0)
    assert sent[-1] == [8, 9] and q.idle()
    assert [o for _, o in q.settled] == [EXPORTED] * 3
    assert w.shutdown(1.0) and q.closed_with == []


def test_the_schedule_delay_sends_a_partial_batch():
    sent = threading.Event()
    q = ListQueue(batch=100)
    w = worker(q, lambda b, _t: sent.set() or ExportResult(True), delay_s=0.05)
    w.put(1)
    assert sent.wait(5), "the schedule tick never sent the lone item"
    w.shutdown(1.0)


def test_retryable_answers_are_retried_with_backoff_and_refusals_are_not():
    answers = iter([ExportResult(False, retryable=True), ExportResult(False, retryable=True, retry_after_s=0.05),
                    ExportResult(True), ExportResult(False, retryable=False, message="bad")])
    q = ListQueue(batch=1)
    w = worker(q, lambda b, _t: next(answers))
    w.put(1)
    assert w.force_flush(5.0)
    w.put(2)
    assert w.force_flush(5.0)
    assert q.settled == [([1], EXPORTED), ([2], REFUSED)]
    assert w.retries == 2
    assert list(w.retry_delays)[1] >= 0.05        # never sooner than the destination asked
    assert 0.005 <= list(w.retry_delays)[0] <= 0.01
    w.shutdown(1.0)


def test_an_export_that_raises_is_a_refusal_and_the_worker_goes_on():
    calls = []

    def export(batch, _t):
        calls.append(batch)
        if len(calls) == 1:
            raise RuntimeError("bug in export")
        return ExportResult(True)

    q = ListQueue(batch=1)
    w = worker(q, export)
    w.put(1)
    w.put(2)
    assert w.force_flush(5.0)
    assert q.settled == [([1], REFUSED), ([2], EXPORTED)]
    assert w.thread.is_alive()
    w.shutdown(1.0)


def test_producers_never_wait_on_a_stuck_export_and_drops_are_the_queues():
    release = threading.Event()
    q = ListQueue(bound=5, batch=1)
    w = worker(q, lambda b, _t: release.wait(10) and ExportResult(True))
    accepted: list[bool] = []
    producer = threading.Thread(target=lambda: accepted.extend(w.put(i) for i in range(50)))
    producer.start()
    producer.join(5)                              # the export stays stuck all this while
    assert not producer.is_alive() and len(accepted) == 50 and not release.is_set()
    assert accepted.count(False) == q.dropped > 0
    release.set()
    assert w.force_flush(5.0)
    assert sum(len(b) for b, o in q.settled if o == EXPORTED) == accepted.count(True)
    w.shutdown(1.0)


def test_shutdown_keeps_one_deadline_is_safe_twice_and_refuses_later_items():
    q = ListQueue(batch=1)
    w = worker(q, lambda b, _t: ExportResult(False, retryable=True),
               backoff=Backoff(0.05, 0.05, jitter=(1.0, 1.0)))
    for i in range(3):
        w.put(i)
    assert w.shutdown(0.3) is True                # returns although the destination never takes a batch
    assert ([0], SHUTDOWN) in q.settled
    assert q.closed_with is not None and set(q.closed_with) | {0} == {0, 1, 2}
    assert not w.thread.is_alive()
    assert w.shutdown(1.0) is False
    assert w.put(9) is False and q.refused == 1


class CountingCondition(threading.Condition):
    """A Condition that counts the worker's waits (each one a wake-up when it ends)."""

    def __init__(self):
        super().__init__()
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        return super().wait(timeout)


def test_an_idle_queue_sleeps_until_a_put_and_the_item_goes_at_the_next_tick():
    sent: list[list[int]] = []
    q, cond = ListQueue(batch=100), CountingCondition()
    w = BatchWorker(q, lambda b, _t: sent.append(list(b)) or ExportResult(True),
                    Backoff(0.01, 0.02, rng=random.Random(1)), schedule_delay_s=0.01,
                    name="test-batching", cond=cond, join_grace_s=0.5)
    w.start()
    time.sleep(0.5)                     # 50 ticks of nothing to do
    with cond:
        idle_waits = cond.waits
    assert idle_waits <= 2              # asleep, not once a tick
    assert w.put(7)
    deadline = time.monotonic() + 5
    while not sent and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sent == [[7]]                # woken by the put, sealed by the schedule (batch of 100 not full)
    w.shutdown(1.0)


def test_ticks_when_idle_keeps_the_schedule_for_a_queue_due_by_time_alone():
    """The metric exporter's queue: nothing is put, a collection falls due at each tick."""

    class Collections(ListQueue):
        def seal(self):
            self.items.append(len(self.settled))
            super().seal()

    sent: list[list[int]] = []
    q = Collections(batch=100)
    w = BatchWorker(q, lambda b, _t: sent.append(list(b)) or ExportResult(True),
                    Backoff(0.01, 0.02, rng=random.Random(1)), schedule_delay_s=0.01,
                    name="test-batching", join_grace_s=0.5, ticks_when_idle=True)
    w.start()
    deadline = time.monotonic() + 5
    while len(sent) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    w.shutdown(1.0)
    assert len(sent) >= 3
