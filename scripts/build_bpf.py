"""Builds CO-RE BPF objects: clang's BPF target, with BTF (-g), for each
architecture the package ships (the arguments of a probed function are read
per architecture: bpf_tracing.h). Needed at build time only; the node loads
the objects with libbpf (agent/probes/libbpf.py) and compiles nothing.

    python3 scripts/build_bpf.py SRC.bpf.c OUT_DIR [--arch x86|arm64 ...]

writes OUT_DIR/<arch>/<name>.bpf.o for each architecture (both by default);
the package build (setup.py) writes bpf/objects/<arch>/ for CORE_PROGRAMS.
-mcpu=v3: atomics that return the old value (Linux 5.12 on)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BPF_DIR = ROOT / "bpf"
ARCHES = ("x86", "arm64")
# Where a machine's name says which of ours it is (platform.machine()).
MACHINE_ARCH = {"x86_64": "x86", "aarch64": "arm64"}
CLANGS = ("clang-16", "clang")


# The programs built as CO-RE objects and shipped in the package (the others
# are still compiled by BCC on the node, from their C: the loader issue moves
# them one by one).
CORE_PROGRAMS = ("span_ctx",)
PACKAGE_OBJECTS = BPF_DIR / "objects"


class BuildError(RuntimeError):
    """The compiler is missing or refused the source: its messages."""


def clang() -> str:
    found = os.environ.get("CLANG") or next((c for c in CLANGS if shutil.which(c)), None)
    if not found:
        raise BuildError("no clang to build the BPF objects with (Debian: clang-16; or set CLANG)")
    return found


def _multiarch_include() -> list[str]:
    """The folder of the build machine's asm/types.h (the same integer types
    on every architecture the package ships)."""
    try:
        triplet = subprocess.run(["gcc", "-print-multiarch"], capture_output=True, text=True,
                                 check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        triplet = ""
    return [f"-I/usr/include/{triplet}"] if triplet else []


def build(src: Path, out_dir: Path, arch: str, *, include: tuple[Path, ...] = ()) -> Path:
    """One object: out_dir/<arch>/<name>.bpf.o."""
    if arch not in ARCHES:
        raise BuildError(f"unknown architecture {arch} (known: {', '.join(ARCHES)})")
    name = src.name.removesuffix(".c")
    out = out_dir / arch / f"{name}.o"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [clang(), "-g", "-O2", "-target", "bpfel", "-mcpu=v3", f"-D__TARGET_ARCH_{arch}", "-Wall", "-Werror",
           "-I", str(BPF_DIR), *(f"-I{p}" for p in include), *_multiarch_include(),
           "-c", str(src), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise BuildError(f"{src.name} ({arch}): {res.stderr.strip()}")
    return out


def build_package(out_dir: Path = PACKAGE_OBJECTS) -> list[Path]:
    """Every shipped object for every architecture (the package build's step:
    setup.py), rebuilt where its sources are newer."""
    built = []
    for name in CORE_PROGRAMS:
        src = BPF_DIR / f"{name}.bpf.c"
        newest = max(p.stat().st_mtime for p in [src, *BPF_DIR.glob("*.h")])
        for arch in ARCHES:
            out = out_dir / arch / f"{name}.bpf.o"
            if not out.exists() or out.stat().st_mtime < newest:
                out = build(src, out_dir, arch)
            built.append(out)
    return built


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--arch", action="append", choices=ARCHES)
    args = ap.parse_args(argv)
    try:
        for arch in args.arch or ARCHES:
            print(build(args.src, args.out_dir, arch))
    except BuildError as e:
        print(f"build_bpf: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
