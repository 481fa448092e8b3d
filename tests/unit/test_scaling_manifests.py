"""The autoscaling examples in daemonset/scaling/: the HPA is a valid
autoscaling/v2 object (Kubernetes JSON schema and the official client's
models), the KEDA ScaledObject has the fields KEDA documents, and the PromQL
both rely on (KEDA queries, the prometheus-adapter rule) is valid and returns
one number with the value the comments promise, checked with promtool."""

from __future__ import annotations

import inspect
import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCALING = ROOT / "daemonset" / "scaling"
HPA = SCALING / "hpa.yaml"
KEDA = SCALING / "keda-scaledobject.yaml"
RULES = ROOT / "daemonset" / "prometheus-rules.yaml"

# Kubernetes versions the HPA must validate against: the oldest schema
# kubernetes-validate ships (autoscaling/v2 is GA since 1.23) and its newest.
K8S_OLDEST = "1.25.0"

# What KEDA documents for a ScaledObject (keda.sh/docs/<ver>/reference/scaledobject-spec
# and the CRD config/crd/bases/keda.sh_scaledobjects.yaml): required fields,
# types, and the known keys (the CRD prunes unknown ones silently, so a typo
# would be dropped without an error: here it fails).
_INT = {"type": "integer", "minimum": 0}
_POLICIES = {"type": "array", "minItems": 1, "items": {
    "type": "object", "additionalProperties": False,
    "required": ["type", "value", "periodSeconds"],
    "properties": {"type": {"enum": ["Pods", "Percent"]},
                   "value": {"type": "integer", "minimum": 1},
                   "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800}}}}
_RULES = {"type": "object", "additionalProperties": False, "properties": {
    "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
    "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
    "policies": _POLICIES}}
SCALEDOBJECT_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name", "namespace"], "properties": {
            "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
            "namespace": {"type": "string"}}},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                   "name": {"type": "string", "minLength": 1},
                                   "envSourceContainerName": {"type": "string"}}},
                "pollingInterval": _INT, "cooldownPeriod": _INT, "initialCooldownPeriod": _INT,
                "idleReplicaCount": _INT, "minReplicaCount": _INT, "maxReplicaCount": _INT,
                "fallback": {"type": "object", "required": ["failureThreshold", "replicas"]},
                "advanced": {"type": "object", "additionalProperties": False, "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "scalingModifiers": {"type": "object"},
                    "horizontalPodAutoscalerConfig": {
                        "type": "object", "additionalProperties": False, "properties": {
                            "name": {"type": "string"},
                            "behavior": {"type": "object", "additionalProperties": False,
                                         "properties": {"scaleUp": _RULES, "scaleDown": _RULES}}}}}},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                    "properties": {
                        "type": {"type": "string"},
                        "name": {"type": "string"},
                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        "useCachedMetrics": {"type": "boolean"},
                        "authenticationRef": {"type": "object", "required": ["name"]},
                        # The CRD types metadata as map[string]string: numbers must be quoted.
                        "metadata": {"type": "object", "additionalProperties": {"type": "string"}}}}},
            },
        },
    },
}
# The prometheus scaler (keda.sh/docs/<ver>/scalers/prometheus).
PROMETHEUS_REQUIRED = {"serverAddress", "query", "threshold"}
PROMETHEUS_OPTIONAL = {"activationThreshold", "namespace", "customHeaders", "ignoreNullValues",
                       "queryParameters", "unsafeSsl", "timeout"}


def load(path: Path) -> dict:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert len(docs) == 1, f"{path.name}: one object per file"
    return docs[0]


@pytest.fixture(scope="module")
def hpa() -> dict:
    return load(HPA)


@pytest.fixture(scope="module")
def scaled_object() -> dict:
    return load(KEDA)


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool") or "/usr/bin/promtool"
    if not Path(path).exists():
        pytest.fail("promtool not found: scripts/setup.sh installs it (Debian package prometheus)")
    return path


def adapter_rule() -> dict:
    """The prometheus-adapter rule documented in hpa.yaml's header comment."""
    text = HPA.read_text()
    m = re.search(r"^# --- prometheus-adapter rule ---\n(.*?)^# --- end of rule ---$", text, re.S | re.M)
    assert m, "hpa.yaml: adapter rule block missing"
    return yaml.safe_load("\n".join(line[2:] for line in m.group(1).splitlines()))


