"""The DaemonSet's pod as a podman container: the arguments of `podman run`
read from daemonset/daemonset.yaml (its capabilities and no others, read-only
root, seccomp and AppArmor, host PID and network namespaces, its host mounts,
the ConfigMap as /etc/spanlet, its environment, its command), and podman run
as scripts/podman.sh runs it (runc, cgroupfs, limits no higher than ours)."""

from __future__ import annotations

import json
import resource
import subprocess
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DS = ROOT / "daemonset"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DS / name).read_text()) if d]


def pod_spec() -> dict:
    [ds] = _docs("daemonset.yaml")
    return ds["spec"]["template"]


def container() -> dict:
    [c] = pod_spec()["spec"]["containers"]
    return c


def configmap_text() -> str:
    [cm] = _docs("configmap.yaml")
    return cm["data"]["config.yaml"]


def capabilities() -> list[str]:
    return container()["securityContext"]["capabilities"]["add"]


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    """podman with runc and cgroupfs (scripts/podman.sh)."""
    return subprocess.run(["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs", *args],
                          capture_output=True, text=True, check=check, timeout=timeout)


def _limits() -> list[str]:
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 20000)
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 4096)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def run_args(name: str, image: str, config_dir: Path, host_paths: dict[str, Path],
             node_ip: str, env: dict[str, str] | None = None,
             drop: tuple[str, ...] = ()) -> list[str]:
    """`podman run` arguments for the pod. `host_paths` maps a hostPath of the
    DaemonSet to another folder of the host (a test's own data and socket
    folders on a machine shared with other agents); `env` adds variables after
    the DaemonSet's (overrides of the ConfigMap, as a node's would be);
    `drop` leaves capabilities of the DaemonSet out."""
    tpl = pod_spec()
    spec, c = tpl["spec"], container()
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["capabilities"]["drop"] == ["ALL"]
    args = ["run", "-d", "--name", name, *_limits(), "--user", str(sc["runAsUser"]),
            "--cap-drop", "ALL"]
    for cap in sc["capabilities"]["add"]:
        if cap not in drop:
            args += ["--cap-add", cap]
    if sc.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    if sc.get("seccompProfile", {}).get("type") == "Unconfined":
        args += ["--security-opt", "seccomp=unconfined"]
    apparmor = tpl["metadata"].get("annotations", {}).get(
        f"container.apparmor.security.beta.kubernetes.io/{c['name']}")
    if apparmor == "unconfined" and Path("/sys/kernel/security/apparmor").exists():
        args += ["--security-opt", "apparmor=unconfined"]
    if spec.get("hostPID"):
        args += ["--pid", "host"]
    if spec.get("hostNetwork"):
        args += ["--network", "host"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for m in c["volumeMounts"]:
        v = volumes[m["name"]]
        ro = ":ro" if m.get("readOnly") else ""
        if "configMap" in v:
            args += ["-v", f"{config_dir}:{m['mountPath']}:ro"]
        elif "hostPath" in v:
            src = host_paths.get(v["hostPath"]["path"], Path(v["hostPath"]["path"]))
            if v["hostPath"].get("type") == "DirectoryOrCreate":
                Path(src).mkdir(parents=True, exist_ok=True)
            args += ["-v", f"{src}:{m['mountPath']}{ro}"]
        elif "emptyDir" in v:
            size = v["emptyDir"].get("sizeLimit", "")
            size = size.replace("Mi", "m").replace("Gi", "g")
            args += ["--tmpfs", f"{m['mountPath']}:rw,size={size}" if size else m["mountPath"]]
        else:
            raise AssertionError(f"volume {m['name']}: no podman form for {v}")
    fields = {"spec.nodeName": name, "status.hostIP": node_ip}
    for e in c.get("env", []):
        value = e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        args += ["-e", f"{e['name']}={value}"]
    for k, v in (env or {}).items():
        args += ["-e", f"{k}={v}"]
    command = c.get("command")
    if command:
        args += ["--entrypoint", json.dumps(command[:1])]
    args.append(image)
    args += (command or [])[1:] + c.get("args", [])
    return args


class Container:
    """One container of the image run by `run_args`; removed by close()."""

    def __init__(self, name: str, args: list[str]):
        self.name = name
        podman(*args)
        self.pid = int(self.inspect("{{.State.Pid}}"))

    def inspect(self, fmt: str) -> str:
        return podman("inspect", "--format", fmt, self.name).stdout.strip()

    def logs(self) -> str:
        r = podman("logs", self.name, check=False)
        return r.stdout + r.stderr

    def wait_log(self, text: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log = self.logs()
            if text in log:
                return log
            if self.inspect("{{.State.Running}}") != "true":
                raise AssertionError(f"the container exited before {text!r}:\n{log}")
            time.sleep(0.5)
        raise AssertionError(f"no {text!r} in the container's log in {timeout} s:\n{self.logs()}")

    def exec(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return podman("exec", self.name, *argv, check=False, timeout=timeout)

    def stop(self, timeout_s: int = 30) -> int:
        """podman stop (SIGTERM, then SIGKILL after timeout_s); the exit code."""
        podman("stop", "-t", str(timeout_s), self.name, timeout=timeout_s + 30)
        return int(self.inspect("{{.State.ExitCode}}"))

    def close(self) -> None:
        podman("rm", "-f", "-t", "5", self.name, check=False)
