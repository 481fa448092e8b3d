"""The client under another CPython than the one running the tests (3.12's
eager tasks, on a machine whose default Python is 3.11): that interpreter
found, a cached virtual environment of it with the OpenTelemetry SDK (the
client's one dependency) and uvloop, and the client's modules on its path."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The client's own modules (stdlib, the SDK and the marker): what `import spanlet.client` loads.
CLIENT_MODULES = ("__init__.py", "client.py", "modality.py", "runtimes.py")


def find(version: str) -> str | None:
    """An interpreter of `version` ("3.12") that runs: on the PATH, or one of
    pyenv's versions (its shims on the PATH may name a version they do not run)."""
    candidates = [f"python{version}", *sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}*/bin/python{version}"))),
                  f"/usr/bin/python{version}"]
    for c in candidates:
        exe = shutil.which(c) if os.sep not in c else (c if os.access(c, os.X_OK) else None)
        if exe and subprocess.run([exe, "-c", "import venv"], capture_output=True).returncode == 0:
            return exe
    return None


def client_env(python: str, cache: Path) -> tuple[str, str]:
    """(the venv's python, a folder holding the `spanlet` client package to put
    on PYTHONPATH). The venv is made once per interpreter and SDK version."""
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    sdk = metadata.version("opentelemetry-sdk")
    venv = cache / f"py{version}-otel{sdk}"
    exe = venv / "bin" / "python"
    if not (venv / ".ready").exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
        subprocess.run([str(exe), "-m", "pip", "install", "-q", f"opentelemetry-sdk=={sdk}", "uvloop"],
                       check=True, timeout=600)
        (venv / ".ready").write_text("")
    pkg = cache / f"client-{os.getpid()}" / "spanlet"
    shutil.rmtree(pkg.parent, ignore_errors=True)
    pkg.mkdir(parents=True)
    for name in CLIENT_MODULES:
        (pkg / name).symlink_to(ROOT / "agent" / name)
    return str(exe), str(pkg.parent)
