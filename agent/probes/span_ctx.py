"""Loader of bpf/span_ctx.bpf.c: owns the span_ctx map that the other
process-context probes read to stamp events with the calling thread's span."""

from __future__ import annotations

from agent import events
from agent.probes.base import Probe


class SpanCtxProbe(Probe):
    name = "span_ctx"

    def ringbuf_pages(self) -> int:
        return 1  # no records of its own yet

    def _attach(self) -> None:
        """Nothing to attach yet: the map alone is what the others need."""

    def set(self, tid: int, trace_id: bytes, span_id: int, modality: events.Modality) -> None:
        """Write one thread's context (the marker uprobe does this in the kernel)."""
        table = self.bpf["span_ctx"]
        val = table.Leaf()
        for i, b in enumerate(trace_id[:16]):
            val.trace_id[i] = b
        val.span_id = span_id
        val.modality = int(modality)
        table[table.Key(tid)] = val

    def clear(self, tid: int) -> None:
        table = self.bpf["span_ctx"]
        try:
            del table[table.Key(tid)]
        except KeyError:
            pass
