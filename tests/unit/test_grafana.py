"""The Grafana dashboards (grafana/): generated files are current; every
dashboard decodes into grafana-foundation-sdk's models without losing a key and
with every value of the type and enum the models declare; data sources only
through variables; every PromQL parses (promtool), names agent metric families
and their exported labels; the node overview has the 17 metrics with the
thresholds of METRICS.md; every ClickHouse query, macros expanded as the plugin
expands them, runs on a real chdb store filled through the agent's row path and
returns rows; the provisioning files are well-formed and hold no secret."""

from __future__ import annotations

import ast
import copy
import enum
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
import types
import typing
from pathlib import Path

import pytest
import yaml
from grafana_foundation_sdk.cog import plugins as sdk_plugins
from grafana_foundation_sdk.cog import runtime as sdk_runtime
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard, ThresholdsConfig
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import grafana_queries as gq
from spanlet import admin, events
from spanlet.join import SpanJoin
from facts_fakes import FakeFacts
from prometheus_server import Prometheus
from spanlet.metrics import catalogue
from spanlet.exporters.clickhouse import rows, schema
from spanlet.exporters.clickhouse.chdb_backend import ChdbBackend
from spanlet.exporters.clickhouse.sink import ClickHouseSink
from spanlet.exporters.http import AgentHttpServer
from collector_fakes import every_source, registry
from metrics_md import THRESHOLDS as METRICS_MD_THRESHOLDS

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
DS_VAR = re.compile(r"^\$\{(ds_[a-z]+)\}$")


