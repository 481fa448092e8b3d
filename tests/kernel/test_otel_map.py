"""The OpenTelemetry shared context map (span_context.otel_map): while an
instrumented thread is in a span, the pinned map holds pid_tgid -> (trace id,
span id) in W3C byte order, read with bpftool as another tool would; the agent
creates the map (and removes it at stop) or shares one another tool pinned
(and leaves it), and never writes one of another layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from spanlet import config

pytestmark = pytest.mark.kernel
ROOT = Path(__file__).resolve().parents[2]
CHILD = ROOT / "tests" / "support" / "otel_map_child.py"


@pytest.fixture
def otel_path():
    """A pin path of this test's own (the default is /sys/fs/bpf/otel/traces_ctx_v1)."""
    folder = Path(f"/sys/fs/bpf/spanlet-otel-test-{uuid.uuid4().hex[:8]}")
    yield folder / "traces_ctx_v1"
    for p in (folder / "traces_ctx_v1", folder):
        if p.exists():
            p.rmdir() if p.is_dir() else p.unlink()


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, str(CHILD)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout.readline().startswith("ready")

    def say(cmd: str) -> list[str]:
        proc.stdin.write(cmd + "\n")
        proc.stdin.flush()
        return proc.stdout.readline().split()
    yield say
    proc.kill()
    proc.wait(5)


def start_probe(path: Path):
    from spanlet.probes.span_ctx import SpanCtxProbe
    cfg = config.load(env={}, overrides=["span_context.otel_map=true",
                                         f"span_context.otel_map_path={path}"])
    probe = SpanCtxProbe(cfg)
    st = probe.start()
    assert st.attached, st.reason
    return probe


def dump(path: Path) -> dict[int, bytes]:
    """pid_tgid -> the 24 value bytes, as bpftool reads the pinned map."""
    out = subprocess.run(["bpftool", "-j", "map", "dump", "pinned", str(path)],
                         capture_output=True, text=True, check=True).stdout
    entries = {}
    for e in json.loads(out or "[]"):
        key = bytes(int(b, 16) for b in e["key"])
        entries[int.from_bytes(key, "little")] = bytes(int(b, 16) for b in e["value"])
    return entries


def layout(path: Path) -> dict:
    out = subprocess.run(["bpftool", "-j", "map", "show", "pinned", str(path)],
                         capture_output=True, text=True, check=True).stdout
    info = json.loads(out)
    return {k: info[k] for k in ("type", "bytes_key", "bytes_value", "max_entries")}


@pytest.mark.parametrize("run", range(3))
def test_the_current_span_is_in_the_map_while_open_and_the_map_goes_at_stop(otel_path, child, run):
    probe = start_probe(otel_path)
    try:
        assert layout(otel_path) == {"type": "lru_hash", "bytes_key": 8, "bytes_value": 24,
                                     "max_entries": 16384}
        probe.refresh()           # the child's marker, already mapped
        assert probe.libraries, "the marker was not found"
        _, pid, tid, trace_hex, span_hex = child("open")
        key = int(pid) << 32 | int(tid)
        assert dump(otel_path).get(key) == bytes.fromhex(trace_hex) + bytes.fromhex(span_hex)
        assert child("close") == ["closed"]
        assert key not in dump(otel_path)
    finally:
        probe.stop()
    assert not otel_path.exists() and not otel_path.parent.exists()


def test_a_map_another_tool_pinned_is_shared_and_left(otel_path, child):
    otel_path.parent.mkdir()
    subprocess.run(["bpftool", "map", "create", str(otel_path), "type", "lru_hash", "key", "8",
                    "value", "24", "entries", "16384", "name", "traces_ctx_v1"], check=True)
    probe = start_probe(otel_path)
    try:
        probe.refresh()
        _, pid, tid, trace_hex, span_hex = child("open")
        assert dump(otel_path)[int(pid) << 32 | int(tid)] == \
            bytes.fromhex(trace_hex) + bytes.fromhex(span_hex)
    finally:
        probe.stop()
    assert otel_path.exists()       # not ours: left where the other tool pinned it


def test_a_map_of_another_layout_is_not_written(otel_path, child, caplog):
    otel_path.parent.mkdir()
    subprocess.run(["bpftool", "map", "create", str(otel_path), "type", "hash", "key", "4",
                    "value", "8", "entries", "128", "name", "not_otel"], check=True)
    probe = start_probe(otel_path)
    try:
        assert probe.otel_map is None
        assert "is pinned by another tool with layout" in caplog.text
        probe.refresh()
        child("open")
        assert dump(otel_path) == {}
    finally:
        probe.stop()
    assert otel_path.exists()
