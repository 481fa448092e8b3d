"""Stand-in CUDA and NVML libraries: CUDA's and NVML's C entry points with
their real signatures and no GPU behind them. `spanlet demo` launches
"kernels" through them, the demo agent config reads "GPUs" through the NVML
one, and the tests build their own copies from the same sources.

    python -m spanlet.demo.standin OUTDIR    # build all three into OUTDIR
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DRIVER = "libcuda.so.1"
RUNTIME = "libcudart.so.12"
NVML = "libnvidia-ml.so.1"


class BuildError(RuntimeError):
    pass


def gcc(*args: str | os.PathLike) -> None:
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        raise BuildError("no C compiler (gcc) to build the stand-in libraries: "
                         "run `make setup` (it installs gcc)")
    r = subprocess.run([cc, "-Wall", "-Werror", *map(str, args)], capture_output=True, text=True)
    if r.returncode:
        raise BuildError(f"gcc {' '.join(map(str, args))}:\n{r.stderr}")


def build_cuda(lib: Path) -> Path:
    """DRIVER and RUNTIME into `lib`. The driver is built at -O0 with noinline
    entry points; the runtime at -O2 (cudaStreamSynchronize becomes a tail
    jump to the driver). As real cudart, the runtime does not link the driver:
    it dlopens it by soname (found beside it through its run path, or already
    loaded) and calls it through the pointers dlsym gave it."""
    lib.mkdir(parents=True, exist_ok=True)
    gcc("-shared", "-fPIC", "-O0", f"-Wl,-soname,{DRIVER}", "-o", lib / DRIVER, HERE / "cuda.c")
    gcc("-shared", "-fPIC", "-O2", "-fno-inline", f"-Wl,-soname,{RUNTIME}",
        "-Wl,-rpath,$ORIGIN", "-o", lib / RUNTIME, HERE / "cudart.c", "-ldl")
    return lib


def build_nvml(lib: Path) -> Path:
    """NVML into `lib`; returns the library's path."""
    lib.mkdir(parents=True, exist_ok=True)
    gcc("-shared", "-fPIC", f"-Wl,-soname,{NVML}", "-o", lib / NVML, HERE / "nvml.c")
    return lib / NVML


def build_all(lib: Path) -> Path:
    build_cuda(lib)
    build_nvml(lib)
    return lib


def built(lib: Path) -> bool:
    return all((lib / name).is_file() for name in (DRIVER, RUNTIME, NVML))


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m spanlet.demo.standin OUTDIR")
    try:
        print(build_all(Path(argv[0])))
    except BuildError as e:
        sys.exit(str(e))