def _load_generator():
    spec = importlib.util.spec_from_file_location("spanlet_grafana_generate", GRAFANA / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


GEN = _load_generator()
DASHBOARDS = gq.dashboards()
IDS = [p.name for p, _ in DASHBOARDS]


def all_objects(node, path="$"):
    """(path, dict) of every object nested in a JSON value."""
    if isinstance(node, dict):
        yield path, node
        for k, v in node.items():
            yield from all_objects(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from all_objects(v, f"{path}[{i}]")


# -- the files ---------------------------------------------------------------------------

def test_five_dashboards_with_stable_uids_and_no_ids():
    assert IDS == ["gpu.json", "network.json", "node-overview.json", "request-drilldown.json",
                   "sandbox.json"]
    uids = [d["uid"] for _, d in DASHBOARDS]
    assert len(set(uids)) == 5 and all(u.startswith("spanlet-") for u in uids)
    assert all(d["id"] is None for _, d in DASHBOARDS)


def test_dashboard_files_are_what_the_generator_writes():
    built = GEN.build()
    assert sorted(built) == IDS
    for path, _ in DASHBOARDS:
        assert path.read_text() == GEN.render(built[path.name]), \
            f"{path.name} is stale: run .venv/bin/python grafana/generate.py"


# -- schema: grafana-foundation-sdk models --------------------------------------------------

sdk_plugins.register_default_plugins()
_HINTS: dict[type, dict] = {}


def _is_model(cls) -> bool:
    return isinstance(cls, type) and hasattr(cls, "from_json") and hasattr(cls, "to_json")


def type_errors(value, hint, path: str) -> list[str]:
    """Where a decoded value does not have the type (or enum value) the SDK
    model declares for it."""
    if hint is typing.Any or hint is object:
        # panel options and custom field config: typed by the panel plugin that decoded them
        return model_errors(value, path) if _is_model(type(value)) else []
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        errs = [type_errors(value, h, path) for h in typing.get_args(hint)]
        return [] if any(not e for e in errs) else min(errs, key=len)
    if hint is type(None):
        return [] if value is None else [f"{path}: expected null"]
    if origin is typing.Literal:
        ok = value in typing.get_args(hint)
        return [] if ok else [f"{path}: {value!r} not in {typing.get_args(hint)}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {value!r}"]
        (item,) = typing.get_args(hint) or (typing.Any,)
        return [e for i, v in enumerate(value) for e in type_errors(v, item, f"{path}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{path}: expected an object, got {value!r}"]
        _, item = typing.get_args(hint) or (str, typing.Any)
        return [e for k, v in value.items() for e in type_errors(v, item, f"{path}.{k}")]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        ok = isinstance(value, hint) or value in {m.value for m in hint}
        return [] if ok else [f"{path}: {value!r} is not one of {[m.value for m in hint]}"]
    if hint is bool:
        return [] if isinstance(value, bool) else [f"{path}: expected a boolean, got {value!r}"]
    if hint in (int, float):
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and (hint is float or float(value).is_integer()))
        return [] if ok else [f"{path}: expected {hint.__name__}, got {value!r}"]
    if hint is str:
        return [] if isinstance(value, str) else [f"{path}: expected a string, got {value!r}"]
    if isinstance(hint, type):
        if isinstance(value, dict) and _is_model(hint):      # kept raw by the parent's decoder
            try:
                decoded = hint.from_json(value)
            except Exception as e:  # noqa: BLE001 - any decode failure is a schema error
                return [f"{path}: does not decode as {hint.__name__}: {e!r}"]
            again = json.loads(json.dumps(decoded, cls=JSONEncoder))
            return lost_in_decoding(value, again, path) + model_errors(decoded, path)
        if not isinstance(value, hint):
            return [f"{path}: expected {hint.__name__}, got {type(value).__name__}"]
        return model_errors(value, path)
    return [f"{path}: unchecked annotation {hint!r}"]


def model_errors(obj, path: str = "$") -> list[str]:
    if isinstance(obj, sdk_runtime.UnknownDataquery):
        return []          # queries of plugins the SDK does not know: checked on their own
    cls = type(obj)
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return [e for name, hint in _HINTS[cls].items()
            for e in type_errors(getattr(obj, name), hint, f"{path}.{name}")]


def lost_in_decoding(a, b, path: str = "$") -> list[str]:
    """Keys and values of the file that the decoded model does not give back:
    names the schema does not have, or values it reads differently."""
    if isinstance(a, dict):
        if not isinstance(b, dict):
            return [f"{path}: not an object after decoding"]
        return [e for k, v in a.items() for e in
                ([f"{path}.{k}: not in the schema"] if k not in b and v is not None
                 else lost_in_decoding(v, b.get(k), f"{path}.{k}"))]
    if isinstance(a, list):
        if not isinstance(b, list) or len(a) != len(b):
            return [f"{path}: list changed by decoding"]
        return [e for i, (x, y) in enumerate(zip(a, b)) for e in lost_in_decoding(x, y, f"{path}[{i}]")]
    return [] if a == b or a is None else [f"{path}: {a!r} decoded as {b!r}"]


def override_errors(d: dict) -> list[str]:
    """Override values are untyped in the models; those of known ids are checked."""
    out = []
    for path, obj in all_objects(d):
        if "matcher" in obj and "properties" in obj:
            for i, prop in enumerate(obj["properties"]):
                where = f"{path}.properties[{i}]"
                if prop["id"] == "thresholds":
                    out += type_errors(prop["value"], ThresholdsConfig, where)
                elif prop["id"] == "unit":
                    out += [] if isinstance(prop["value"], str) else [f"{where}: unit"]
                elif prop["id"] == "custom.hidden":
                    out += [] if isinstance(prop["value"], bool) else [f"{where}: hidden"]
                elif prop["id"] == "links":
                    out += [f"{where}: link {lk}" for lk in prop["value"]
                            if set(lk) - {"title", "url", "targetBlank"} or not lk.get("url")]
                else:
                    out.append(f"{where}: unknown override property {prop['id']}")
    return out


def schema_errors(d: dict) -> list[str]:
    """Everything the grafana-foundation-sdk models say is wrong with a dashboard."""
    model = Dashboard.from_json(d)
    again = json.loads(json.dumps(model, cls=JSONEncoder))
    known_panels = set(sdk_runtime.Runtime().panelcfg_variants) | {"row"}
    unknown = [f"panel type {p['type']}" for p in d["panels"] if p["type"] not in known_panels]
    return lost_in_decoding(d, again) + model_errors(model) + override_errors(d) + unknown


@pytest.mark.parametrize("name", IDS)
def test_dashboard_matches_the_foundation_sdk_models(name):
    assert schema_errors(DASHBOARDS[IDS.index(name)][1]) == []


@pytest.mark.parametrize("break_it, expected", [
    (lambda d: d["panels"][2]["gridPos"].update(h="8"), "grid_pos.h: expected int"),
    (lambda d: d["panels"][2].update(gridpos={}), "gridpos: not in the schema"),
    (lambda d: d["panels"][2]["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"].update(
        mode="lines"), "thresholds_style.mode: 'lines' is not one of"),
    (lambda d: d["panels"][2]["fieldConfig"]["defaults"]["thresholds"]["steps"][1].update(
        value="0.05"), "steps[1].value: expected float"),
    (lambda d: d["panels"][2]["targets"][0].update(format="timeseries"), "format_val: 'timeseries'"),
    (lambda d: d["templating"]["list"][1].update(type="qeury"), "type_val: 'qeury' is not one of"),
    (lambda d: d["panels"][2].update(type="timeseriez"), "panel type timeseriez"),
    (lambda d: d["panels"][2]["fieldConfig"]["overrides"].append(
        {"matcher": {"id": "byName", "options": "x"},
         "properties": [{"id": "thresholds", "value": {"mode": "absolute", "steps": "red"}}]}),
     "steps: 'red' decoded as"),
])
def test_schema_check_catches_broken_dashboards(break_it, expected):
    d = copy.deepcopy(DASHBOARDS[IDS.index("node-overview.json")][1])
    assert schema_errors(d) == []
    break_it(d)
    assert any(expected in e for e in schema_errors(d)), schema_errors(d)


# -- data sources ------------------------------------------------------------------------

@pytest.mark.parametrize("name", IDS)
def test_data_sources_only_through_variables(name):
    d = DASHBOARDS[IDS.index(name)][1]
    ds_vars = {n: v["query"] for n, v in gq.variables(d).items() if v["type"] == "datasource"}
    assert ds_vars, "no data source variable"
    assert all("current" not in v for v in gq.variables(d).values() if v["type"] == "datasource")
    for path, obj in all_objects(d):
        assert "datasourceUid" not in obj, path
        ds = obj.get("datasource")
        if isinstance(ds, dict):
            m = DS_VAR.match(ds.get("uid", ""))
            assert m and m.group(1) in ds_vars, f"{path}: datasource {ds}"
            assert ds.get("type") == ds_vars[m.group(1)], f"{path}: {ds} vs {ds_vars}"
        url = obj.get("url")
        if isinstance(url, str) and "panes=" in url:       # Explore links
            for pane in json.loads(url.split("panes=", 1)[1]).values():
                assert DS_VAR.match(pane["datasource"]), f"{path}: {pane['datasource']}"


@pytest.mark.parametrize("name", IDS)
def test_every_panel_and_query_names_a_datasource_variable(name):
    d = DASHBOARDS[IDS.index(name)][1]
    listed = list(gq.panels(d))
    assert listed
    for p in listed:
        assert DS_VAR.match(p["datasource"]["uid"]), p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], p["title"]


CH_TARGET_KEYS = {"refId", "datasource", "editorType", "queryType", "format", "rawSql"}


def test_clickhouse_targets_follow_the_plugin_query_model():
    # src/types/sql.ts: editorType sql, queryType table|logs|timeSeries|traces; the
    # numeric format of src/data/utils.ts mapQueryTypeToGrafanaFormat.
    n = 0
    for _, d in DASHBOARDS:
        for p in gq.panels(d):
            for t in p["targets"]:
                if t["datasource"]["type"] != gq.CLICKHOUSE:
                    continue
                n += 1
                assert set(t) == CH_TARGET_KEYS, p["title"]
                assert t["editorType"] == "sql"
                assert t["format"] == GEN.CH_FORMATS[t["queryType"]]
                assert (t["queryType"] == "timeSeries") == (p["type"] == "timeseries"), p["title"]
    assert n >= 10


# -- PromQL ------------------------------------------------------------------------------

def agent_families() -> dict[str, str]:
    """family name -> type, read from the code: every family(...) and
    _single(...) with a literal name in agent/metrics, and every metric class's
    literal `name = ...` (the family its base class makes), typed by the catalogue."""
    out = {}
    for path in (ROOT / "agent" / "metrics").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("family", "_single")
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                out[node.args[0].value] = catalogue.BY_NAME[node.args[0].value].type
            elif isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if (isinstance(stmt, ast.Assign) and [getattr(t, "id", "") for t in stmt.targets] == ["name"]
                            and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)):
                        out[stmt.value.value] = catalogue.BY_NAME[stmt.value.value].type
    return out


