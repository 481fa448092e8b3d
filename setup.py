"""The one step of the package build that pyproject.toml cannot say: the
CO-RE BPF objects (scripts/build_bpf.py, clang at build time only), built
into bpf/objects/<arch>/ before the package's files are collected, so that
the wheel (and an editable install) carries them. Everything else is in
pyproject.toml."""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithObjects(build_py):
    def run(self):
        sys.path.insert(0, str(HERE / "scripts"))
        import build_bpf
        try:
            for obj in build_bpf.build_package():
                self.announce(f"BPF object {obj.relative_to(HERE)}", level=2)
        except build_bpf.BuildError as e:
            raise SystemExit(f"spanlet: building the BPF objects failed: {e}") from None
        super().run()


setup(cmdclass={"build_py": BuildPyWithObjects})
