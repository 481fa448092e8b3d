"""Per-flow counters of the TC classifier → cumulative totals per (direction,
protocol, modality) that never go down, and the Jitter Sensitivity Score over
a window of those totals."""

from __future__ import annotations

import socket
from collections import deque
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from spanlet import events

# The kernel's per-direction arrays are indexed in this order (SPANLET_DIR_*).
DIRECTIONS = ("ingress", "egress")
# Flows whose TCP payload has not been seen yet are held back from the totals
# (so that their handshake counts under the class they end up with) until
# classified, idle, gone, or this old.
PENDING_GRACE_S = 10.0


@dataclass
class FlowSample:
    """One flow as read from the maps."""
    key: bytes
    l4proto: int
    proto: int          # events.Proto; 0 while a TCP flow has carried no payload
    modality: int
    packets: tuple[int, int]   # by direction
    bytes: tuple[int, int]
    media: int = 0
    late: int = 0

    def values(self) -> tuple[int, ...]:
        return (*self.packets, *self.bytes, self.media, self.late)


_ZERO = (0, 0, 0, 0, 0, 0)


@dataclass
class _FlowState:
    first_seen: float
    last_change: float
    attributed: tuple[int, ...] = _ZERO
    seen: tuple[int, ...] = _ZERO
    proto: int = 0
    modality: int = 0
    l4proto: int = 0


def _proto_name(proto: int, l4proto: int) -> str:
    if proto:
        return events.Proto(proto).name
    return "tcp" if l4proto == socket.IPPROTO_TCP else "udp"


def _modality_name(m: int) -> str:
    return events.Modality(m).name if m < len(events.Modality) else "other"


class FlowAggregator:
    """Per-flow kernel counters → cumulative totals that never go down.

    Each read adds what a flow gained since the previous read to the class and
    modality the flow has at that read; a flow that vanished (evicted) or was
    re-created (its counters went down) keeps what was already counted."""

    def __init__(self, idle_timeout_s: float, pending_grace_s: float = PENDING_GRACE_S):
        self.idle_timeout_s = idle_timeout_s
        self.pending_grace_s = pending_grace_s
        self._flows: dict[bytes, _FlowState] = {}
        self.traffic: dict[tuple[str, str, str], list[int]] = {}
        self.jitter: dict[tuple[str, str], list[int]] = {}

    def _attribute(self, st: _FlowState) -> None:
        delta = [s - a for s, a in zip(st.seen, st.attributed)]
        st.attributed = st.seen
        if not any(delta):
            return
        proto, mod = _proto_name(st.proto, st.l4proto), _modality_name(st.modality)
        for d, direction in enumerate(DIRECTIONS):
            if delta[d] or delta[2 + d]:
                t = self.traffic.setdefault((direction, proto, mod), [0, 0])
                t[0] += delta[d]
                t[1] += delta[2 + d]
        if delta[4] or delta[5]:
            j = self.jitter.setdefault((proto, mod), [0, 0])
            j[0] += delta[4]
            j[1] += delta[5]

    def update(self, now: float, samples: Iterable[FlowSample]) -> list[bytes]:
        """Fold one read of the maps in; return the keys idle for idle_timeout_s
        (delete them from the maps, then call forget())."""
        present = set()
        for s in samples:
            present.add(s.key)
            vals = s.values()
            st = self._flows.get(s.key)
            if st is None:
                st = self._flows[s.key] = _FlowState(first_seen=now, last_change=now)
            elif any(v < o for v, o in zip(vals, st.seen)):
                # Evicted and re-created between two reads: close the old one.
                self._attribute(st)
                st.attributed = st.seen = _ZERO
                st.first_seen = now
            if vals != st.seen:
                st.last_change = now
            st.seen, st.proto, st.modality, st.l4proto = vals, s.proto, s.modality, s.l4proto
            if st.proto or now - st.first_seen >= self.pending_grace_s:
                self._attribute(st)
        for key in [k for k in self._flows if k not in present]:
            self._attribute(self._flows.pop(key))
        return [k for k, st in self._flows.items() if now - st.last_change >= self.idle_timeout_s]

    def forget(self, keys: Iterable[bytes]) -> None:
        """The flows were deleted from the maps: count what they still held."""
        for key in keys:
            st = self._flows.pop(key, None)
            if st is not None:
                self._attribute(st)

    def __len__(self) -> int:
        return len(self._flows)


class JitterStats(NamedTuple):
    media_packets: int         # cumulative
    late_packets: int          # cumulative
    jss: float                 # late / media over the window (0.0 with no media)
    window_media_packets: int
    window_late_packets: int


class JssWindow:
    """History of the cumulative (media, late) counts, for JSS over a window."""

    def __init__(self, horizon_s: float = 900.0):
        self.horizon_s = horizon_s
        self._hist: deque[tuple[float, dict[tuple[str, str], tuple[int, int]]]] = deque()

    def record(self, now: float, totals: dict[tuple[str, str], list[int] | tuple[int, int]]) -> None:
        snap = {k: (v[0], v[1]) for k, v in totals.items()}
        if self._hist and self._hist[-1][1] == snap:
            return  # nothing moved: the older point serves as well
        self._hist.append((now, snap))
        while len(self._hist) > 2 and self._hist[1][0] <= now - self.horizon_s:
            self._hist.popleft()

    def stats(self, now: float, window_s: float) -> dict[tuple[str, str], JitterStats]:
        if not self._hist:
            return {}
        current = self._hist[-1][1]
        base = self._hist[0][1]
        for t, snap in self._hist:
            if t <= now - window_s:
                base = snap
            else:
                break
        out = {}
        for key, (media, late) in current.items():
            m0, l0 = base.get(key, (0, 0))
            wm, wl = media - m0, late - l0
            out[key] = JitterStats(media, late, wl / wm if wm else 0.0, wm, wl)
        return out

