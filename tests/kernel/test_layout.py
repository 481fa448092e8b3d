"""The Python mirror of bpf/spanlet.h agrees with what the compiler laid out:
BCC builds ctypes types for map values from the C structs themselves."""

import ctypes

import pytest

from spanlet import events
from spanlet.probes.base import BPF_DIR, expand_source

pytestmark = pytest.mark.kernel

STRUCTS = {
    "spanlet_hdr": events.Header,
    "span_ctx_val": events.SpanCtx,
    "span_facts_key": events.SpanFactsKey,
    "span_facts_val": events.SpanFactsVal,
    "span_facts_index_key": events.SpanFactsIndexKey,
    "span_facts_index_val": events.SpanFactsIndexVal,
    "flow_key": events.FlowKey,
    "gpu_launch_event": events.GpuLaunch,
    "gpu_sync_event": events.GpuSync,
    "sandbox_event": events.SandboxViolation,
    "http_event": events.HttpRequest,
    "flow_event": events.FlowSeen,
    "http_bytes_event": events.HttpBytes,
}


def _fields(t):
    out = []
    for name, ftype, *_ in t._fields_:
        if name.startswith("_") or name.startswith("__pad"):
            continue
        out.append((name, getattr(t, name).offset, ctypes.sizeof(ftype)))
    return out


def test_python_structs_match_the_compiled_c(tmp_path):
    from bcc import BPF

    src = tmp_path / "layout.bpf.c"
    src.write_text('#include "spanlet.h"\n' + "".join(
        f"BPF_ARRAY(t_{name}, struct {name}, 1);\n" for name in STRUCTS))
    for h in ("spanlet.h", "spanlet_types.h"):
        (tmp_path / h).write_text((BPF_DIR / h).read_text())
    b = BPF(text=expand_source(src))
    try:
        for name, ours in STRUCTS.items():
            leaf = b[f"t_{name}"].Leaf
            assert ctypes.sizeof(leaf) == ctypes.sizeof(ours), name
            assert _fields(leaf) == _fields(ours), name
    finally:
        b.cleanup()
