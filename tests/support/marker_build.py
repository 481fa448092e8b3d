"""Builds the span marker extension (native/spanlet_marker.c) into a folder the
way the package build does (pyproject.toml's ext-modules flags), plus any -D;
reads the record build's log of spanlet_mark calls for the client's tests."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
import threading
import tomllib
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
MODULE = "spanlet.libspanlet_marker"
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")  # .cpython-311-x86_64-linux-gnu.so


def ext_module() -> dict:
    """The marker's [[tool.setuptools.ext-modules]] entry of pyproject.toml."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    (ext,) = [e for e in setuptools["ext-modules"] if e["name"] == MODULE]
    return ext


def _build_config(python: str | None) -> tuple[str, str]:
    """(CFLAGS, include folder) of this interpreter, or of the one at `python`."""
    if python is None:
        return sysconfig.get_config_var("CFLAGS") or "", sysconfig.get_paths()["include"]
    out = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_config_var('CFLAGS') or '');"
                          "print(sysconfig.get_paths()['include'])"], capture_output=True, text=True, check=True)
    cflags, include = out.stdout.splitlines()
    return cflags, include


def build(out: Path, name: str, *defines: str, source: Path | None = None, python: str | None = None) -> str:
    """`out/name` built from the marker's sources (or `source`) with this
    interpreter's CFLAGS (or those of the interpreter at `python`) and the
    ext-modules flags, as setuptools compiles it."""
    ext = ext_module()
    sources = [str(source)] if source else [str(ROOT / s) for s in ext["sources"]]
    lib = out / name
    cflags, include = _build_config(python)
    cmd = [os.environ.get("CC", "gcc"), *shlex.split(cflags), "-fPIC",
           *ext.get("extra-compile-args", []), *defines, "-I", include,
           "-shared", "-o", str(lib), *sources]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{shlex.join(cmd)}:\n{r.stderr}")
    return str(lib)


CLEAR = (b"\0" * 16, 0, 0)  # Recorder.marks() of a mark for "in no span"


class Record(NamedTuple):
    """One recorded spanlet_mark call, as record_get() returns it."""
    trace_hi: int
    trace_lo: int
    span_id: int
    modality: int
    tid: int


class Recorder:
    """The record build's (-DSPANLET_MARKER_RECORD) in-extension log of spanlet_mark calls."""

    def __init__(self, path: str):
        from spanlet import client

        self.path = path
        self.module = client.load_extension(path)  # same dlopen handle as the processor's

    def reset(self) -> None:
        """Forget the log, and the calling thread's last mark (back to none)."""
        self.module.record_reset()

    def records(self) -> list[Record]:
        return [Record(*self.module.record_get(i)) for i in range(self.module.record_count())]

    def marks(self, tid: int | None = None) -> list[tuple[bytes, int, int]]:
        """(16-byte trace id, span id, modality) per call, in call order; only
        the calls of thread `tid` if given."""
        return [as_mark(r) for r in self.records() if tid is None or r.tid == tid]

    def current(self) -> tuple[bytes, int, int]:
        """What the kernel now holds for the calling thread: its last mark (CLEAR if none)."""
        mine = self.marks(threading.get_native_id())
        return mine[-1] if mine else CLEAR


def as_mark(r: Record) -> tuple[bytes, int, int]:
    return (r.trace_hi.to_bytes(8, "big") + r.trace_lo.to_bytes(8, "big"), r.span_id, r.modality)


def span_mark(span, modality: int = 0) -> tuple[bytes, int, int]:
    """The mark a span should have, in Recorder.marks() form."""
    ctx = span.get_span_context()
    return (ctx.trace_id.to_bytes(16, "big"), ctx.span_id, modality)


def forget_client_state(monkeypatch) -> None:
    """A new process as far as spanlet.client knows: no marker loaded, no warning
    given, no context hooks, no thread marked (the hooks come back with the
    next active processor, and go again at the end of the test)."""
    from spanlet import client

    client._remove_hooks()
    monkeypatch.setattr(client, "_libs", {})
    monkeypatch.setattr(client, "_warned", False)
    monkeypatch.setattr(client, "_owners", [])
    monkeypatch.setattr(client, "_follower", None)
    monkeypatch.setattr(client, "_looks_left", client._LOOKS)
    monkeypatch.setattr(client, "_follow_flags", 0)
    monkeypatch.delenv(client.LIB_ENV, raising=False)
    # A build loaded by path is imported under the package marker's name, and
    # CPython keeps a single-phase extension in sys.modules: whatever the test
    # leaves there goes at its end (the entry as it was comes back).
    if client.MARKER_MODULE in sys.modules:
        monkeypatch.setitem(sys.modules, client.MARKER_MODULE, sys.modules[client.MARKER_MODULE])
    else:
        monkeypatch.setitem(sys.modules, client.MARKER_MODULE, None)
        monkeypatch.delitem(sys.modules, client.MARKER_MODULE)
