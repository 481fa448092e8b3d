"""The Prometheus alert rules (daemonset/prometheus-rules.yaml): promtool accepts
them without warnings, promtool's unit tests (tests/support/rules_test.yaml) pass,
every default threshold of METRICS.md has its alert with that number, and the
rules only use labels the agent exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from metrics_md import METRICS_WITH_THRESHOLD, THRESHOLDS, Threshold

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "daemonset" / "prometheus-rules.yaml"
RULES_TEST = ROOT / "tests" / "support" / "rules_test.yaml"
SEVERITIES = {"critical", "warning", "info"}


# The agent's own health (METRICS.md "Self-metrics").
SELF_ALERTS = {
    "SpanletProbeNotAttached": ("spanlet_probe_attached", "spanlet_probe_attached == 0"),
    "SpanletEventsDropped": ("spanlet_events_dropped_total", "rate(spanlet_events_dropped_total[5m]) > 0"),
    "SpanletScrapeErrors": ("spanlet_scrape_errors_total", "increase(spanlet_scrape_errors_total[10m]) > 0"),
}

# The request anatomy's (METRICS.md "Request anatomy"; its defaults are ours).
ANATOMY_ALERTS = {
    "SpanletPodCpuThrottled": ("spanlet_pod_cpu_throttled_seconds_total",
                               "rate(spanlet_pod_cpu_throttled_seconds_total[5m]) > 0.1"),
}

# Labels each family is exported with besides `node` (the contract with the
# exporter; `le` on histogram buckets). Rules may group by and match on these
# only, and the promtool test series may carry only these plus job/instance.
EXPORTED_LABELS = {
    "spanlet_gpu_sync_wait_seconds": {"namespace", "pod", "container", "modality", "api"},
    "spanlet_jitter_sensitivity_score": {"protocol", "modality"},
    "spanlet_sandbox_violations_total": {"namespace", "pod", "container", "rule", "action"},
    "spanlet_gpu_memory_peak_ratio": {"gpu"},
    "spanlet_gpu_pcie_utilization_ratio": {"gpu", "direction"},
    "spanlet_request_duration_seconds": {"modality", "slo_class", "namespace", "pod"},
    "spanlet_time_to_first_token_seconds": {"modality", "slo_class", "namespace", "pod"},
    "spanlet_p99_latency_volatility_ratio": {"modality", "slo_class"},
    "spanlet_slo_compliance_ratio": {"slo_class", "modality"},
    "spanlet_throughput_decay_ratio": {"model", "bottleneck"},
    # Assumed: the alignment histogram is kept per namespace (the workload's).
    "spanlet_modality_alignment_delay_seconds": {"namespace"},
    "spanlet_modality_degradations_total": {"from", "to"},
    "spanlet_embedding_drift_score": {"pair"},
    "spanlet_span_kernel_coverage_ratio": {"what"},
    "spanlet_probe_attached": {"probe"},
    "spanlet_events_dropped_total": {"probe"},
    "spanlet_scrape_errors_total": {"source"},
    "spanlet_pod_cpu_throttled_seconds_total": {"namespace", "pod"},
}
SCRAPE_LABELS = {"job", "instance"}


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool") or "/usr/bin/promtool"
    if not Path(path).exists():
        pytest.fail("promtool not found: scripts/setup.sh installs it (Debian package prometheus)")
    return path


def run(promtool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def alerts() -> dict[str, dict]:
    doc = yaml.safe_load(RULES.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert all("alert" in r for r in rules), "recording rules belong elsewhere"
    return {r["alert"]: r for r in rules}


@pytest.fixture(scope="module")
def rule_tests() -> list[dict]:
    return yaml.safe_load(RULES_TEST.read_text())["tests"]


def comparisons(expr: str) -> list[tuple[str, str]]:
    """(operator, number) of every comparison with a literal in the expr."""
    return re.findall(r"(==|!=|>=|<=|>|<)\s*(-?[0-9]+(?:\.[0-9]+)?)\b", expr)


# -- promtool -----------------------------------------------------------------------

def test_promtool_check_rules_succeeds_without_warnings(promtool, alerts):
    p = run(promtool, "check", "rules", str(RULES.relative_to(ROOT)))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert f"SUCCESS: {len(alerts)} rules found" in p.stdout, out
    assert "warn" not in out.lower(), out


def test_promtool_unit_tests_pass(promtool):
    p = run(promtool, "test", "rules", str(RULES_TEST.relative_to(ROOT)))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "SUCCESS" in p.stdout and "FAILED" not in out, out


def test_every_alert_has_a_quiet_and_a_firing_case(alerts, rule_tests):
    # promtool checks only the cases written down; this makes sure they exist.
    quiet, firing = set(), set()
    for group in rule_tests:
        for case in group.get("alert_rule_test", []):
            name = case["alertname"]
            assert name in alerts, f"rules_test.yaml tests an unknown alert {name}"
            if not case.get("exp_alerts"):
                quiet.add(name)
                continue
            firing.add(name)
            for exp in case["exp_alerts"]:
                labels, notes = exp["exp_labels"], exp.get("exp_annotations", {})
                assert labels["severity"] == alerts[name]["labels"]["severity"]
                assert set(notes) == {"summary", "description"}, f"{name}: annotations not checked"
    assert quiet == set(alerts), f"no exp_alerts: [] case for {sorted(set(alerts) - quiet)}"
    assert firing == set(alerts), f"no firing case for {sorted(set(alerts) - firing)}"


# -- thresholds -------------------------------------------------------------------------

def test_threshold_table_covers_every_metrics_md_default():
    assert {t.number for t in THRESHOLDS} == METRICS_WITH_THRESHOLD


def test_no_alert_outside_the_tables(alerts):
    expected = {t.alert for t in THRESHOLDS} | set(SELF_ALERTS) | set(ANATOMY_ALERTS)
    assert set(alerts) == expected


@pytest.mark.parametrize("t", THRESHOLDS, ids=lambda t: t.alert)
def test_threshold_alert_uses_the_default(alerts, t: Threshold):
    assert t.alert in alerts, f"METRICS.md #{t.number} {t.metric}: no alert {t.alert}"
    rule = alerts[t.alert]
    expr = rule["expr"]
    assert rule["labels"]["metric"] == t.metric
    assert re.search(rf"\b{t.metric}(_bucket)?\b", expr), expr
    # The comparison that decides the alert is the last one: `... > 0.05`.
    assert comparisons(expr)[-1] == (t.op, t.value), expr
    if t.quantile:
        assert re.search(rf"histogram_quantile\(\s*{re.escape(t.quantile)}\s*,", expr), expr
        assert re.search(rf"rate\({t.metric}_bucket(\{{[^}}]*\}})?\[", expr), expr
    if t.selector:
        assert t.selector in expr, expr
    # A person reading the alert sees the metric and the threshold.
    notes = rule["annotations"]
    assert t.metric in notes["description"]
    assert t.value in notes["summary"] + notes["description"] or t.value == "0"


def test_per_class_defaults_differ_by_class(alerts):
    # gold 0.2 / silver 0.5 / bronze 0.8 s; objectives 0.95 / 0.85 / 0.75.
    for prefix, values in (("SpanletRequestLatency", ("0.2", "0.5", "0.8")),
                           ("SpanletSloComplianceLow", ("0.95", "0.85", "0.75"))):
        got = tuple(comparisons(alerts[prefix + c]["expr"])[-1][1] for c in ("Gold", "Silver", "Bronze"))
        assert got == values


def test_drift_alert_holds_three_windows(alerts):
    assert alerts["SpanletEmbeddingDriftHigh"]["for"] == "30s"
    doc = yaml.safe_load(RULES.read_text())
    group = next(g for g in doc["groups"]
                 if any(r["alert"] == "SpanletEmbeddingDriftHigh" for r in g["rules"]))
    assert group["interval"] == "10s"


def test_memory_alert_says_it_keeps_to_the_ratio(alerts):
    text = alerts["SpanletGpuMemoryPeakHigh"]["annotations"]["description"]
    assert "1.2 GiB" in text and "not exported" in text


@pytest.mark.parametrize("name", sorted({**SELF_ALERTS, **ANATOMY_ALERTS}))
def test_self_and_anatomy_metric_alerts(alerts, name):
    metric, fragment = {**SELF_ALERTS, **ANATOMY_ALERTS}[name]
    rule = alerts[name]
    assert fragment in " ".join(rule["expr"].split())
    assert rule["labels"]["metric"] == metric
    assert metric in rule["annotations"]["description"]


# -- shape of every alert ------------------------------------------------------------------

def test_every_alert_has_for_severity_and_annotations(alerts):
    for name, rule in alerts.items():
        assert "for" in rule, name
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert rule["labels"]["metric"] in EXPORTED_LABELS, name
        assert rule["annotations"]["summary"].strip(), name
        assert rule["annotations"]["description"].strip(), name


def test_rules_group_and_match_only_on_exported_labels(alerts):
    for name, rule in alerts.items():
        expr, metric = rule["expr"], rule["labels"]["metric"]
        known = EXPORTED_LABELS[metric] | {"node"}
        for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            used = {s.strip() for s in group.split(",") if s.strip()} - {"le"}
            assert used <= known, f"{name} groups by {used - known}, not exported on {metric}"
            assert "node" in used, f"{name} drops the node label"
        for matchers in re.findall(r"\{([^}]*)\}", expr):
            used = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
            assert used <= known, f"{name} matches on {used - known}, not exported on {metric}"
        for label in re.findall(r"\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)", str(rule["annotations"])):
            assert label in known, f"{name} prints $labels.{label}, not exported on {metric}"


def test_rule_test_series_carry_only_exported_labels(rule_tests):
    series_re = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}$")
    for group in rule_tests:
        for s in group["input_series"]:
            name, body = series_re.match(s["series"]).groups()
            family = re.sub(r"_(bucket|count|sum)$", "", name)
            family = family if family in EXPORTED_LABELS else name
            labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', body))
            allowed = EXPORTED_LABELS[family] | {"node"} | SCRAPE_LABELS
            allowed |= {"le"} if name.endswith("_bucket") else set()
            assert "node" in labels, s["series"]
            assert labels <= allowed, f"{s['series']}: {labels - allowed} not exported"


# -- the agent's catalogue (agent/metrics/catalogue.py) --------------------------------------

def _catalogue_alerts() -> dict[str, tuple]:
    from spanlet.metrics import catalogue
    return {t.alert: (m.number, m.name, t) for m in catalogue.CATALOGUE for t in m.thresholds if t.alert}


def test_catalogue_thresholds_are_the_metrics_md_defaults():
    mine = _catalogue_alerts()
    assert set(mine) == {t.alert for t in THRESHOLDS}
    for t in THRESHOLDS:
        number, metric, c = mine[t.alert]
        assert (number, metric, c.op, c.value) == (t.number, t.metric, t.op, float(t.value)), t.alert
        assert c.quantile == (float(t.quantile) if t.quantile else None), t.alert
        assert (f'slo_class="{c.slo_class}"' if c.slo_class else "") == t.selector, t.alert


@pytest.mark.parametrize("name", sorted(_catalogue_alerts()))
def test_each_catalogue_threshold_has_its_rule_with_that_number(alerts, name):
    number, metric, c = _catalogue_alerts()[name]
    assert name in alerts, f"#{number} {metric}: no alert {name}"
    expr = alerts[name]["expr"]
    assert alerts[name]["labels"]["metric"] == metric
    op, value = comparisons(expr)[-1]
    assert (op, float(value)) == (c.op, c.value), expr
    if c.quantile is not None:
        assert re.search(rf"histogram_quantile\(\s*{c.quantile:g}\s*,", expr), expr
    if c.slo_class:
        assert f'slo_class="{c.slo_class}"' in expr, expr
    assert ("rate(" in expr and c.quantile is None) == c.rate, expr