def sample_names(families: dict[str, str]) -> dict[str, str]:
    """Prometheus sample name -> family, as exporters/prometheus.py renders them."""
    out = {}
    for name, kind in families.items():
        suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
        for s in suffixes:
            out[name + s] = name
    return out


PROM_QUERIES = gq.prometheus_queries()
METRIC = re.compile(r"\b(spanlet_[a-z0-9_]+)\b")


def test_families_read_from_code_include_the_17():
    fams = agent_families()
    assert [t[0] for t in admin.THRESHOLDS if t[0] not in fams] == []
    assert fams["spanlet_gpu_sync_wait_seconds"] == "histogram"
    assert fams["spanlet_sandbox_violations_total"] == "counter"


def test_every_promql_parses(tmp_path):
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    if not Path(promtool).exists():
        pytest.fail("promtool not found: scripts/setup.sh installs it (Debian package prometheus)")
    assert len(PROM_QUERIES) >= 60
    rules = {"groups": [{"name": "grafana", "rules": [
        {"record": f"dashboard_query_{i}", "expr": expr} for i, (_, _, expr) in enumerate(PROM_QUERIES)]}]}
    f = tmp_path / "dashboard_queries.yaml"
    f.write_text(yaml.safe_dump(rules))
    p = subprocess.run([promtool, "check", "rules", str(f)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"SUCCESS: {len(PROM_QUERIES)} rules found" in p.stdout


def test_promtool_check_rejects_a_broken_query(tmp_path):
    # the check above would pass vacuously if promtool accepted anything
    f = tmp_path / "broken.yaml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": "x", "expr": "sum by (node (rate(spanlet_events_read_total[1m]))"}]}]}))
    p = subprocess.run([shutil.which("promtool") or "/usr/bin/promtool", "check", "rules", str(f)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0


def test_every_metric_in_promql_is_an_agent_family_with_its_suffix():
    names = sample_names(agent_families())
    used = set()
    for dash, panel, expr in PROM_QUERIES:
        for m in METRIC.findall(expr):
            assert m in names, f"{dash} / {panel}: {m} is not a sample the agent exports"
            used.add(names[m])
    # the histograms are read through _bucket/_sum/_count, counters through _total
    assert {"spanlet_gpu_sync_wait_seconds", "spanlet_request_duration_seconds"} <= used


@pytest.fixture(scope="module")
def agent_registry():
    """The agent's collector (exporters/prometheus.py over the metric engine),
    its kernel, NVML and store sources stood in (as in test_prometheus_collector.py),
    real serving metrics, scheduler and span join: every family the dashboards
    read has series."""
    return registry(every_source())


@pytest.fixture(scope="module")
def exported_labels(agent_registry) -> dict[str, set[str]]:
    """Prometheus sample name -> label names, from a scrape of the collector."""
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(generate_latest(agent_registry).decode()):
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def _labels_used(expr: str) -> set[str]:
    used = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        used |= {s.strip() for s in group.split(",") if s.strip()}
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        used |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    return used


def test_promql_uses_only_labels_the_agent_exports(exported_labels):
    for dash, panel, expr in PROM_QUERIES:
        metrics = set(METRIC.findall(expr))
        missing = metrics - set(exported_labels)
        assert not missing, f"{dash} / {panel}: the scrape has no {missing}"
        have = set().union(*(exported_labels[m] for m in metrics))
        assert _labels_used(expr) <= have, f"{dash} / {panel}: {_labels_used(expr) - have} in {expr}"


def test_legends_name_only_labels_of_their_series(exported_labels):
    for _, d in DASHBOARDS:
        for p in gq.panels(d):
            for t in p["targets"]:
                if t["datasource"]["type"] == "prometheus":
                    have = set().union(*(exported_labels[m] for m in METRIC.findall(t["expr"])))
                    used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t["legendFormat"]))
                    assert used <= have, f"{p['title']}: legend {used - have}"


