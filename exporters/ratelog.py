"""A rate-limited log line: what the receiver, the exporters and the batching
worker log on every request or drop must not flood the log."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter


class RateLimitedLog:
    """At most one line per key every `interval_s`; the lines held back are
    counted and reported with the next one that gets through."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self._log = logger
        self._interval = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: Counter = Counter()

    def __call__(self, level: int, key: str, msg: str, *args, exc_info: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval:
                self._held[key] += 1
                return
            self._last[key] = now
            held = self._held.pop(key, 0)
        if held:
            msg += f" ({held} similar messages suppressed)"
        self._log.log(level, msg, *args, exc_info=exc_info)
