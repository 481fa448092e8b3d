"""NvmlPoller against a stand-in libnvidia-ml.so.1 (agent/demo/standin/nvml.c) that
pynvml loads in a child process: exact device values, one failing call, no NVML."""

import ctypes.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spanlet.demo.standin import build_nvml
from spanlet.nvml import pcie_link_bytes_per_s

REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "tests" / "support"
GIB = 1024 ** 3

# The known values of agent/demo/standin/nvml.c.
GPU0 = "GPU-00000000-1111-2222-3333-444444444444"
GPU1 = "GPU-55555555-6666-7777-8888-999999999999"
TOTAL = {GPU0: 80 * GIB, GPU1: 24 * GIB}
RESERVED = 616 * 1024 ** 2     # the driver's own share: version 1 of the memory call counts it used
USED = {GPU0: [20 * GIB, 60 * GIB, 40 * GIB], GPU1: [6 * GIB, 3 * GIB, 9 * GIB]}  # per call
SM_PERCENT = {GPU0: 73, GPU1: 12}
# (TX KB/s, RX KB/s, link bytes/s per direction); GPU1's RX counter fails.
GPU0_PCIE = (12_000_000, 3_000_000, 3.938e9 * 16)   # gen5 x16
GPU1_PCIE = (5_000_000, None, 1.969e9 * 8)          # gen4 x8


@pytest.fixture(scope="session")
def standin(tmp_path_factory) -> Path:
    """Folder holding the stand-in (agent/demo/standin/nvml.c), built with the
    C compiler setup.sh installs."""
    return build_nvml(tmp_path_factory.mktemp("nvml_standin")).parent


