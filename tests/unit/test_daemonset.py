"""The Kubernetes deployment in daemonset/ (kubectl apply -k daemonset/): every
manifest is a valid object (Kubernetes JSON schema, strict; the
prometheus-operator CRDs by their required fields), the kustomization lists
them all, the ConfigMap's config.yaml passes the agent's own validator, the
DaemonSet agrees with that config (ports, mounts, probes, environment) and
holds no privileged container, every capability says why, the PrometheusRule
is exactly daemonset/prometheus-rules.yaml, and the Containerfile installs what
scripts/setup.sh installs.

The PrometheusRule is generated from the rules file by scripts/prometheusrule.py."""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath

import pytest
import yaml

import prometheusrule
from require import cannot_run

ROOT = Path(__file__).resolve().parents[2]
DS = ROOT / "daemonset"
RULES = DS / "prometheus-rules.yaml"
PROMRULE = DS / "prometheusrule.yaml"
K8S_OLDEST = "1.25.0"
MANIFESTS = ["namespace.yaml", "rbac.yaml", "configmap.yaml", "daemonset.yaml", "service.yaml",
             "servicemonitor.yaml", "prometheusrule.yaml"]
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}
# Paths the agent needs from the host (README, daemonset/README.md).
# The kernel headers (/lib/modules, /usr/src) are an option, commented out: the
# image carries its own.
HOST_PATHS = ["/sys/fs/bpf", "/sys/kernel/tracing", "/sys/fs/cgroup"]
OPTIONAL_HOST_PATHS = ["/lib/modules", "/usr/src"]
# What privileges.check needs on a kernel that charges BPF memory to the memory
# cgroup (>= 5.11) with tc enabled; SYS_RESOURCE only below that.
CAPS = {"SYS_ADMIN", "NET_ADMIN", "SYS_PTRACE"}


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DS / name).read_text()) if d is not None]


def all_docs() -> list[tuple[str, dict]]:
    return [(name, d) for name in MANIFESTS for d in docs(name)]


@pytest.fixture(scope="module")
def daemonset() -> dict:
    [ds] = docs("daemonset.yaml")
    return ds


@pytest.fixture(scope="module")
def container(daemonset) -> dict:
    [c] = daemonset["spec"]["template"]["spec"]["containers"]
    return c


@pytest.fixture(scope="module")
def config_text() -> str:
    [cm] = docs("configmap.yaml")
    return cm["data"]["config.yaml"]


@pytest.fixture(scope="module")
def cfg(config_text, tmp_path_factory):
    from spanlet import config
    path = tmp_path_factory.mktemp("cm") / "config.yaml"
    path.write_text(config_text)
    return config.load(path, env={})


# -- kustomization -----------------------------------------------------------------------

def test_kustomization_lists_every_manifest_and_they_exist():
    k = yaml.safe_load((DS / "kustomization.yaml").read_text())
    assert k["kind"] == "Kustomization"
    assert k["resources"] == MANIFESTS
    for name in k["resources"]:
        assert (DS / name).is_file(), name
    # Every top-level manifest of daemonset/ is listed (the rules file is the
    # plain Prometheus source, the kustomization itself is not a resource).
    present = {p.name for p in DS.glob("*.yaml")} - {"kustomization.yaml", "prometheus-rules.yaml"}
    assert present == set(MANIFESTS)
    # The image the DaemonSet names is the one the kustomization rewrites.
    [ds] = docs("daemonset.yaml")
    images = {c["image"].split(":")[0] for c in ds["spec"]["template"]["spec"]["containers"]}
    assert images <= {i["name"] for i in k["images"]}


