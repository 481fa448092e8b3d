"""Shared fixtures. Kernel tests need root, BCC, tracefs/bpffs and headers;
where those are missing they skip, except under SPANLET_REQUIRE_KERNEL=1
(set by CI), where a would-be skip is a failure (at each test's setup, before
any fixture of it runs). SPANLET_TEST_KERNEL_MISSING=REASON forces the kernel
check to fail, for the meta-test that proves the switch works."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

if os.environ.get("SPANLET_NATIVE_DIR"):     # the sanitizer run (scripts/sanitize.sh)
    import sanitized
    sanitized.install(os.environ["SPANLET_NATIVE_DIR"])

import cuda_standin  # noqa: E402
from require import cannot_run  # noqa: E402
from gpu_harness import cgroup2_root, remove_cgroup  # noqa: E402

def _kernel_missing() -> str | None:
    if os.environ.get("SPANLET_TEST_KERNEL_MISSING"):
        return f"forced: {os.environ['SPANLET_TEST_KERNEL_MISSING']}"
    if os.geteuid() != 0:
        return "not root"
    try:
        import bcc  # noqa: F401
    except ImportError as e:
        return f"BCC not importable: {e}"
    if shutil.which("bpftool") is None:
        return "bpftool not installed (scripts/setup.sh installs it)"
    from spanlet.probes import node_check
    try:
        node_check.require_mounts()
        node_check.find_headers(os.environ.get("SPANLET_KERNEL_HEADERS", ""))
    except node_check.EnvironmentProblem as e:
        return str(e)
    return None


_MISSING = _kernel_missing()


def pytest_configure(config):
    # A shell without job control starts its background commands with SIGINT
    # ignored, and every process they start inherits that: the tests that send
    # SIGINT (Ctrl-C, as a terminal sends it to a foreground command) need it
    # delivered, as in a foreground run.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # At setup, not at collection: a marker added after collection no longer
    # changes a test's fixtures, so it could not make the test fail.
    if "kernel" in item.keywords and _MISSING:
        cannot_run(f"kernel test: {_MISSING}")


@pytest.fixture
def cfg():
    """A default config, untouched by the environment of the test run."""
    from spanlet import config
    return config.load(env={})


# ---- shared by the kernel and e2e tiers: stand-in CUDA workloads in a cgroup of the test's own




@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> cuda_standin.StandIn:
    return cuda_standin.build(tmp_path_factory.mktemp("cuda_standin"))


@pytest.fixture
def cgroup():
    """A cgroup v2 group of this test's own, so that its counts (keyed by
    cgroup id) are not mixed with those of any other process on the host that
    maps a libcuda while the test runs. Removed at teardown."""
    path = cgroup2_root() / f"spanlet-gpu-test-{os.getpid()}-{os.urandom(3).hex()}"
    path.mkdir()
    assert (path / "cgroup.procs").exists(), f"{path} is not a cgroup"
    try:
        yield path
    finally:
        remove_cgroup(path)


@pytest.fixture
def spawn(cgroup):
    """Start workload processes in the test's cgroup; each is ended (by its
    own pid) at teardown."""
    started: list[cuda_standin.Workload] = []

    def start(exe: Path | None, argv_prefix: list[str] | None = None) -> cuda_standin.Workload:
        w = cuda_standin.Workload(exe, argv_prefix)
        started.append(w)
        (cgroup / "cgroup.procs").write_text(str(w.pid))
        return w

    try:
        yield start
    finally:
        for w in started:
            w.close()
