"""The real NVIDIA driver library for tests without a GPU: Debian's non-free
`libcuda1` (../shared/CUDA.md), fetched into a cache folder with a private apt
configuration (the machine's apt sources and state are not touched) and
unpacked there with dpkg-deb. Never installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

CACHE = Path(os.environ.get("SPANLET_LIBCUDA_CACHE", Path.home() / ".cache" / "spanlet" / "libcuda1"))
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
SOURCES = [("http://deb.debian.org/debian", "bookworm"),
           ("http://deb.debian.org/debian", "bookworm-updates"),
           ("http://deb.debian.org/debian-security", "bookworm-security")]
LIB_DIR = "usr/lib/x86_64-linux-gnu/nvidia/current"


class FetchError(RuntimeError):
    pass


def _apt(cache: Path, *args: str) -> None:
    opts = ["-o", f"Dir::Etc::SourceList={cache / 'sources.list'}",
            "-o", "Dir::Etc::SourceParts=/nonexistent",
            "-o", f"Dir::State::Lists={cache / 'lists'}",
            "-o", f"Dir::Cache={cache / 'cache'}",
            "-o", "APT::Sandbox::User=root"]
    r = subprocess.run(["apt-get", "-q", *opts, *args], cwd=cache, capture_output=True, text=True,
                       timeout=300)
    if r.returncode:
        raise FetchError(f"apt-get {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()[-500:]}")


def libcuda_dir(cache: Path = CACHE) -> Path:
    """The folder of the unpacked real libcuda.so.1 (fetched on first use)."""
    unpacked = cache / "root" / LIB_DIR
    if (unpacked / "libcuda.so.1").exists():
        return unpacked
    try:
        for d in ("lists/partial", "cache/archives/partial"):
            (cache / d).mkdir(parents=True, exist_ok=True)
        (cache / "sources.list").write_text("".join(
            f"deb [signed-by={KEYRING}] {url} {suite} non-free\n" for url, suite in SOURCES))
        _apt(cache, "update")
        for old in cache.glob("libcuda1_*.deb"):
            old.unlink()
        _apt(cache, "download", "libcuda1")
        (deb,) = cache.glob("libcuda1_*.deb")
        subprocess.run(["dpkg-deb", "-x", str(deb), str(cache / "root")], check=True,
                       capture_output=True, timeout=120)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        raise FetchError(f"fetching Debian's libcuda1 into {cache}: {e}") from e
    if not (unpacked / "libcuda.so.1").exists():
        raise FetchError(f"libcuda1 unpacked into {cache / 'root'} has no {LIB_DIR}/libcuda.so.1")
    return unpacked