def test_kustomize_builds_every_object():
    import shutil
    import subprocess
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        cannot_run("kubectl not installed (scripts/setup.sh installs Debian's kubernetes-client)")
    p = subprocess.run([kubectl, "kustomize", str(DS)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    built = sorted((d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(p.stdout) if d)
    assert built == sorted((d["kind"], d["metadata"]["name"]) for _, d in all_docs())


def test_all_objects_live_in_the_spanlet_namespace():
    for name, d in all_docs():
        if d["kind"] in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            continue
        assert d["metadata"]["namespace"] == "spanlet", (name, d["kind"])
    [ns] = docs("namespace.yaml")
    assert ns["metadata"]["name"] == "spanlet"
    # hostPID, hostNetwork, hostPath and added capabilities: only "privileged"
    # Pod Security admits them.
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


# -- schemas -----------------------------------------------------------------------------

@pytest.mark.parametrize("version", ["oldest", "latest"])
def test_core_manifests_validate_strictly(version):
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate missing: pip install kubernetes-validate "
                    "(it belongs in the [test] extras of pyproject.toml)")
    v = K8S_OLDEST if version == "oldest" else kubernetes_validate.latest_version() + ".0"
    seen = []
    for name, d in all_docs():
        if (d["apiVersion"], d["kind"]) in CRD_KINDS:
            continue
        kubernetes_validate.validate(d, v, strict=True)
        seen.append(d["kind"])
    assert sorted(seen) == sorted(["Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                                   "ConfigMap", "DaemonSet", "Service"])


def test_strict_validation_catches_a_typo(daemonset):
    import kubernetes_validate
    bad = json.loads(json.dumps(daemonset))
    bad["spec"]["template"]["spec"]["hostPid"] = bad["spec"]["template"]["spec"].pop("hostPID")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_OLDEST, strict=True)


def _crd_base(d: dict, kind: str) -> dict:
    assert d["apiVersion"] == "monitoring.coreos.com/v1" and d["kind"] == kind
    assert set(d) == {"apiVersion", "kind", "metadata", "spec"}
    md = d["metadata"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", md["name"])
    assert md["namespace"] == "spanlet"
    return d["spec"]


def test_servicemonitor_has_the_fields_the_crd_requires():
    [sm] = docs("servicemonitor.yaml")
    spec = _crd_base(sm, "ServiceMonitor")
    # CRD: spec.selector and spec.endpoints (array); endpoint fields by name.
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels",
                         "podTargetLabels", "sampleLimit", "attachMetadata"}
    [svc] = docs("service.yaml")
    assert spec["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert spec["namespaceSelector"]["matchNames"] == [svc["metadata"]["namespace"]]
    [ep] = spec["endpoints"]
    assert set(ep) <= {"port", "path", "scheme", "interval", "scrapeTimeout", "honorLabels",
                       "honorTimestamps", "relabelings", "metricRelabelings", "params"}
    assert ep["honorLabels"] is True
    assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert ep.get("path", "/metrics") == "/metrics"
    for r in ep.get("relabelings", []):
        assert set(r) <= {"sourceLabels", "targetLabel", "action", "regex", "replacement",
                          "separator", "modulus"}
        assert r.get("action", "replace") in {"replace", "keep", "drop", "labelmap", "labeldrop",
                                              "labelkeep", "hashmod"}


def test_service_selects_the_daemonset_metrics_port(daemonset, container):
    [svc] = docs("service.yaml")
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    [port] = svc["spec"]["ports"]
    by_name = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert by_name[port["targetPort"]] == port["port"] == 9464


def test_prometheusrule_has_the_fields_the_crd_requires():
    [pr] = docs("prometheusrule.yaml")
    spec = _crd_base(pr, "PrometheusRule")
    assert set(spec) == {"groups"}
    names = [g["name"] for g in spec["groups"]]
    assert len(names) == len(set(names))
    for g in spec["groups"]:
        assert set(g) <= {"name", "interval", "rules", "limit", "partial_response_strategy"}
        for r in g["rules"]:
            assert ("alert" in r) != ("record" in r) and "expr" in r
            assert set(r) <= {"alert", "record", "expr", "for", "labels", "annotations",
                              "keep_firing_for"}


def test_prometheusrule_groups_equal_the_rules_file():
    [pr] = docs("prometheusrule.yaml")
    want = yaml.safe_load(RULES.read_text())["groups"]
    assert pr["spec"]["groups"] == want, (
        "daemonset/prometheusrule.yaml differs from prometheus-rules.yaml; regenerate it: "
        ".venv/bin/python scripts/prometheusrule.py")
    assert PROMRULE.read_text() == prometheusrule.render_prometheusrule()


# -- the config and the DaemonSet agree ----------------------------------------------------

def test_configmap_config_passes_the_agent_validator(cfg):
    assert cfg.store.backend == "chdb" and cfg.store.enabled
    assert cfg.data_dir == "/var/lib/spanlet"
    assert cfg.tc.interfaces == [] and cfg.tc.exclude_interfaces == ["lo"]


def test_configmap_clickhouse_block_is_valid_when_uncommented(config_text, tmp_path):
    from spanlet import config
    lines = config_text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.strip() == "# backend: clickhouse")
    out = []
    for i, l in enumerate(lines):
        if i >= start and re.match(r"\s+# \w+: ", l):
            l = l.replace("# ", "", 1)
        if l.strip() == "backend: chdb":
            continue
        out.append(l)
    (tmp_path / "c.yaml").write_text("\n".join(out) + "\n")
    c = config.load(tmp_path / "c.yaml", env={})
    assert (c.store.backend, c.store.cluster) == ("clickhouse", "spanlet")
    assert c.store.url.startswith("https://")


def test_daemonset_environment_is_the_agents(container, config_text, tmp_path):
    from spanlet import config
    env = {e["name"]: e for e in container["env"]}
    assert env["SPANLET_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["SPANLET_OTLP_RECEIVER_ADDRESS"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    for name in env:
        if name.startswith("SPANLET_"):
            assert name == "SPANLET_CONFIG" or name in config.ENV_KEYS, name
    # SPANLET_CONFIG is the ConfigMap's key where the pod mounts it.
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    cfg_path = PurePosixPath(env["SPANLET_CONFIG"]["value"])
    assert mounts["config"]["mountPath"] == str(cfg_path.parent)
    assert mounts["config"].get("readOnly") is True
    vols = {v["name"]: v for v in _pod(container)["volumes"]}
    [cm] = docs("configmap.yaml")
    assert vols["config"]["configMap"]["name"] == cm["metadata"]["name"]
    assert cfg_path.name in cm["data"]
    # The file, then the pod's environment as the kubelet resolves it.
    (tmp_path / "config.yaml").write_text(config_text)
    c = config.load(None, env={"SPANLET_CONFIG": str(tmp_path / "config.yaml"),
                               "SPANLET_NODE_NAME": "gpu-node-7",
                               "SPANLET_OTLP_RECEIVER_ADDRESS": "10.1.2.3"})
    assert (c.node_name, c.otlp.receiver_address) == ("gpu-node-7", "10.1.2.3")


def _pod(_container=None) -> dict:
    [ds] = docs("daemonset.yaml")
    return ds["spec"]["template"]["spec"]


def test_container_ports_are_the_configs(container, cfg):
    ports = {p["containerPort"] for p in container["ports"]}
    assert ports == {cfg.otlp.grpc_port, cfg.otlp.http_port, cfg.http_port}
    for p in container["ports"]:
        # hostNetwork: the kubelet requires hostPort == containerPort.
        assert p["hostPort"] == p["containerPort"] and p["protocol"] == "TCP"


def test_host_namespaces(daemonset):
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["serviceAccountName"] == docs("rbac.yaml")[0]["metadata"]["name"]


def _mount_covers(mounts: list[str], path: str) -> bool:
    p = PurePosixPath(path)
    return any(p == PurePosixPath(m) or PurePosixPath(m) in p.parents for m in mounts)


def test_volume_mounts_cover_what_the_agent_needs(container, cfg):
    pod = _pod()
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    needed = [cfg.data_dir, str(PurePosixPath(cfg.admin_socket).parent)] + HOST_PATHS
    for path in needed:
        assert _mount_covers(list(mounts), path), path
    # Each host path is the same path on the host; headers and cgroups read-only.
    for path in HOST_PATHS + [cfg.data_dir, str(PurePosixPath(cfg.admin_socket).parent)]:
        m = mounts[path]
        assert vols[m["name"]]["hostPath"]["path"] == path
    for path in ["/sys/fs/cgroup"]:
        assert mounts[path].get("readOnly") is True, path
    for path in OPTIONAL_HOST_PATHS:
        assert not _mount_covers(list(mounts), path), path
    for path in ["/sys/fs/bpf", cfg.data_dir]:          # pins the map; writes the store
        assert not mounts[path].get("readOnly", False), path
    # readOnlyRootFilesystem: scratch space in an emptyDir /tmp.
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "emptyDir" in vols[mounts["/tmp"]["name"]]
    assert set(vols) == {m["name"] for m in container["volumeMounts"]}


def test_no_container_is_privileged_and_capabilities_are_named(daemonset, container):
    pod = daemonset["spec"]["template"]["spec"]
    for c in pod["containers"] + pod.get("initContainers", []):
        sc = c.get("securityContext", {})
        assert sc.get("privileged", False) is False, c["name"]
        assert sc.get("allowPrivilegeEscalation") is False, c["name"]
    caps = container["securityContext"]["capabilities"]
    assert caps["drop"] == ["ALL"]
    assert set(caps["add"]) == CAPS
    assert "SYS_RESOURCE" not in caps["add"]


def test_capabilities_are_what_the_agents_check_needs(container, cfg):
    """The set the agent's start-up check asks for on a memcg-charging kernel
    with the ConfigMap's settings is exactly the DaemonSet's."""
    from spanlet.probes import privileges
    add = set(container["securityContext"]["capabilities"]["add"])
    assert set(privileges.check(cfg.tc.enabled, caps=add, memcg=True).needed) == add
    assert privileges.check(cfg.tc.enabled, caps=add, memcg=True).missing == []
    # Older kernels (RLIMIT_MEMLOCK charged): SYS_RESOURCE is named as missing.
    assert privileges.check(cfg.tc.enabled, caps=add, memcg=False).missing == ["SYS_RESOURCE"]


def test_optional_header_mounts_are_documented_in_comments():
    text = (DS / "daemonset.yaml").read_text()
    for path in OPTIONAL_HOST_PATHS:
        assert re.search(rf"^\s+#\s+mountPath: {path}$", text, re.M), path
        assert re.search(rf"^\s+#\s+path: {path}$", text, re.M), path
    assert "privileged: true" not in (DS / "daemonset.yaml").read_text()


def test_every_added_capability_has_a_comment(container):
    lines = (DS / "daemonset.yaml").read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if l.strip() == "add:")
    found = {}
    for l in lines[start + 1:]:
        m = re.match(r"\s+- ([A-Z_]+)\s*(#\s+(.*))?$", l)
        if not m:
            if l.strip().startswith("#"):
                continue
            break
        found[m.group(1)] = (m.group(3) or "").strip()
    assert set(found) == set(container["securityContext"]["capabilities"]["add"])
    for cap, why in found.items():
        assert len(why.split()) >= 3, f"capability {cap} has no comment saying why"


def test_probes_are_healthz_and_readyz_on_the_http_port(container, cfg):
    by_name = {p["name"]: p["containerPort"] for p in container["ports"]}

    def port(probe):
        p = probe["httpGet"]["port"]
        return by_name[p] if isinstance(p, str) else p

    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert port(container["livenessProbe"]) == port(container["readinessProbe"]) == cfg.http_port


def _quantity(q: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "m": 1e-3, "": 1}
    m = re.fullmatch(r"([0-9.]+)(Ki|Mi|Gi|m|)", str(q))
    return float(m.group(1)) * units[m.group(2)]


def test_resources_leave_room_for_embedded_chdb(container):
    r = container["resources"]
    assert _quantity(r["limits"]["memory"]) >= 768 * 2**20
    assert _quantity(r["requests"]["memory"]) <= _quantity(r["limits"]["memory"])
    assert _quantity(r["requests"]["cpu"]) <= _quantity(r["limits"]["cpu"])


def test_tolerates_gpu_nodes_and_every_taint():
    tol = _pod()["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tol
    assert {"operator": "Exists"} in tol


def test_rbac_reads_pods_only():
    sa, role, binding = docs("rbac.yaml")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": sa["metadata"]["namespace"]}]


# -- Containerfile -------------------------------------------------------------------------

def _apt_packages(text: str) -> set[str]:
    joined = text.replace("\\\n", " ")
    pkgs: set[str] = set()
    for m in re.finditer(r"apt-get install ([^&;\n]+)", joined):
        pkgs |= {w for w in m.group(1).split() if not w.startswith("-")}
    return pkgs


def test_containerfile_builds_on_the_debian_base_with_its_headers_and_the_wheel():
    text = (DS / "Containerfile").read_text()
    image = (ROOT / "scripts" / "image.sh").read_text()
    # No registry: the base is an mmdebstrap root file system, named by image.sh.
    assert re.search(r"^ARG BASE$", text, re.M) and re.search(r"^FROM \$\{BASE\}$", text, re.M)
    assert not re.search(r"^FROM (?!\$\{BASE\})", text, re.M)
    assert "mmdebstrap" in image and "podman import" in image
    m = re.search(r"^packages=\(([^)]*)\)", image, re.M)
    assert {"python3-bpfcc", "bpftool", "iproute2", "python3-venv", "python3"} <= set(m.group(1).split())
    # The headers: a merged tree in the image, named to the agent by environment.
    assert "COPY kernel-headers /opt/spanlet/kernel-headers" in text
    assert "SPANLET_IMAGE_KERNEL_HEADERS=/opt/spanlet/kernel-headers" in text
    # The venv as scripts/setup.sh makes it: BCC's module through a folder
    # holding only its link, named in a .pth file.
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "bcc_into_venv" in setup  # its helper, shared with scripts/wheel_check.sh
    setup += (ROOT / "scripts" / "bcc_venv.sh").read_text()
    assert "ln -sfn /usr/lib/python3/dist-packages/bcc" in setup
    assert re.search(r"ln -sfn /usr/lib/python3/dist-packages/bcc \S+/bcc-site/bcc", text)
    assert re.search(r"spanlet-bcc\.pth", text)
    # The wheel of HEAD (image.sh builds it as wheel_check.sh does) with the
    # agent extra, from the wheelhouse alone; not an editable tree or a copy.
    assert "build_wheel" in image
    assert re.search(r"pip install [^\n]*--no-index --find-links /wheelhouse", text)
    assert re.search(r"spanlet-\*\.whl\)\[agent\]", text)
    assert not re.search(r"pip install [^\n]*(-e|--editable) ", text)
    # The agent's entry point is on PATH (the DaemonSet runs `spanlet run`).
    assert re.search(r"^ENV PATH=\S*/bin:", text, re.M)
    # podman only through runc and cgroupfs (scripts/podman.sh).
    assert "spanlet_podman build" in image