def test_every_promql_returns_series_from_a_real_prometheus(tmp_path, agent_registry):
    # Prometheus scrapes the agent's HTTP port (exporters/http.py); every
    # query of every dashboard, variables included, must have a result.
    server = AgentHttpServer("127.0.0.1", 0, agent_registry, ready=lambda: True)
    server.start()
    prom = Prometheus(tmp_path, f"127.0.0.1:{server.server_address[1]}", honor_labels=True)
    try:
        prom.wait_scraped(4)
        queries = gq.prometheus_queries(rate_interval="10s", interval="1s", range_="10s")
        empty = [(d, p, e) for d, p, e in queries if not prom.query(e)]
        assert empty == []
    finally:
        prom.stop()
        server.stop()


def test_multi_value_variables_use_regex_matchers_and_all_is_dot_star():
    for _, d in DASHBOARDS:
        for name, v in gq.variables(d).items():
            if v["type"] == "query" and v["datasource"]["type"] == "prometheus":
                assert v["includeAll"] and v["multi"] and v["allValue"] == ".*", name
        prom_vars = {n for n, v in gq.variables(d).items()
                     if v["type"] == "query" and v["datasource"]["type"] == "prometheus"}
        for _, obj in all_objects(d):
            for text in (obj.get("expr", ""), obj.get("query", "") if obj.get("type") == "query" else ""):
                for label, op, var in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"\$\{?(\w+)', str(text)):
                    assert var in prom_vars and op == "=~", f"{label}{op}${var} in {text}"


def test_prometheus_expansion_rules():
    d = DASHBOARDS[IDS.index("node-overview.json")][1]
    expr = 'sum(rate(x{node=~"$node", pod=~"${pod:regex}"}[$__rate_interval])) + y[$__range] + z[$__interval]'
    assert gq.expand_promql(expr, d, rate_interval="2m", range_="6h", interval="30s") == \
        'sum(rate(x{node=~".*", pod=~".*"}[2m])) + y[6h] + z[30s]'
    with pytest.raises(ValueError):
        gq.expand_promql('x{a=~"$nope"}', d)
    assert gq.variable_selector('label_values(up{job="a"}, instance)') == 'up{job="a"}'
    assert all("$" not in e for _, _, e in PROM_QUERIES)


# -- node overview and METRICS.md ----------------------------------------------------------

def _panel_thresholds(p: dict) -> dict[str, list[tuple[str, float]]]:
    """'' (the panel) or the override regex -> (colour, value) of its steps above the base."""
    fc = p["fieldConfig"]
    out = {"": [(s["color"], s["value"]) for s in fc["defaults"]["thresholds"]["steps"][1:]]}
    for o in fc["overrides"]:
        for prop in o["properties"]:
            if prop["id"] == "thresholds":
                out[o["matcher"]["options"]] = [(s["color"], s["value"]) for s in prop["value"]["steps"][1:]]
    return out


