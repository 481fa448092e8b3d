"""Builds the span marker extension (native/spanlet_marker.c) into a folder the
way the package build does (pyproject.toml's ext-modules flags), plus any -D."""

from __future__ import annotations

import os
import shlex
import subprocess
import sysconfig
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE = "spanlet.libspanlet_marker"
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")  # .cpython-311-x86_64-linux-gnu.so


def ext_module() -> dict:
    """The marker's [[tool.setuptools.ext-modules]] entry of pyproject.toml."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    (ext,) = [e for e in setuptools["ext-modules"] if e["name"] == MODULE]
    return ext


def build(out: Path, name: str, *defines: str, source: Path | None = None) -> str:
    """`out/name` built from the marker's sources (or `source`) with this
    interpreter's CFLAGS and the ext-modules flags, as setuptools compiles it."""
    ext = ext_module()
    sources = [str(source)] if source else [str(ROOT / s) for s in ext["sources"]]
    lib = out / name
    cmd = [os.environ.get("CC", "gcc"), *shlex.split(sysconfig.get_config_var("CFLAGS") or ""), "-fPIC",
           *ext.get("extra-compile-args", []), *defines, "-I", sysconfig.get_paths()["include"],
           "-shared", "-o", str(lib), *sources]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{shlex.join(cmd)}:\n{r.stderr}")
    return str(lib)