def promql_values(promtool: str, tmp_path: Path, queries: dict[str, str],
                  series: list[dict], expected: dict[str, float]) -> None:
    """Evaluates each query as a recording rule over `series` (1m apart) at 10m
    with promtool, and checks it returns exactly one sample, without labels,
    of the expected value."""
    rules = {"groups": [{"name": "q", "rules": [{"record": name, "expr": q} for name, q in queries.items()]}]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    check = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yaml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [{"expr": name, "eval_time": "10m",
                              "exp_samples": [{"labels": name, "value": value}]}
                             for name, value in expected.items()]}]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    p = subprocess.run([promtool, "test", "rules", "tests.yaml"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "SUCCESS" in p.stdout, p.stdout + p.stderr


# -- HPA ------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", ["oldest", "latest"])
def test_hpa_validates_against_the_kubernetes_schema(hpa, version):
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate missing: pip install kubernetes-validate "
                    "(it belongs in the [test] extras of pyproject.toml)")
    v = K8S_OLDEST if version == "oldest" else kubernetes_validate.latest_version() + ".0"
    # strict: unknown fields are errors too, not silently dropped.
    kubernetes_validate.validate(hpa, v, strict=True)


def test_hpa_schema_check_rejects_a_broken_hpa(hpa):
    import kubernetes_validate
    broken = json.loads(json.dumps(hpa))
    del broken["spec"]["metrics"][0]["external"]["metric"]["name"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_OLDEST, strict=True)
    typo = json.loads(json.dumps(hpa))
    typo["spec"]["maxReplica"] = typo["spec"].pop("maxReplicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_OLDEST, strict=True)


def client_model(data: dict, klass: str):
    """`data` deserialized into the official client's model `klass`; the models
    check required fields while being built."""
    from kubernetes import client
    api = client.ApiClient()
    text = json.dumps(data)
    if "content_type" in inspect.signature(api.deserialize).parameters:
        return api.deserialize(text, klass, "application/json")   # kubernetes >= 35
    return api.deserialize(SimpleNamespace(data=text), klass)      # older clients: a response


def test_hpa_deserializes_into_the_official_client_model(hpa):
    from kubernetes import client
    obj = client_model(hpa, "V2HorizontalPodAutoscaler")
    assert isinstance(obj, client.V2HorizontalPodAutoscaler)
    spec = obj.spec
    assert (spec.scale_target_ref.api_version, spec.scale_target_ref.kind) == ("apps/v1", "Deployment")
    assert 1 <= spec.min_replicas <= spec.max_replicas
    [metric] = spec.metrics
    assert metric.type == "External"
    assert metric.external.metric.name == "spanlet_gpu_utilization_ratio"
    assert (metric.external.target.type, metric.external.target.value) == ("Value", "700m")
    # The API server's limits that the JSON schema does not carry.
    for rules in (spec.behavior.scale_up, spec.behavior.scale_down):
        assert 0 <= rules.stabilization_window_seconds <= 3600
        for p in rules.policies:
            assert 0 < p.period_seconds <= 1800 and p.value > 0


def test_client_model_rejects_a_metric_without_type(hpa):
    broken = json.loads(json.dumps(hpa))
    del broken["spec"]["metrics"][0]["type"]
    with pytest.raises(ValueError, match="type"):
        client_model(broken, "V2HorizontalPodAutoscaler")


def test_adapter_rule_serves_the_hpa_metric(hpa):
    doc = adapter_rule()
    [rule] = doc["externalRules"]
    metric = hpa["spec"]["metrics"][0]["external"]["metric"]["name"]
    assert rule["name"]["as"] == metric
    assert re.fullmatch(rule["name"]["matches"], metric)
    assert rule["seriesQuery"].startswith(metric + "{")
    # The agent's GPU series carry no serving namespace: the adapter must not
    # add the HPA's namespace to the query.
    assert rule["resources"] == {"namespaced": False}
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]


def test_adapter_query_averages_the_gpus(promtool, tmp_path):
    rule = adapter_rule()["externalRules"][0]
    query = (rule["metricsQuery"].replace("<<.Series>>", "spanlet_gpu_utilization_ratio")
             .replace("<<.LabelMatchers>>", 'node!=""'))
    labels = 'job="spanlet",instance="{0}:9464",node="{0}",gpu="{1}"'
    series = [{"series": f"spanlet_gpu_utilization_ratio{{{labels.format(n, g)}}}", "values": f"{v}x10"}
              for n, g, v in (("gpu-a", "0", 0.5), ("gpu-a", "1", 1), ("gpu-b", "0", 0.75),
                              ("gpu-b", "1", 0.75))]
    promql_values(promtool, tmp_path, {"adapter:gpu_utilization": query}, series,
                  {"adapter:gpu_utilization": 0.75})


# -- KEDA ---------------------------------------------------------------------------------

def test_scaled_object_has_the_fields_keda_documents(scaled_object):
    import jsonschema
    jsonschema.validate(scaled_object, SCALEDOBJECT_SCHEMA)
    spec = scaled_object["spec"]
    assert spec["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    # KEDA accepts fallback only when every trigger is AverageValue.
    if "fallback" in spec:
        assert all(t.get("metricType", "AverageValue") == "AverageValue" for t in spec["triggers"])


def test_keda_schema_rejects_what_keda_would(scaled_object):
    import jsonschema
    for mutate in (lambda so: so["spec"]["scaleTargetRef"].pop("name"),
                   lambda so: so["spec"]["triggers"][0].pop("metadata"),
                   lambda so: so["spec"]["triggers"][0]["metadata"].__setitem__("threshold", 25),
                   lambda so: so["spec"].__setitem__("minReplicas", 1),
                   lambda so: so.__setitem__("apiVersion", "keda.k8s.io/v1alpha1")):
        bad = json.loads(json.dumps(scaled_object))
        mutate(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, SCALEDOBJECT_SCHEMA)


def test_prometheus_triggers(scaled_object):
    triggers = scaled_object["spec"]["triggers"]
    assert [t["type"] for t in triggers] == ["prometheus", "prometheus"]
    queries = " ".join(t["metadata"]["query"] for t in triggers)
    assert "spanlet_scheduler_batch_size_hint" in queries
    assert "spanlet_slo_compliance_ratio" in queries
    names = [t["name"] for t in triggers]
    assert len(set(names)) == len(names)
    for t in triggers:
        md = t["metadata"]
        assert PROMETHEUS_REQUIRED <= set(md), t["name"]
        assert set(md) <= PROMETHEUS_REQUIRED | PROMETHEUS_OPTIONAL, t["name"]
        assert re.fullmatch(r"https?://[^/\s]+(:\d+)?/?", md["serverAddress"]), md["serverAddress"]
        assert float(md["threshold"]) > 0
        assert md.get("ignoreNullValues", "true") in ("true", "false")


def test_compliance_trigger_holds_at_the_gold_objective(scaled_object):
    # threshold = 1 - the gold objective of the alert rules: the trigger asks
    # for more replicas exactly where SpanletSloComplianceLowGold would fire.
    rules = yaml.safe_load(RULES.read_text())
    gold = next(r for g in rules["groups"] for r in g["rules"]
                if r["alert"] == "SpanletSloComplianceLowGold")
    objective = float(re.search(r"<\s*([0-9.]+)\s*$", gold["expr"].strip()).group(1))
    trig = next(t for t in scaled_object["spec"]["triggers"] if t["name"] == "gold-slo-misses")
    assert trig["metricType"] == "Value"
    assert float(trig["metadata"]["threshold"]) == pytest.approx(1 - objective)


def test_keda_queries_return_one_number(promtool, tmp_path, scaled_object):
    triggers = {t["name"]: t["metadata"]["query"] for t in scaled_object["spec"]["triggers"]}
    base = 'job="spanlet",instance="{0}:9464",node="{0}"'
    series = [
        # 1200 + 600 audio requests a minute in namespace serving = 30/s; text
        # and another namespace must not count.
        {"series": f'spanlet_request_duration_seconds_count{{{base.format("gpu-a")},namespace="serving",'
                   f'pod="asr-0",modality="audio",slo_class="gold"}}', "values": "0+1200x10"},
        {"series": f'spanlet_request_duration_seconds_count{{{base.format("gpu-b")},namespace="serving",'
                   f'pod="asr-1",modality="audio",slo_class="silver"}}', "values": "0+600x10"},
        {"series": f'spanlet_request_duration_seconds_count{{{base.format("gpu-a")},namespace="serving",'
                   f'pod="chat-0",modality="text",slo_class="gold"}}', "values": "0+6000x10"},
        {"series": f'spanlet_request_duration_seconds_count{{{base.format("gpu-a")},namespace="batch",'
                   f'pod="asr-9",modality="audio",slo_class="bronze"}}', "values": "0+6000x10"},
        # Audio hints 2 and 4 on the two nodes: mean 3, so 30/s needs 10 batches/s.
        {"series": f'spanlet_scheduler_batch_size_hint{{{base.format("gpu-a")},modality="audio"}}',
         "values": "2x10"},
        {"series": f'spanlet_scheduler_batch_size_hint{{{base.format("gpu-b")},modality="audio"}}',
         "values": "4x10"},
        {"series": f'spanlet_scheduler_batch_size_hint{{{base.format("gpu-a")},modality="text"}}',
         "values": "16x10"},
        # Gold audio compliance: the worst node, 0.875, gives 0.125 misses; other
        # classes and modalities are worse and must not count.
        {"series": f'spanlet_slo_compliance_ratio{{{base.format("gpu-a")},slo_class="gold",modality="audio"}}',
         "values": "0.9375x10"},
        {"series": f'spanlet_slo_compliance_ratio{{{base.format("gpu-b")},slo_class="gold",modality="audio"}}',
         "values": "0.875x10"},
        {"series": f'spanlet_slo_compliance_ratio{{{base.format("gpu-a")},slo_class="silver",modality="audio"}}',
         "values": "0.5x10"},
        {"series": f'spanlet_slo_compliance_ratio{{{base.format("gpu-a")},slo_class="gold",modality="text"}}',
         "values": "0.5x10"},
    ]
    promql_values(promtool, tmp_path,
                  {"keda:batches_needed": triggers["batches-needed"],
                   "keda:gold_slo_misses": triggers["gold-slo-misses"]},
                  series, {"keda:batches_needed": 10.0, "keda:gold_slo_misses": 0.125})


# -- both -----------------------------------------------------------------------------------

def test_keda_and_hpa_scale_different_deployments(hpa, scaled_object):
    # KEDA manages its own HPA for its target; a second HPA on the same
    # Deployment would fight it (KEDA's admission webhook rejects the pair).
    def target(obj, ref):
        return obj["metadata"]["namespace"], ref.get("kind", "Deployment"), ref["name"]
    assert target(hpa, hpa["spec"]["scaleTargetRef"]) != \
        target(scaled_object, scaled_object["spec"]["scaleTargetRef"])
