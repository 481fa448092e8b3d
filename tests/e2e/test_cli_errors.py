"""`spanlet run` refuses to start, with exit code 2 and one clear message, on
bad config, without root, and without kernel headers."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SPANLET = [sys.executable, "-m", "spanlet.cli"]
ROOT = Path(__file__).resolve().parents[2]


def run(args, env=None, prefix=(), timeout=60):
    e = {k: v for k, v in os.environ.items() if not k.startswith("SPANLET_")}
    e.update(env or {})
    return subprocess.run([*prefix, *SPANLET, *args], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=timeout)


def test_unknown_key_in_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("tc:\n  interfaces: [eth0]\n  colour: blue\n")
    r = run(["run", "--config", str(f)])
    assert r.returncode == 2
    assert f"config file {f}: unknown key 'tc.colour'" in r.stderr
    assert "Traceback" not in r.stderr


def test_wrong_type_in_environment():
    r = run(["run"], env={"SPANLET_DISCOVERY_INTERVAL_S": "soon"})
    assert r.returncode == 2
    assert "environment variable SPANLET_DISCOVERY_INTERVAL_S: key 'discovery.interval_s'" in r.stderr


def test_impossible_value_on_command_line():
    r = run(["run", "--set", "shutdown_timeout_s=-1"])
    assert r.returncode == 2
    assert "--set shutdown_timeout_s: key 'shutdown_timeout_s': Input should be greater than 0" in r.stderr


def test_dump_bpf_prints_each_probe_with_its_flags():
    r = run(["run", "--dump-bpf", "--set", "sandbox.mode=enforce", "--set", "gpu.launch_events=all"])
    assert r.returncode == 0, r.stderr
    for name in ("span_ctx", "tc_classify", "mmap_sandbox", "gpu_launch"):
        assert f"/* ==== probe {name}: {name}.bpf.c" in r.stdout
    assert "struct spanlet_hdr {" in r.stdout          # the shared header, inlined
    assert "-DSPANLET_PIN_DIR=" in r.stdout
    # the CO-RE object: its settings, its programs (left out where a setting says) and its maps
    assert "/* ==== probe span_ctx: span_ctx.bpf.c  object: objects/" in r.stdout
    assert " * program sched_switch: tp_btf/sched_switch (left out)" in r.stdout
    assert " * program span_ctx_mark: uprobe" in r.stdout and " * map span_facts: type 9" in r.stdout


@pytest.mark.kernel
def test_not_root():
    r = run(["run"], prefix=["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"])
    assert r.returncode == 2
    assert "spanlet: cannot start: spanlet run needs root" in r.stderr


@pytest.mark.kernel
def test_configured_headers_missing():
    r = run(["run"], env={"SPANLET_KERNEL_HEADERS": "/nonexistent/headers"})
    assert r.returncode == 2
    assert "kernel_headers=/nonexistent/headers: no include/linux/kconfig.h there" in r.stderr


@pytest.mark.kernel
def test_no_headers_for_running_kernel(tmp_path):
    """/lib/modules hidden in a private mount namespace: the message says what to install."""
    empty = tmp_path / "modules"
    empty.mkdir()
    cmd = " ".join(SPANLET) + " run"
    r = run([], prefix=["unshare", "-m", "sh", "-c",
                        f"mount --bind {empty} /lib/modules && exec {cmd}", "--"])
    assert r.returncode == 2, r.stderr
    assert f"no kernel headers for kernel {os.uname().release}" in r.stderr
    assert "linux-headers-" in r.stderr and "SPANLET_KERNEL_HEADERS" in r.stderr
