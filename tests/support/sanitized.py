"""The sanitizer run's native extensions (scripts/sanitize.sh): with
SPANLET_NATIVE_DIR set, spanlet._wire, spanlet._ring and
spanlet.libspanlet_marker load from the builds there (ASan and UBSan) in
place of the package's own, and a missing one is an error, not a silent
fallback to the uninstrumented build."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

MODULES = ("spanlet._wire", "spanlet._ring", "spanlet.libspanlet_marker")


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, directory: Path):
        self.dir = directory

    def find_spec(self, name, path, target=None):
        if name not in MODULES:
            return None
        found = sorted(self.dir.glob(f"{name.rpartition('.')[2]}.*.so"))
        if not found:
            raise ImportError(f"{name}: no sanitizer build in {self.dir}")
        return importlib.util.spec_from_file_location(name, found[0])


def install(directory: str) -> None:
    """Load the extensions from `directory` (before anything imports them).
    chdb cannot load beside the sanitizer runtime (it is opened with
    RTLD_DEEPBIND): its import fails here, and the tests that need it are
    left out (tests/sanitize/leave_out.txt). Child processes run without the
    sanitizer (LD_PRELOAD is dropped from the environment they inherit)."""
    assert not any(m in sys.modules for m in MODULES), "a native extension was imported before"
    sys.modules["chdb"] = None
    for name in ("LD_PRELOAD", "PYTHONMALLOC", "SPANLET_NATIVE_DIR"):
        os.environ.pop(name, None)
    sys.meta_path.insert(0, _Finder(Path(directory)))
    for name in MODULES:
        module = importlib.import_module(name)
        assert Path(module.__file__).parent == Path(directory), module.__file__
