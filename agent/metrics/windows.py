"""Window primitives of the serving metrics: uniform reservoirs, cumulative
histograms, per-window history, the label-cardinality limiter and the maths on them."""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from collections import Counter, deque
from typing import Iterable, Mapping

from spanlet.metrics import HistogramSample, Labels

OVERFLOW = "overflow"    # a free-text label value past the limiter's cap
MAX_LABEL_CHARS = 128
EMBEDDING_ZERO_NORM = "embedding_zero_norm"   # a reason of serving.REJECT_REASONS


class _Reject(Exception):
    """A contribution that does not count; `reason` is one of serving.REJECT_REASONS."""

    def __init__(self, reason: str):
        self.reason = reason


def percentile_linear(xs: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest
    ranks: numpy.percentile(xs, q, method="linear")."""
    s = sorted(xs)
    h = (len(s) - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (h - lo) * (s[hi] - s[lo])


def cosine_distance(a, b) -> float:
    """1 - cos(a, b); raises _Reject for a zero vector."""
    na = math.sqrt(math.fsum(x * x for x in a))
    nb = math.sqrt(math.fsum(x * x for x in b))
    if na == 0 or nb == 0:
        raise _Reject(EMBEDDING_ZERO_NORM)
    return 1.0 - math.fsum(x * y for x, y in zip(a, b)) / (na * nb)


class _Reservoir:
    """Uniform sample of at most `cap` items (algorithm R). `slot()` says where
    the next item goes, or None, before the caller pays for building it."""

    __slots__ = ("cap", "items", "seen")

    def __init__(self, cap: int, items=None):
        self.cap = cap
        self.items = [] if items is None else items
        self.seen = 0

    def slot(self, rng: random.Random) -> int | None:
        self.seen += 1
        if len(self.items) < self.cap:
            return len(self.items)
        j = rng.randrange(self.seen)
        return j if j < self.cap else None

    def put(self, slot: int, item) -> None:
        if slot == len(self.items):
            self.items.append(item)
        else:
            self.items[slot] = item

    def retract(self) -> None:
        """The item of the last slot() turned out bad: it was never seen."""
        self.seen -= 1


class _Histograms:
    """Cumulative histograms by label set; series idle past a cutoff are dropped."""

    def __init__(self, bounds: Iterable[float]):
        self.bounds = tuple(bounds)
        self._series: dict[Labels, list] = {}     # labels -> [bucket counts, sum, count, last]

    def observe(self, lab: Labels, x: float, now: float) -> None:
        s = self._series.get(lab)
        if s is None:
            s = self._series[lab] = [[0] * (len(self.bounds) + 1), 0.0, 0, now]
        s[0][bisect_left(self.bounds, x)] += 1    # x <= bound falls in that bound's bucket
        s[1] += x
        s[2] += 1
        s[3] = now

    def expire(self, cutoff: float) -> None:
        for lab in [k for k, s in self._series.items() if s[3] < cutoff]:
            del self._series[lab]

    def samples(self) -> list[HistogramSample]:
        return [HistogramSample(lab, self.bounds, tuple(s[0]), s[1], s[2])
                for lab, s in sorted(self._series.items())]


class _WindowHistory:
    """The last n closed windows' values per series (None: nothing that window);
    a series with nothing in all of them is forgotten."""

    def __init__(self, n: int):
        self.n = n
        self._h: dict[Labels, deque] = {}

    def push(self, values: Mapping[Labels, float]) -> None:
        for lab in values.keys() - self._h.keys():
            self._h[lab] = deque(maxlen=self.n)
        for lab, hist in list(self._h.items()):
            hist.append(values.get(lab))
            if all(v is None for v in hist):
                del self._h[lab]

    def defined(self) -> Iterable[tuple[Labels, list[float]]]:
        for lab, hist in sorted(self._h.items()):
            yield lab, [v for v in hist if v is not None]


class _LabelLimiter:
    """At most `cap` live values per free-text label; more fold into OVERFLOW
    (counted). Values not seen for `idle_s` are forgotten at prune()."""

    def __init__(self, cap: int, idle_s: float):
        self.cap, self.idle_s = cap, idle_s
        self._seen: dict[str, dict[str, float]] = {}
        self.overflows: Counter = Counter()

    def value(self, label: str, value: str, now: float) -> str:
        value = value[:MAX_LABEL_CHARS]
        seen = self._seen.setdefault(label, {})
        if value in seen or len(seen) < self.cap:
            seen[value] = now
            return value
        self.overflows[label] += 1
        return OVERFLOW

    def prune(self, now: float) -> None:
        cutoff = now - self.idle_s
        for seen in self._seen.values():
            for v in [v for v, t in seen.items() if t < cutoff]:
                del seen[v]
