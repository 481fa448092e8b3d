"""The agent's image, built by `make image` (scripts/image.sh), run under podman
as daemonset/daemonset.yaml runs it: its capabilities and no others, read-only
root, its host mounts but not the node's kernel headers, host PID and network
namespaces, its ConfigMap. Checked from outside: every probe attached, against
the image's headers; the stand-in GPU launches of this test's own serving
process counted exactly on its own spans; /metrics and `spanlet inspect`
(podman exec) answer; podman stop ends it with exit 0 and leaves no program,
map, TC filter, uprobe or pin behind.

Only what this shared machine needs differs from a node, each by the ConfigMap
override a node could use too: the ports (others' agents hold 9464/4317/4318),
TC on a veth pair of this test (not the machine's interfaces), the data and
socket host folders (the test's own), and an upstream collector of the test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

import cuda_standin
from bpf_leftovers import bpf_ids, still_loaded
import daemonset_podman as dsp
from facts_child import FactsChild
from otlp_upstream import Upstream, kernel_attrs, wait_for
from processes import free_port
from require import cannot_run
from spanlet.probes import privileges

pytestmark = pytest.mark.kernel
ROOT = Path(__file__).resolve().parents[2]
IMAGE = "localhost/spanlet:latest"
ROUNDS = 5                    # exactness rounds, each its own spans
PROBES = ("span_ctx", "tc_classify", "mmap_sandbox", "gpu_launch")


@pytest.fixture(scope="module")
def image() -> str:
    missing = [t for t in ("podman", "runc", "mmdebstrap") if shutil.which(t) is None]
    if missing:
        msg = f"{', '.join(missing)} not installed (scripts/setup.sh --image)"
        cannot_run(msg)
    # Cached: nothing is rebuilt when the image of HEAD is in the store.
    subprocess.run(["bash", str(ROOT / "scripts" / "image.sh")], check=True, timeout=1200)
    return IMAGE


@pytest.fixture
def veth():
    """A veth pair of this test in the host namespace (the pod's: hostNetwork)."""
    name = f"slc{os.urandom(3).hex()}"
    subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", name + "p"], check=True)
    try:
        for n in (name, name + "p"):
            subprocess.run(["ip", "link", "set", n, "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "link", "del", name], check=False)


def tc_filters(dev: str) -> str:
    return "".join(subprocess.run(["tc", "filter", "show", "dev", dev, d], capture_output=True,
                                  text=True).stdout for d in ("ingress", "egress"))


class OtherUser:
    """A stand-in workload of another user (nobody), its own copy of the
    libraries in a folder that user can read: the agent finds it only through
    /proc/<pid>/maps of a process not its own (CAP_SYS_PTRACE)."""

    def __init__(self, standin: cuda_standin.StandIn):
        self.dir = Path(tempfile.mkdtemp(prefix="spanlet-other-user-"))
        self.dir.chmod(0o755)
        libs = standin.copy_libs(self.dir / "lib")
        libs.chmod(0o755)
        exe = self.dir / "workload"
        shutil.copy2(standin.workload, exe)
        self.libcuda = libs / "libcuda.so.1"
        self.w = cuda_standin.Workload(exe, argv_prefix=["setpriv", "--reuid=65534", "--regid=65534",
                                                          "--clear-groups"])
        self.w.load(libs)

    def attached_in(self, c: dsp.Container, timeout: float) -> bool:
        line = "gpu_launch: attached cuLaunchKernel"
        where = f"to {self.libcuda} (inode"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(line in l and where in l for l in c.logs().splitlines()):
                return True
            time.sleep(0.5)
        return False

    def close(self) -> None:
        self.w.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def serving_image(image, tmp_path_factory) -> str:
    """The serving pod's image (tests/support/serving_pod/Containerfile) on the
    agent image's base: the client from the wheel of HEAD, the stand-in libcuda."""
    ctx = tmp_path_factory.mktemp("serving-ctx")
    stamp = dsp.podman("image", "inspect", "--format", '{{index .Labels "spanlet.stamp"}}',
                       image).stdout.split()
    base = stamp[1]
    wheel = subprocess.run(["bash", "-c", f'here={ROOT}; py=python3; source {ROOT}/scripts/wheel_lib.sh; '
                            f'w=$(build_wheel {ctx / "work"}); ensure_in_wheelhouse "$w"; '
                            f'cp "$w" {ctx}/; echo "$wheelhouse"'],
                           capture_output=True, text=True, check=True, timeout=600)
    wheelhouse = wheel.stdout.split()[-1]
    cuda_standin.build(ctx / "cuda")
    shutil.copytree(ctx / "cuda" / "lib", ctx / "lib")
    for program in ("span_facts_child.py", "child_loop.py"):     # the serving process and its stdin loop
        shutil.copy2(ROOT / "tests" / "support" / program, ctx / program)
    shutil.rmtree(ctx / "work")
    shutil.rmtree(ctx / "cuda")
    tag = "localhost/spanlet-serving-test:latest"
    dsp.podman("build", "-q", "--layers", *dsp._limits(), "-f",
               str(ROOT / "tests" / "support" / "serving_pod" / "Containerfile"),
               "--build-arg", f"BASE={base}", "--volume", f"{wheelhouse}:/wheelhouse:ro",
               "--label", "spanlet.test=serving-pod", "-t", tag, str(ctx), timeout=600)
    # the serving images of earlier commits, now untagged
    dsp.podman("image", "prune", "-f", "--filter", "label=spanlet.test=serving-pod", check=False)
    return tag


def launches(up: Upstream, keys) -> dict:
    """(trace, span) -> the kernel.gpu.launches of each span received with those ids."""
    with up.lock:
        return {k: [kernel_attrs(s).get("kernel.gpu.launches", 0) for s in up.by_ids.get(k, [])]
                for k in keys}


def traced(child: FactsChild, up: Upstream) -> bool:
    """One more one-launch span; whether any of them so far arrived with its launch
    (the agent attaches to the child's marker and libcuda as it finds them)."""
    child.command("threads 1 1")
    return any(v == [1] for v in launches(up, child.expected).values())


def assert_exact_rounds(child: FactsChild, up: Upstream) -> None:
    """ROUNDS of 12 spans over 3 threads (1..12 launches each): every span
    arrives once with exactly its launches."""
    for _ in range(ROUNDS):
        child.expected.clear()
        child.command("threads 3 4")
        expected = dict(child.expected)
        wait_for(lambda: all(k in up.by_ids for k in expected), 30, "the spans upstream")
        assert launches(up, expected) == {k: [n] for k, n in expected.items()}


def start(tmp_path: Path, image: str, veth: str, upstream: Upstream,
          drop: tuple[str, ...] = ()) -> tuple[dsp.Container, dict]:
    cfg_dir = tmp_path / "etc-spanlet"
    cfg_dir.mkdir()
    (cfg_dir / "config.yaml").write_text(dsp.configmap_text())
    ports = {"http": free_port(), "grpc": free_port(), "otlp_http": free_port()}
    env = {"SPANLET_HTTP_PORT": ports["http"], "SPANLET_OTLP_GRPC_PORT": ports["grpc"],
           "SPANLET_OTLP_HTTP_PORT": ports["otlp_http"], "SPANLET_TC_INTERFACES": veth,
           "SPANLET_OTLP_UPSTREAM_ENDPOINT": upstream.endpoint(),
           "SPANLET_OTLP_UPSTREAM_PROTOCOL": "grpc", "SPANLET_OTLP_BATCH_INTERVAL_S": "0.1"}
    name = f"spanlet-e2e-{os.getpid()}-{os.urandom(3).hex()}"
    args = dsp.run_args(name, image, cfg_dir, {"/var/lib/spanlet": tmp_path / "data",
                                               "/run/spanlet": tmp_path / "run"},
                        node_ip="127.0.0.1", env={k: str(v) for k, v in env.items()}, drop=drop)
    assert "/lib/modules" not in " ".join(args) and "/usr/src" not in " ".join(args)
    return dsp.Container(name, args), ports


def test_the_image_runs_as_the_daemonset_says(tmp_path, image, veth):
    standin = cuda_standin.build(tmp_path / "cuda")
    libcuda = standin.lib_dir / "libcuda.so.1"
    up = Upstream()
    up.rx.start()
    c, ports = start(tmp_path, image, veth, up)
    try:
        log = c.wait_log("spanlet: running")
        # the image's headers, the DaemonSet's capabilities and nothing missing
        assert "kernel headers: compiling against the image's /opt/spanlet/kernel-headers" in log
        assert "SYS_RESOURCE not needed: BPF memory is charged to the memory cgroup (checked)" in log
        assert "missing:" not in log, log
        want = sum(1 << privileges.CAP_NUMBERS[cap] for cap in dsp.capabilities())
        status = Path(f"/proc/{c.pid}/status").read_text()
        assert int(status.split("CapEff:")[1].split()[0], 16) == want
        assert int(status.split("CapBnd:")[1].split()[0], 16) == want
        for probe in PROBES:
            assert f"probe {probe} attached" in log, log
        assert f"tc_classify: attached to {veth}" in log
        assert "spanlet" in tc_filters(veth)
        progs, maps = bpf_ids(c.pid)
        assert len(progs) >= 8
        # hostPID: the agent's own pid (its pin folder's name) is its host pid
        assert list(Path("/sys/fs/bpf/spanlet").glob(f"{c.pid}-*/span_ctx"))

        # a process of another user: found through its /proc/<pid>/maps
        other = OtherUser(standin)
        try:
            assert other.attached_in(c, 30), c.logs()
        finally:
            other.close()

        # a serving process outside the container, the spanlet processor on its
        # provider, exports to the agent; its spans get exactly their launches
        endpoint = f"127.0.0.1:{ports['grpc']}"
        with FactsChild(endpoint, libcuda) as child:
            wait_for(lambda: traced(child, up), 60, "the containerised agent to trace the outside process")
            assert_exact_rounds(child, up)

        # /metrics from outside (hostNetwork), inspect through podman exec
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/metrics",
                                         timeout=10).read().decode()
        for probe in PROBES:
            assert f'spanlet_probe_attached{{node="{c.name}",probe="{probe}"}} 1.0' in metrics
        r = c.exec("spanlet", "inspect", "--json")
        assert r.returncode == 0, r.stderr
        summary = json.loads(r.stdout)
        assert summary, r.stdout

        assert c.stop() == 0, c.logs()
        assert "stopped: all probes detached" in c.logs()
    finally:
        c.close()
        up.rx.stop()
    # nothing of the agent is left
    assert not still_loaded(progs, "prog", grace_s=10)
    assert not still_loaded(maps, "map", grace_s=10)
    assert tc_filters(veth).strip() == ""
    assert f"bcc_{c.pid}" not in Path("/sys/kernel/tracing/uprobe_events").read_text()
    assert not list(Path("/sys/fs/bpf/spanlet").glob(f"{c.pid}-*"))
    assert dsp.podman("ps", "-a", "-q", "--filter", f"name={c.name}").stdout.strip() == ""


# What each capability of the DaemonSet is for, seen by running without it.
WITHOUT = {
    "SYS_ADMIN": {"not attached": PROBES},
    "NET_ADMIN": {"not attached": ("tc_classify",)},
    "SYS_PTRACE": {"not attached": ()},
}


@pytest.mark.parametrize("cap", dsp.capabilities())
def test_without_each_capability_the_agent_says_what_fails(tmp_path, image, veth, standin, cap):
    assert set(WITHOUT) == set(dsp.capabilities())   # a new capability needs its case here
    up = Upstream()
    up.rx.start()
    c, _ = start(tmp_path, image, veth, up, drop=(cap,))
    other = None
    try:
        log = c.wait_log("spanlet: running")
        missing = [l for l in log.splitlines() if " missing: " in l]
        assert len(missing) == 1 and f"capability CAP_{cap} missing: " in missing[0], log
        for probe in PROBES:
            attached = probe not in WITHOUT[cap]["not attached"]
            assert (f"probe {probe} attached" in log) is attached, log
            assert (f"probe {probe} NOT attached" in log) is not attached, log
        if cap == "SYS_PTRACE":
            # another user's process maps libcuda: its maps cannot be read
            other = OtherUser(standin)
            assert not other.attached_in(c, 6), c.logs()
        assert c.stop() == 0, c.logs()
    finally:
        if other is not None:
            other.close()
        c.close()
        up.rx.stop()


def test_a_serving_pods_spans_get_their_facts_from_the_containerised_agent(
        tmp_path, image, serving_image, veth):
    """The serving process in a container of its own (own mount and pid
    namespaces, no capabilities, read-only root), the client from the wheel:
    the agent finds its marker and libcuda only through /proc/<pid>/root."""
    up = Upstream()
    up.rx.start()
    c, ports = start(tmp_path, image, veth, up)
    name = f"spanlet-serving-{os.getpid()}-{os.urandom(3).hex()}"
    # hostNetwork only to reach the agent's receiver on loopback, as a pod
    # reaches status.hostIP; mounts and pids are its own
    pod = ["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs", "run", "--rm", "-i",
           "--name", name, *dsp._limits(), "--network", "host", "--cap-drop", "ALL",
           "--read-only", "--security-opt", "no-new-privileges", "--user", "65534:65534",
           serving_image]
    try:
        c.wait_log("spanlet: running")
        with FactsChild(f"127.0.0.1:{ports['grpc']}", "/opt/app/lib/libcuda.so.1",
                        command=pod) as child:
            try:
                wait_for(lambda: traced(child, up), 60, "the agent to trace the serving container")
            except AssertionError:
                raise AssertionError("the agent did not trace the serving container; its log:\n"
                                     + "\n".join(l for l in c.logs().splitlines()
                                                  if "/opt/app" in l or "ERROR" in l)) from None
            assert_exact_rounds(child, up)
        log = c.logs()
        assert "span_ctx: attached spanlet_mark@/opt/app/venv/" in log, log
        assert "gpu_launch: attached cuLaunchKernel" in log and "/opt/app/lib/libcuda.so.1" in log
        assert c.stop() == 0, c.logs()
    finally:
        dsp.podman("rm", "-f", "-t", "2", name, check=False)
        c.close()
        up.rx.stop()
