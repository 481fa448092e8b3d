"""The kernel-required switch works: with the kernel check forced to fail,
SPANLET_REQUIRE_KERNEL=1 turns every kernel test into a failure at its setup
(before any fixture of it runs), and without the switch they skip. A kernel
test that needs no BPF at all (the CLI's error paths) is the probe: before the
switch worked, it passed under the variable."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TARGET = "tests/e2e/test_cli_errors.py"


def _pytest(*args: str, require: bool) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "SPANLET_REQUIRE_KERNEL"}
    env["SPANLET_TEST_KERNEL_MISSING"] = "the meta-test says so"
    if require:
        env["SPANLET_REQUIRE_KERNEL"] = "1"
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA",
                        TARGET, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    return p.returncode, p.stdout + p.stderr


def _kernel_tests() -> int:
    return len(re.findall(r"^@pytest\.mark\.kernel$", (REPO / TARGET).read_text(), re.M))


def test_under_the_switch_a_kernel_test_that_cannot_run_fails_at_setup():
    n = _kernel_tests()
    assert n >= 3
    rc, out = _pytest("-m", "kernel", require=True)
    assert rc == 1, out
    assert re.search(rf"\b{n} errors?\b", out), out
    assert " passed" not in out and " skipped" not in out, out
    assert out.count("SPANLET_REQUIRE_KERNEL=1 but this test cannot run: "
                     "kernel test: forced: the meta-test says so") >= n, out


def test_without_the_switch_they_skip_saying_why():
    n = _kernel_tests()
    rc, out = _pytest("-m", "kernel", require=False)
    assert rc == 0, out
    assert re.search(rf"\b{n} skipped\b", out), out
    assert "kernel test: forced: the meta-test says so" in out


@pytest.mark.parametrize("require", [True, False])
def test_a_test_without_the_kernel_mark_runs_either_way(require):
    rc, out = _pytest("-m", "not kernel", "-k", "unknown_key_in_file", require=require)
    assert rc == 0, out
    assert re.search(r"\b1 passed\b", out) and " error" not in out, out
