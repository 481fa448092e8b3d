"""A stand-in for the kernel's span facts map (spanlet.probes.span_facts.SpanFacts):
rows put in by the test, taken, listed, deleted and counted the same way."""

from __future__ import annotations

from spanlet.probes.span_facts import KernelFacts, SpanFactsStats


def row(trace_id: bytes, span_id: int, *, driver: int = 0, runtime: int = 0,
        **fields) -> KernelFacts:
    """One row as the reader decodes it (launches by API summed into launches)."""
    return KernelFacts(trace_id=trace_id, span_id=span_id, launches=driver + runtime,
                       launches_by_api={"driver": driver, "runtime": runtime}, **fields)


class FakeFacts:
    """Rows by (trace id, span id); add() plays the kernel's part."""

    def __init__(self):
        self.map: dict[tuple[bytes, int], KernelFacts] = {}
        self.st = SpanFactsStats()
        self.takes = 0                       # calls, found or not

    def add(self, trace_id: bytes, span_id: int, **kw) -> KernelFacts:
        """A new row, or more facts on the row already there (as the kernel adds)."""
        new = row(trace_id, span_id, **kw)
        old = self.map.get((trace_id, span_id))
        if old is None:
            self.map[(trace_id, span_id)] = new
            self.st.created += 1
            return new
        for name in ("launches", "launch_ns", "sync_wait_ns", "syncs", "violations",
                     "graph_launches", "graph_kernels"):
            setattr(old, name, getattr(old, name) + getattr(new, name))
        return old

    def take(self, trace_id: bytes, span_id: int) -> KernelFacts | None:
        self.takes += 1
        got = self.map.pop((trace_id, span_id), None)
        self.st.taken += got is not None
        return got

    def join_resource(self, blob: bytes):
        """The real map's C join needs a real map (tests/kernel/test_join_wire.py
        shows it the same as this path): here the join takes rows one by one."""
        return None

    def rows(self) -> list[KernelFacts]:
        self.st.present = len(self.map)
        return list(self.map.values())

    def ages(self) -> list[tuple[bytes, int, int]]:
        return [(r.trace_id, r.span_id, r.first_ns) for r in self.rows()]

    def delete(self, trace_id: bytes, span_id: int) -> bool:
        gone = self.map.pop((trace_id, span_id), None) is not None
        self.st.swept += gone
        return gone

    def stats(self) -> SpanFactsStats:
        return SpanFactsStats(**{**self.st.__dict__, "present": len(self.map)})