def drive(*steps, settings=None, lib_dir=None, env=None):
    """Runs the steps in a fresh child (pynvml loads its library once per
    process); returns (results per step, log lines of spanlet.nvml)."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("STANDIN_")}
    child_env.update(PYTHONPATH=str(REPO), LD_LIBRARY_PATH=str(lib_dir or ""), **(env or {}))
    proc = subprocess.run(
        [sys.executable, str(SUPPORT / "nvml_standin" / "drive.py"), json.dumps(settings or {}), *steps],
        env=child_env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["exception"] is None, out["exception"]
    return out["results"], out["logs"]


def warnings(logs):
    return [msg for level, msg in logs if level == "WARNING"]


def test_device_values_exact(standin):
    (status, _, _, _, snap), logs = drive("open", "poll", "poll", "poll", "snapshot", lib_dir=standin)
    assert status == {"available": True, "reason": "", "gpus": 2}
    assert set(snap) == {GPU0, GPU1}
    for gpu, s in snap.items():
        used = USED[gpu][2]                     # the third call's value
        assert s["gpu"] == gpu
        assert s["sm_utilization_ratio"] == SM_PERCENT[gpu] / 100
        # version 2 of the memory call, as nvidia-smi shows it: the reserved part is neither
        assert (s["memory_used_bytes"], s["memory_total_bytes"], s["memory_free_bytes"]) == \
            (used, TOTAL[gpu], TOTAL[gpu] - RESERVED - used)
        assert s["memory_used_ratio"] == used / TOTAL[gpu]
    assert (snap[GPU0]["index"], snap[GPU1]["index"]) == (0, 1)
    assert snap[GPU0]["name"] == "Stand-in H200"
    tx, rx, link = GPU0_PCIE
    assert snap[GPU0]["pcie_tx_ratio"] == pytest.approx(tx * 1000 / link, rel=1e-12)
    assert snap[GPU0]["pcie_rx_ratio"] == pytest.approx(rx * 1000 / link, rel=1e-12)
    assert snap[GPU0]["pcie_tx_ratio"] == pytest.approx(0.190452, abs=1e-6)  # 12 GB/s of 63 GB/s


def test_a_driver_without_memory_v2_is_asked_version_1_without_a_warning(standin):
    (_, _, snap, errors), logs = drive("poll", "poll", "snapshot", "errors", lib_dir=standin,
                                       env={"STANDIN_NVML_NO_MEMORY_V2": "1"})
    for gpu, s in snap.items():
        used = USED[gpu][1] + RESERVED          # version 1: the reserved part counted as used
        assert (s["memory_used_bytes"], s["memory_free_bytes"]) == (used, TOTAL[gpu] - used)
    assert errors == {"nvmlDeviceGetPcieThroughput": 2}        # nothing counted for memory
    assert [m for m in warnings(logs) if "Memory" in m] == []
    (line,) = [m for level, m in logs if "nvmlDeviceGetMemoryInfo_v2" in m]   # said once
    assert "Function Not Found" in line and "includes what the driver reserves" in line


def test_window_is_the_peak_since_the_last_window(standin):
    ratio = {gpu: [u / TOTAL[gpu] for u in USED[gpu]] for gpu in TOTAL}
    results, _ = drive("poll", "poll", "poll", "window", "window", "poll", "window", "poll", "window",
                       lib_dir=standin)
    w1, w2, _, w3, _, w4 = results[3:]
    # Over samples 0-2 the peak is the middle one for GPU0, the last for GPU1.
    assert w1 == {GPU0: ratio[GPU0][1], GPU1: ratio[GPU1][2]} == {GPU0: 0.75, GPU1: 0.375}
    # A window with no new sample holds the latest one (sample 2).
    assert w2 == {GPU0: ratio[GPU0][2], GPU1: ratio[GPU1][2]}
    # Sample 3 (= step 0) is lower than sample 2, which opened the window.
    assert w3 == {GPU0: ratio[GPU0][2], GPU1: ratio[GPU1][2]}
    # Sample 4 (= step 1) is higher again.
    assert w4 == {GPU0: max(ratio[GPU0][0], ratio[GPU0][1]), GPU1: ratio[GPU1][0]}


def test_failing_call_removes_only_that_value(standin):
    (_, _, _, snap, errors), logs = drive("poll", "poll", "poll", "snapshot", "errors",
                                          lib_dir=standin)
    assert snap[GPU1]["pcie_rx_ratio"] is None
    tx, _, link = GPU1_PCIE
    assert snap[GPU1]["pcie_tx_ratio"] == pytest.approx(tx * 1000 / link, rel=1e-12)
    assert snap[GPU1]["sm_utilization_ratio"] == 0.12
    assert snap[GPU1]["memory_used_bytes"] == USED[GPU1][2]
    assert None not in snap[GPU0].values()
    assert errors == {"nvmlDeviceGetPcieThroughput": 3}        # once per poll
    (line,) = warnings(logs)                                   # said once
    assert "nvmlDeviceGetPcieThroughput" in line and GPU1 in line and "Not Supported" in line


def _assert_off_once(results, logs, reason_part):
    status, *_, snap, window, errors = results
    assert status["available"] is False and reason_part in status["reason"]
    assert snap == {} and window == {}
    assert errors == {"nvmlInit": 1}
    (line,) = warnings(logs)
    assert line == f"{status['reason']}: GPU device metrics are off"
    return line


OFF_STEPS = ("open", "poll", "start", "poll", "open", "stop", "stop", "snapshot", "window", "errors")


def test_library_setting_loads_that_file(standin):
    # No LD_LIBRARY_PATH: the configured path alone must bring the stand-in in,
    # ahead of any real libnvidia-ml.so.1 of the host.
    (status, _, snap), _ = drive("open", "poll", "snapshot",
                                 settings={"library": str(standin / "libnvidia-ml.so.1")})
    assert status == {"available": True, "reason": "", "gpus": 2}
    assert set(snap) == {GPU0, GPU1}


def test_no_library_at_configured_path_is_off_once(tmp_path):
    missing = tmp_path / "libnvidia-ml.so.1"
    results, logs = drive(*OFF_STEPS, settings={"library": str(missing)})
    line = _assert_off_once(results, logs, f"NVML not available ({missing} not loadable")
    assert "No such file" in line


def test_no_library_on_the_search_path_is_off_once(tmp_path):
    # Skipped only on a GPU host, where the real library is on the search path by design:
    # there bench/gpu_check.py (the device check) runs the poller on the real NVML instead.
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this host has a real libnvidia-ml: the device check (bench/gpu_check.py) "
                    "runs the poller on it; the configured-path test covers absence")
    results, logs = drive(*OFF_STEPS, lib_dir=tmp_path)
    line = _assert_off_once(results, logs, "")
    assert line == "NVML not available (libnvidia-ml.so.1 not found): GPU device metrics are off"


def test_init_failure_is_off_once_and_not_shut_down(standin):
    results, logs = drive(*OFF_STEPS, "standin", lib_dir=standin, env={"STANDIN_NVML_INIT_FAIL": "1"})
    *results, counts = results
    _assert_off_once(results, logs, "nvmlInit failed: Driver Not Loaded")
    assert counts == {"init": 1, "shutdown": 0}


def test_disabled_never_touches_nvml(standin):
    (status, snap, counts), logs = drive("open", "snapshot", "standin",
                                         settings={"enabled": False}, lib_dir=standin)
    assert status["available"] is False and "nvml.enabled" in status["reason"]
    assert snap == {} and counts == {"init": 0, "shutdown": 0}
    assert warnings(logs) == []


def test_thread_polls_until_stopped_twice(standin):
    (_, _, alive, polls, _, _, dead, status, snap, counts), logs = drive(
        "start", "start", "thread_alive", "wait_polls:3", "stop", "stop", "thread_alive",
        "status", "snapshot", "standin", settings={"poll_interval_s": 0.01}, lib_dir=standin)
    assert alive is True and polls >= 3 and dead is False
    assert status == {"available": False, "reason": "stopped", "gpus": 0}
    assert set(snap) == {GPU0, GPU1}                       # last values stay readable
    assert counts == {"init": 1, "shutdown": 1}            # one thread, one shutdown


@pytest.mark.parametrize("gen, width, expected", [
    (1, 16, 0.25e9 * 16), (2, 4, 0.5e9 * 4), (3, 16, 0.985e9 * 16),
    (4, 8, 1.969e9 * 8), (5, 16, 3.938e9 * 16), (6, 16, 7.563e9 * 16),
    (7, 16, None), (0, 16, None), (4, 0, None),
])
def test_pcie_link_capacity(gen, width, expected):
    got = pcie_link_bytes_per_s(gen, width)
    assert got == (None if expected is None else pytest.approx(expected, rel=1e-12))
