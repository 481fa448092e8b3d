"""A stand-in for the kernel's span facts map (spanlet.probes.span_facts.SpanFacts):
rows put in by the test (one per span and cgroup, as the kernel keeps them),
taken, listed, deleted and counted the same way."""

from __future__ import annotations

from spanlet.join import ANATOMY_FIELDS
from spanlet.probes.span_facts import KernelFacts, SpanFactsStats


def row(trace_id: bytes, span_id: int, *, driver: int = 0, runtime: int = 0,
        **fields) -> KernelFacts:
    """One row as the reader decodes it (launches by API summed into launches)."""
    return KernelFacts(trace_id=trace_id, span_id=span_id, launches=driver + runtime,
                       launches_by_api={"driver": driver, "runtime": runtime}, **fields)


class FakeFacts:
    """Rows by (trace id, span id, cgroup id); add() plays the kernel's part,
    index[(trace id, span id)] the cgroups in the order their rows were made
    (all of them: the fake's index never overflows unless `index_cgroups`)."""

    def __init__(self, index_cgroups: int | None = None):
        self.map: dict[tuple[bytes, int, int], KernelFacts] = {}
        self.index: dict[tuple[bytes, int], list[int]] = {}
        self.index_cgroups = index_cgroups
        self.st = SpanFactsStats()
        self.takes = 0                       # calls, found or not

    def add(self, trace_id: bytes, span_id: int, **kw) -> KernelFacts:
        """A new row, or more facts on the row already there (as the kernel adds)."""
        new = row(trace_id, span_id, **kw)
        key = (trace_id, span_id, new.cgroup_id)
        old = self.map.get(key)
        if old is None:
            self.map[key] = new
            self.index.setdefault((trace_id, span_id), []).append(new.cgroup_id)
            self.st.created += 1
            return new
        for name in ("launches", "launch_ns", "sync_wait_ns", "syncs", "violations",
                     "graph_launches", "graph_kernels", *ANATOMY_FIELDS):
            setattr(old, name, getattr(old, name) + getattr(new, name))
        return old

    def spans(self) -> list[tuple[bytes, int]]:
        """(trace id, span id) of every row left, in the order made."""
        return list(dict.fromkeys((t, s) for t, s, _ in self.map))

    def take_rows(self, trace_id: bytes, span_id: int, origin=None, pick=None):
        """As SpanFacts.take_rows: with `pick`, only the rows the span gets
        are taken, the others listed again for their own span."""
        self.takes += 1
        made = self.index.pop((trace_id, span_id), None)
        if made is None:
            return [] if pick is None else ([], [])
        cap = self.index_cgroups
        listed = list(dict.fromkeys(made if cap is None else made[:cap]))
        if origin and cap is not None and len(made) > cap:
            listed += [cg for cg in sorted(origin) if cg not in listed]
        if pick is None:
            got = [r for cg in listed if (r := self.map.pop((trace_id, span_id, cg), None))]
            self.st.taken += len(got)
            return got
        rows = [r for cg in listed if (r := self.map.get((trace_id, span_id, cg)))]
        kept, foreign = pick(rows, origin)
        for r in kept:
            del self.map[(trace_id, span_id, r.cgroup_id)]
        self.st.taken += len(kept)
        left = [r.cgroup_id for r in rows if not any(r is k for k in kept)]
        if left:
            self.index[(trace_id, span_id)] = left
        return kept, foreign

    def take(self, trace_id: bytes, span_id: int) -> KernelFacts | None:
        got = self.take_rows(trace_id, span_id)
        return got[0] if got else None

    def take_row(self, trace_id: bytes, span_id: int, cgroup_id: int) -> KernelFacts | None:
        self.index.pop((trace_id, span_id), None)
        got = self.map.pop((trace_id, span_id, cgroup_id), None)
        self.st.taken += got is not None
        return got

    def join_resource(self, blob: bytes, origin=None):
        """The real map's C join needs a real map (tests/kernel/test_join_wire.py
        shows it the same as this path): here the join takes rows one by one."""
        return None

    def rows(self) -> list[KernelFacts]:
        self.st.present = len(self.map)
        return list(self.map.values())

    def ages(self) -> list[tuple[bytes, int, int, int]]:
        return [(r.trace_id, r.span_id, r.cgroup_id, r.first_ns) for r in self.rows()]

    def delete(self, trace_id: bytes, span_id: int, cgroup_id: int) -> bool:
        self.index.pop((trace_id, span_id), None)
        gone = self.map.pop((trace_id, span_id, cgroup_id), None) is not None
        self.st.swept += gone
        return gone

    def stats(self) -> SpanFactsStats:
        return SpanFactsStats(**{**self.st.__dict__, "present": len(self.map)})
