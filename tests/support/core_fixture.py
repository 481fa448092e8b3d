"""The CO-RE loader's test object (core/fixture.bpf.c, its types in
core/fixture.h), built as the package's objects are (scripts/build_bpf.py)."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DIR = HERE / "core"
sys.path.insert(0, str(HERE.parents[1] / "scripts"))
import build_bpf  # noqa: E402

ARCHES = build_bpf.ARCHES


def build(out: Path, arch: str | None = None) -> Path:
    """The object for `arch` (this machine's by default), in out/<arch>/."""
    return build_bpf.build(DIR / "fixture.bpf.c", out, arch or build_bpf.MACHINE_ARCH[platform.machine()],
                           include=(DIR,))