def test_node_overview_has_one_panel_per_metric_with_the_metrics_md_threshold():
    d = DASHBOARDS[IDS.index("node-overview.json")][1]
    metrics = [t[0] for t in admin.THRESHOLDS]            # the 17, in METRICS.md order
    assert len(metrics) == 17
    by_number: dict[int, dict] = {}
    for p in gq.panels(d):
        m = re.match(r"#(\d+) ", p["title"])
        if m:
            assert int(m.group(1)) not in by_number, p["title"]
            by_number[int(m.group(1))] = p
    assert sorted(by_number) == list(range(1, 18))
    for number, family in enumerate(metrics, start=1):
        p = by_number[number]
        assert len(p["targets"]) == 1 and re.search(rf"\b{family}(_bucket)?\b", p["targets"][0]["expr"])
        expected = [t for t in METRICS_MD_THRESHOLDS if t.number == number]
        drawn = _panel_thresholds(p)
        if not expected:
            assert drawn == {"": []}, f"#{number}: METRICS.md has no threshold"
            assert "no threshold" in p["title"]
            continue
        assert p["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] in ("line", "line+area")
        for t in expected:
            cls = re.fullmatch(r'slo_class="(\w+)"', t.selector) if t.selector else None
            key = f"^{cls.group(1)} .*" if cls else ""       # per-class overrides match the legend
            colours = {v: c for c, v in drawn[key]}
            assert float(t.value) in colours, f"#{number} {t.selector}: {t.value} not in {drawn}"
            # "<" thresholds (compliance, coverage): green from the threshold up; ">": red/orange
            assert (colours[float(t.value)] == "green") == (t.op == "<"), f"#{number}: {drawn}"
            if t.quantile:
                assert f"histogram_quantile({t.quantile}," in p["targets"][0]["expr"]
            num = float(t.value)
            shown = f"{num * 1000:g} ms" if family.endswith("_seconds") and num < 1 else f"{num:g}"
            assert shown in p["title"], p["title"]
    # METRICS.md #14: the frame default (alert) and the action-speech default (120 ms)
    assert [v for _, v in _panel_thresholds(by_number[14])[""]] == [0.02, 0.12]


def test_thresholds_of_other_dashboards_agree_with_the_node_overview():
    # one number per metric on every dashboard (the generator reads the alert rules)
    overview = DASHBOARDS[IDS.index("node-overview.json")][1]
    steps_of = {}
    for p in gq.panels(overview):
        if re.match(r"#\d+ ", p["title"]):
            family = re.sub(r"_bucket$", "", METRIC.findall(p["targets"][0]["expr"])[0])
            steps_of[family] = _panel_thresholds(p)
    checked = 0
    for path, d in DASHBOARDS:
        for p in gq.panels(d):
            drawn = _panel_thresholds(p)
            for t in p["targets"]:
                for m in METRIC.findall(t.get("expr", "")):
                    family = re.sub(r"_(bucket|sum|count)$", "", m)
                    if family not in steps_of or not any(drawn.values()):
                        continue
                    if family == "spanlet_sandbox_violations_total" and path.name == "sandbox.json":
                        # integer counts: "any violation" (> 0) is drawn as >= 1
                        assert drawn == {"": [("red", 1)]}, p["title"]
                    else:
                        assert drawn == steps_of[family], f"{path.name} / {p['title']}"
                    checked += 1
    assert checked >= 10


# -- ClickHouse --------------------------------------------------------------------------------

NOW = time.time_ns()
T0 = NOW - 300 * 10**9
TRACE_A, TRACE_B = bytes(range(1, 17)), bytes(range(17, 33))
POD = ("serving", "pod-a", "worker")
NODE = "node-1"


def _event(cls, kind, span: int, trace: bytes, ts: int, **fields):
    ev = cls()
    ev.hdr.kind, ev.hdr.span_id, ev.hdr.cgroup_id = kind, span, 7
    ev.hdr.pid, ev.hdr.tid = 100, 101
    ev.hdr.trace_id[:] = list(trace)
    ev.hdr.modality = events.Modality.image
    for k, v in fields.items():
        setattr(ev, k, v)
    ev.epoch_ns = ts
    return ev


def kernel_events() -> list:
    return [
        _event(events.GpuLaunch, events.Kind.GPU_LAUNCH, 1, TRACE_A, T0 + 1000, duration_ns=5000,
               api=events.Api.driver, entry=events.Entry.cuLaunchKernel),
        _event(events.GpuLaunch, events.Kind.GPU_LAUNCH, 1, TRACE_A, T0 + 2000, duration_ns=7000,
               api=events.Api.driver, entry=events.Entry.cuLaunchKernel),
        _event(events.GpuSync, events.Kind.GPU_SYNC, 1, TRACE_A, T0 + 3000, duration_ns=3_000_000,
               api=events.Api.runtime, entry=events.Entry.cudaDeviceSynchronize),
        _event(events.SandboxViolation, events.Kind.SANDBOX, 1, TRACE_A, T0 + 4000, rule=events.Rule.exec,
               action=events.Action.audit, pool_id=3, len=4096, pool_max_bytes=1 << 20),
        _event(events.GpuSync, events.Kind.GPU_SYNC, 2, TRACE_B, T0 + 5000, duration_ns=9_000_000,
               api=events.Api.runtime, entry=events.Entry.cudaStreamSynchronize),
    ]


def kernel_rows() -> FakeFacts:
    """The span facts rows the kernel made for the events above (their counts)."""
    facts = FakeFacts()
    facts.add(TRACE_A, 1, driver=2, launch_ns=12000, sync_wait_ns=3_000_000, syncs=1, violations=1,
              cpu_ns=20_000_000, runqueue_ns=5_000_000, blocked_ns=10_000_000,
              cgroup_id=7, pid=100, first_ns=T0 + 1000)
    facts.add(TRACE_B, 2, sync_wait_ns=9_000_000, syncs=1, cgroup_id=7, pid=100, first_ns=T0 + 5000)
    return facts


def spans() -> list[trace_pb2.ResourceSpans]:
    rs = trace_pb2.ResourceSpans()
    for k, v in (("service.name", "demo-serving"), ("k8s.namespace.name", POD[0]),
                 ("k8s.pod.name", POD[1]), ("k8s.container.name", POD[2])):
        rs.resource.attributes.add(key=k).value.string_value = v
    ss = rs.scope_spans.add()
    for trace, span_id, ms in ((TRACE_A, 1, 40), (TRACE_B, 2, 25), (TRACE_B, 3, 5)):
        span = ss.spans.add(trace_id=trace, span_id=span_id.to_bytes(8, "big"), name=f"infer-{span_id}",
                            kind=trace_pb2.Span.SPAN_KIND_SERVER, start_time_unix_nano=T0,
                            end_time_unix_nano=T0 + ms * 10**6,
                            parent_span_id=b"" if span_id != 3 else (2).to_bytes(8, "big"))
        if span_id == 1:
            for k, v in (("mm.modality", "image"), ("slo.class", "silver")):
                span.attributes.add(key=k).value.string_value = v
    return [rs]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A real chdb store with the agent's schema, filled through the agent's
    path: kernel events joined to their spans (agent/join.py), rows built by
    exporters/clickhouse/rows.py, written by the sink."""
    from spanlet.config import JoinConfig
    backend = ChdbBackend(str(tmp_path_factory.mktemp("chdb") / "store"), database="spanlet")
    sink = ClickHouseSink(backend, batch_interval_s=0.05)
    try:
        join = SpanJoin(JoinConfig(), facts=kernel_rows())
        evs = kernel_events()
        for ev in evs:
            join.add_event(ev)
        batch = spans()
        join.join(batch)
        sink.write(schema.TRACES, rows.TRACE_COLUMNS, rows.span_rows(batch))
        sink.write(schema.KERNEL_EVENTS, rows.KERNEL_EVENT_COLUMNS,
                   rows.kernel_event_rows(evs, lambda cgroup: POD, NODE))
        assert sink.flush(60), sink.stats()
        assert sink.stats()["dropped_rows_total"] == 0
        yield backend
    finally:
        sink.shutdown(10)


CH_QUERIES = gq.clickhouse_queries("spanlet", since_ns=NOW - 3600 * 10**9, until_ns=NOW + 60 * 10**9,
                                   interval_s=30, trace_id=TRACE_A.hex())


def named(backend, sql: str) -> list[dict]:
    cols = [r[0] for r in backend.query(f"DESCRIBE ({sql})")]
    return [dict(zip(cols, r)) for r in backend.query(sql)]


def test_clickhouse_query_list_covers_panels_variables_and_links():
    titles = [(d, p) for d, p, _ in CH_QUERIES]
    n_targets = sum(1 for _, d in DASHBOARDS for p in gq.panels(d) for t in p["targets"]
                    if t["datasource"]["type"] == gq.CLICKHOUSE)
    assert len([t for t in titles if " / link: " not in t[1] and not t[1].startswith("variable ")]) \
        == n_targets
    assert sum(1 for _, p in titles if p.startswith("variable ")) == 5
    assert any("link: Trace view (ClickHouse store)" in p for _, p in titles)


@pytest.mark.parametrize("dash, panel, sql", CH_QUERIES, ids=[f"{d}|{p}" for d, p, _ in CH_QUERIES])
def test_clickhouse_query_runs_on_the_store_and_returns_rows(store, dash, panel, sql):
    assert "$" not in sql
    assert store.query(sql), f"{dash} / {panel} returned no rows:\n{sql}"


SELECTED = {"node": [NODE], "namespace": [POD[0]], "pod": [POD[1]], "service": ["demo-serving"],
            "rule": ["exec"], "action": ["audit", "kill"], "modality": ["image"], "slo_class": ["silver"]}
ANATOMY_CHART = "Where the time of a request went, at p50/p95/p99 of its duration"
ANATOMY_TABLE = "Slowest requests' anatomy (the 20 slowest)"


def test_clickhouse_queries_filtered_to_one_workload(store):
    # with values chosen, the conditions $__conditionalAll drops at All are run too
    chosen = gq.clickhouse_queries("spanlet", since_ns=NOW - 3600 * 10**9, until_ns=NOW + 60 * 10**9,
                                   selected=SELECTED)
    assert any("K8sPodName IN ('pod-a')" in sql for _, _, sql in chosen)
    assert any("Action IN ('audit','kill')" in sql for _, _, sql in chosen)
    assert any("'other') IN ('image')" in sql for _, p, sql in chosen if p == ANATOMY_TABLE)
    for dash, panel, sql in chosen:
        assert store.query(sql), f"{dash} / {panel} returned no rows:\n{sql}"
    other = gq.clickhouse_queries("spanlet", since_ns=NOW - 3600 * 10**9, until_ns=NOW + 60 * 10**9,
                                  selected={**SELECTED, "pod": ["pod-b"]})
    for dash, panel, sql in other:
        if panel in ("Spans and their kernel facts (newest first)", "Recent violations", ANATOMY_CHART,
                     ANATOMY_TABLE):
            assert store.query(sql) == [], f"{dash} / {panel}: pod filter not applied"


def _query(dash: str, panel: str) -> str:
    return next(s for d, p, s in CH_QUERIES if d == dash and p == panel)


def test_drilldown_answers_exactly(store):
    dash = "spanlet / Request drill-down"
    listed = named(store, _query(dash, "Spans and their kernel facts (newest first)"))
    a = next(r for r in listed if r["span_id"] == (1).to_bytes(8, "big").hex())
    assert (a["trace_id"], a["pod"], a["duration"]) == (TRACE_A.hex(), "pod-a", 40_000_000)
    assert (a["kernel_gpu_launches"], a["kernel_gpu_launch_ns"], a["kernel_gpu_sync_wait_ns"],
            a["kernel_sandbox_violations"]) == (2, 12000, 3_000_000, 1)
    assert len(listed) == 3
    stalls = named(store, _query(dash, "Slowest GPU stalls"))
    assert [(r["span_id"], r["gpu_sync_wait"]) for r in stalls] == [
        ((2).to_bytes(8, "big").hex(), 9_000_000), ((1).to_bytes(8, "big").hex(), 3_000_000)]
    trace = named(store, _query(dash, "Spans and their kernel facts (newest first) / link: "
                                      "Trace view (ClickHouse store)"))
    assert [(r["traceID"], r["operationName"]) for r in trace] == [(TRACE_A.hex(), "infer-1")]
    kinds = {r["kind"] for r in named(store, _query(dash, "Kernel events (newest first)"))}
    assert kinds == {"GPU_LAUNCH", "GPU_SYNC", "SANDBOX"}
    # the scheduler's facts the join put on span 1 (40 ms), its GPU sync wait (3 ms) taken out of blocked
    slowest = named(store, _query(dash, ANATOMY_TABLE))
    assert [(r["span_id"], r["modality"], r["slo_class"]) for r in slowest] == [
        ((1).to_bytes(8, "big").hex(), "image", "silver"), ((2).to_bytes(8, "big").hex(), "other", "none"),
        ((3).to_bytes(8, "big").hex(), "other", "none")]
    assert [slowest[0][c] for c in ("cpu", "run_queue", "blocked", "gpu_sync_wait", "other")] == [
        20_000_000, 5_000_000, 7_000_000, 3_000_000, 5_000_000]
    chart = named(store, _query(dash, ANATOMY_CHART))
    assert list(chart[0]) == ["requests", "CPU", "run queue", "blocked", "GPU sync wait", "other"]
    assert [tuple(r.values()) for r in chart if r["requests"].startswith("image")] == [
        (f"image silver p{q}", 0.02, 0.005, 0.007, 0.003, 0.005) for q in (50, 95, 99)]


def test_request_anatomy_row_reads_the_boards_variables_and_links_its_traces():
    d = DASHBOARDS[IDS.index("request-drilldown.json")][1]
    at = next(i for i, p in enumerate(d["panels"]) if p["title"] == "Request anatomy")
    assert d["panels"][at]["type"] == "row"
    chart, table = d["panels"][at + 1:at + 3]
    assert (chart["title"], table["title"]) == (ANATOMY_CHART, ANATOMY_TABLE)
    assert chart["type"] == "barchart" and chart["options"]["stacking"] == "normal"
    assert chart["fieldConfig"]["defaults"]["unit"] == "s" and chart["options"]["xField"] == "requests"
    assert {"modality", "slo_class"} <= set(gq.variables(d))
    for p in (chart, table):
        sql = p["targets"][0]["rawSql"]
        assert "${modality:sqlstring}" in sql and "${slo_class:sqlstring}" in sql and "SpanKind = 'Server'" in sql
    stalls = next(p for p in gq.panels(d) if p["title"] == "Slowest GPU stalls")
    trace_ids = [[o for o in p["fieldConfig"]["overrides"] if o["matcher"]["options"] == "trace_id"]
                 for p in (table, stalls)]
    assert trace_ids[0] == trace_ids[1] and trace_ids[0][0]["properties"][0]["id"] == "links"


def test_sandbox_by_pool_answers_exactly(store):
    got = named(store, _query("spanlet / Sandbox", "By pool, rule and action in the time range"))
    assert [(r["pool_id"], r["rule"], r["action"], r["violations"], r["pods"]) for r in got] == \
        [(3, "exec", "audit", 1, 1)]
    recent = named(store, _query("spanlet / Sandbox", "Recent violations"))
    assert [(r["node"], r["pod"], r["trace_id"]) for r in recent] == [(NODE, "pod-a", TRACE_A.hex())]


def test_time_filter_leaves_out_rows_outside_the_range(store):
    # the range really filters: an hour that ended before the data has nothing
    old = gq.clickhouse_queries("spanlet", since_ns=T0 - 7200 * 10**9, until_ns=T0 - 3600 * 10**9)
    sql = next(s for d, p, s in old if p == "Spans and their kernel facts (newest first)")
    assert store.query(sql) == []


def test_clickhouse_macros_expand_as_the_plugin_documents():
    # docs/sources/query-editor.md of grafana/clickhouse-datasource, "Macros": output examples
    f, t = 1415792726 * 10**9 + 123_000_000, 1447328726 * 10**9 + 456_000_000
    m = gq.plugin_macros
    assert m("$__timeFilter(time)", f, t, 20) == \
        "time >= toDateTime(1415792726) AND time <= toDateTime(1447328726)"
    assert m("$__timeFilter_ms(time)", f, t, 20) == \
        "time >= fromUnixTimestamp64Milli(1415792726123) AND time <= fromUnixTimestamp64Milli(1447328726456)"
    assert m("$__fromTime $__toTime", f, t, 20) == "toDateTime(1415792726) toDateTime(1447328726)"
    assert m("$__fromTime_ms", f, t, 20) == "fromUnixTimestamp64Milli(1415792726123)"
    assert m("$__timeInterval(column)", f, t, 20) == \
        "toStartOfInterval(toDateTime(column), INTERVAL 20 second)"
    assert m("$__interval_s", f, t, 20) == "20"
    d = DASHBOARDS[IDS.index("request-drilldown.json")][1]
    sql = "WHERE $__conditionalAll(pod IN (${pod:sqlstring}), $pod) AND (${trace_id:sqlstring} = '')"
    assert gq.expand_sql(sql, d, database="db", since_ns=f, until_ns=t, interval_s=1) == \
        "WHERE 1=1 AND ('' = '')"
    at_one = copy.deepcopy(d)
    gq.variables(at_one)["pod"]["current"] = {"text": ["p'1"], "value": ["p'1"]}
    at_one["templating"]["list"] = list(gq.variables(at_one).values())
    assert gq.conditional_all(sql, at_one).startswith("WHERE pod IN (${pod:sqlstring})")
    assert gq.sqlstring("p'1") == "'p''1'"


# -- provisioning ---------------------------------------------------------------------------

def test_dashboard_provisioning_is_a_file_provider():
    doc = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "spanlet.yaml").read_text())
    assert doc["apiVersion"] == 1
    (p,) = doc["providers"]
    assert p["type"] == "file" and p["options"]["path"].startswith("/")
    assert p["folder"] == "spanlet"


def test_datasource_provisioning_uses_env_placeholders_and_no_uids():
    text = (GRAFANA / "provisioning" / "datasources" / "spanlet.yaml").read_text()
    doc = yaml.safe_load(text)
    assert doc["apiVersion"] == 1
    by_type = {d["type"]: d for d in doc["datasources"]}
    assert set(by_type) == {"prometheus", gq.CLICKHOUSE}
    assert all("uid" not in d for d in doc["datasources"])
    assert by_type["prometheus"]["url"].startswith("$")
    ch = by_type[gq.CLICKHOUSE]
    assert ch["jsonData"]["traces"]["defaultTable"] == schema.TRACES
    secrets = [v for d in doc["datasources"] for v in d.get("secureJsonData", {}).values()]
    assert secrets and all(re.fullmatch(r"\$\{?[A-Z_]+\}?", v) for v in secrets)
    assert not re.search(r"(?i)password:\s*[^$\s]", text)
