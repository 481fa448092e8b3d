"""Shared fixtures. Kernel tests need root, BCC, tracefs/bpffs and headers;
where those are missing they skip, except under SPANLET_REQUIRE_KERNEL=1
(set by CI), where a would-be skip is a failure."""

from __future__ import annotations

import os

import pytest

REQUIRE_KERNEL = os.environ.get("SPANLET_REQUIRE_KERNEL") == "1"


def _kernel_missing() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    try:
        import bcc  # noqa: F401
    except ImportError as e:
        return f"BCC not importable: {e}"
    from agent import kernel
    try:
        kernel.require_mounts()
        kernel.find_headers(os.environ.get("SPANLET_KERNEL_HEADERS", ""))
    except kernel.EnvironmentProblem as e:
        return str(e)
    return None


_MISSING = _kernel_missing()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "kernel" in item.keywords and _MISSING:
            if REQUIRE_KERNEL:
                item.add_marker(pytest.mark.usefixtures("_kernel_required"))
            else:
                item.add_marker(pytest.mark.skip(reason=f"kernel test: {_MISSING}"))


@pytest.fixture
def _kernel_required():
    pytest.fail(f"SPANLET_REQUIRE_KERNEL=1 but the kernel tier cannot run: {_MISSING}")


@pytest.fixture
def cfg():
    """A default config, untouched by the environment of the test run."""
    from agent import config
    return config.load(env={})
