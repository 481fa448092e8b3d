"""The TC classifier's class totals (kept by the kernel per protocol and
modality) as labelled totals, the flows idle long enough to leave the per-flow
maps, and the Jitter Sensitivity Score over a window of the totals."""

from __future__ import annotations

import socket
from collections import deque
from typing import Iterable, NamedTuple

from spanlet import events

# The kernel's per-direction arrays are indexed in this order (SPANLET_DIR_*).
DIRECTIONS = ("ingress", "egress")
# The packets of a TCP flow that has carried no payload are held back from the
# totals (so that its handshake counts under the class it ends up with) until
# the flow is classified, ends (FIN, RST), or is this old: then they are tcp.
PENDING_GRACE_S = 10.0


def _proto_name(proto: int, l4proto: int) -> str:
    if proto:
        return events.Proto(proto).name
    return "tcp" if l4proto == socket.IPPROTO_TCP else "udp"


def _modality_name(m: int) -> str:
    return events.Modality(m).name if m < len(events.Modality) else "other"


# The kernel's class totals: slot proto * MOD_N + modality (bpf/tc_classify.h:
# class_of(), TC_MOD_N, TC_PROTO_N).
MOD_N = 5
PROTO_N = 8
CLASSES = PROTO_N * MOD_N


def class_name(index: int) -> tuple[str, str]:
    """(protocol, modality) of a class slot; the kernel never fills proto 0."""
    proto, mod = divmod(index, MOD_N)
    return (events.Proto(proto).name if 0 < proto < len(events.Proto) else "tcp"), _modality_name(mod)


def class_traffic(rows: Iterable[tuple[int, tuple[int, int], tuple[int, int]]]
                  ) -> dict[tuple[str, str, str], tuple[int, int]]:
    """{(direction, protocol, modality): (packets, bytes)} of the class slots
    (index, packets by direction, bytes by direction) that saw traffic."""
    out = {}
    for index, packets, nbytes in rows:
        proto, mod = class_name(index)
        for d, direction in enumerate(DIRECTIONS):
            if packets[d] or nbytes[d]:
                out[(direction, proto, mod)] = (packets[d], nbytes[d])
    return out


def class_jitter(rows: Iterable[tuple[int, int, int]]) -> dict[tuple[str, str], tuple[int, int]]:
    """{(protocol, modality): (media, late)} of the class slots (index, media, late) with media."""
    return {class_name(i): (media, late) for i, media, late in rows if media or late}


def idle_flows(counters: Iterable[tuple[bytes, tuple[int, ...]]], now_ns: int,
               idle_ns: int) -> list[bytes]:
    """Keys whose last packet (the latest of the per-CPU last_ns) is idle_ns old."""
    return [key for key, last in counters if now_ns - max(last) >= idle_ns]


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

