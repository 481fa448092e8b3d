"""The pieces spanlet's Grafana dashboards are built from: panels, their
thresholds (from the metric catalogue), the grid layout, variables and the dashboard shell."""

from __future__ import annotations

from dataclasses import dataclass, field

from spanlet.exporters.clickhouse.queries import FINAL_READ
from spanlet.metrics import catalogue

SCHEMA_VERSION = 39          # Grafana 11.x dashboard JSON
CLICKHOUSE = "grafana-clickhouse-datasource"
PROM = {"type": "prometheus", "uid": "${ds_prometheus}"}
CH = {"type": CLICKHOUSE, "uid": "${ds_clickhouse}"}
TAG = "spanlet"

# The ClickHouse plugin's query types and the numeric `format` each maps to
# (grafana/clickhouse-datasource src/data/utils.ts, mapQueryTypeToGrafanaFormat).
CH_FORMATS = {"timeSeries": 0, "table": 1, "logs": 2, "traces": 3}


# -- thresholds from the metric catalogue ----------------------------------------------

@dataclass(frozen=True)
class Threshold:
    value: float
    upper: bool               # True: values above are bad; False: values below are bad
    slo_class: str = ""       # per-class defaults (#9, #12)


def catalogue_thresholds(family: str) -> list[Threshold]:
    """The defaults of a family in the catalogue (agent/metrics/catalogue.py),
    so that a dashboard line, inspect and the alert rules never disagree."""
    return [Threshold(t.value, t.op == ">", t.slo_class)
            for t in catalogue.BY_NAME[family].thresholds]


def threshold_steps(thresholds: list[Threshold]) -> dict:
    """Grafana thresholds: a step is in force from its value upwards."""
    upper = thresholds[0].upper
    steps = [{"color": "green" if upper else "red", "value": None}]
    colours = ["red"] if len(thresholds) == 1 else ["orange", "red"]
    for t, colour in zip(sorted(thresholds, key=lambda t: t.value), colours):
        steps.append({"color": colour if upper else "green", "value": t.value})
    return {"mode": "absolute", "steps": steps}


def describe(thresholds: list[Threshold], unit: str) -> str:
    if not thresholds:
        return "no threshold"
    def num(v: float) -> str:
        if unit == "s":
            return f"{v * 1000:g} ms" if v < 1 else f"{v:g} s"
        return f"{v:g}/s" if unit == "cps" else f"{v:g}"
    sign = "≤" if thresholds[0].upper else "≥"
    if thresholds[0].slo_class:
        what = "class targets" if thresholds[0].upper else "class objectives"
        return what + " " + ", ".join(f"{t.slo_class} {sign} {num(t.value)}" for t in thresholds)
    if len(thresholds) == 1 and thresholds[0].upper and thresholds[0].value == 0:
        return "threshold 0: any is too many"
    return "threshold " + " / ".join(f"{sign} {num(t.value)}" for t in thresholds)


# -- panels ---------------------------------------------------------------------------

def prom(expr: str, legend: str = "", *, instant: bool = False, fmt: str = "time_series") -> dict:
    t = {"datasource": PROM, "expr": " ".join(expr.split()), "legendFormat": legend or "__auto",
         "range": not instant, "instant": instant, "format": fmt}
    return t


def _deduplicated(sql: str) -> str:
    """A read of the store, deduplicated where its tables' engine can (queries.FINAL_READ)."""
    return f"{sql.strip()} {FINAL_READ}"


def ch(sql: str, query_type: str = "table") -> dict:
    return {"datasource": CH, "editorType": "sql", "queryType": query_type,
            "format": CH_FORMATS[query_type], "rawSql": _deduplicated(sql)}


@dataclass
class Panel:
    kind: str                              # timeseries, stat, table, bargauge, barchart, heatmap
    title: str
    targets: list[dict]
    description: str = ""
    unit: str = "short"
    w: int = 8
    h: int = 8
    thresholds: list[Threshold] = field(default_factory=list)
    min: float | None = None
    max: float | None = None
    stack: bool = False
    overrides: list[dict] = field(default_factory=list)
    options: dict = field(default_factory=dict)
    custom: dict = field(default_factory=dict)
    links: list[dict] = field(default_factory=list)


def _class_overrides(thresholds: list[Threshold]) -> list[dict]:
    """Per-SLO-class thresholds: series whose legend starts with the class."""
    return [{"matcher": {"id": "byRegexp", "options": f"^{t.slo_class} .*"},
             "properties": [{"id": "thresholds", "value": threshold_steps([t])}]}
            for t in thresholds]


def _field_config(p: Panel) -> dict:
    defaults: dict = {"unit": p.unit, "color": {"mode": "palette-classic"}}
    per_class = bool(p.thresholds) and bool(p.thresholds[0].slo_class)
    if p.thresholds and not per_class:
        defaults["thresholds"] = threshold_steps(p.thresholds)
    else:
        defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": "green", "value": None}]}
    if p.min is not None:
        defaults["min"] = p.min
    if p.max is not None:
        defaults["max"] = p.max
    if p.kind in ("stat", "bargauge"):
        defaults["color"] = {"mode": "thresholds"}
    if p.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if not p.stack else 40,
            "showPoints": "never", "spanNulls": False,
            "stacking": {"mode": "normal" if p.stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": "line+area" if p.thresholds else "off"}}
    elif p.kind == "barchart":
        defaults["custom"] = {"lineWidth": 1, "fillOpacity": 80, "gradientMode": "none",
                              "thresholdsStyle": {"mode": "off"}}
    if p.custom:
        defaults.setdefault("custom", {}).update(p.custom)
    if p.links:
        defaults["links"] = p.links
    overrides = (_class_overrides(p.thresholds) if per_class else []) + p.overrides
    return {"defaults": defaults, "overrides": overrides}


def _legend_and_tooltip(calcs: list[str]) -> dict:
    return {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True, "calcs": calcs},
            "tooltip": {"mode": "multi", "sort": "desc"}}


def _options(p: Panel) -> dict:
    if p.kind == "timeseries":
        base = _legend_and_tooltip(["lastNotNull", "max"])
    elif p.kind == "barchart":
        # x: the panel's first string field (or options xField); `stack` stacks the numeric fields
        base = {"orientation": "auto", "stacking": "normal" if p.stack else "none", "showValue": "never",
                "barWidth": 0.8, "groupWidth": 0.7, "xTickLabelRotation": 0, "xTickLabelMaxLength": 0,
                "fullHighlight": False, **_legend_and_tooltip([])}
    elif p.kind == "stat":
        base = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "background", "graphMode": "area", "textMode": "auto",
                "justifyMode": "auto", "orientation": "auto"}
    elif p.kind == "bargauge":
        base = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "displayMode": "gradient", "orientation": "horizontal", "showUnfilled": True}
    elif p.kind == "table":
        base = {"showHeader": True, "cellHeight": "sm",
                "footer": {"show": False, "reducer": ["sum"], "countRows": False}}
    else:  # heatmap
        base = {"calculate": False, "cellGap": 1, "color": {"mode": "scheme", "scheme": "Oranges"},
                "yAxis": {"axisPlacement": "left", "unit": p.unit},
                "rowsFrame": {"layout": "auto"}, "tooltip": {"mode": "single", "yHistogram": True},
                "legend": {"show": True}}
    base.update(p.options)
    return base


def row(title: str) -> Panel:
    return Panel("row", title, [])


class Layout:
    """Places panels left to right on Grafana's 24-column grid."""

    def __init__(self):
        self.x = self.y = self.row_h = 0
        self.next_id = 1

    def place(self, p: Panel) -> dict:
        if p.kind == "row":
            self._newline()
            out = {"type": "row", "id": self._id(), "title": p.title, "collapsed": False,
                   "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []}
            self.y += 1
            return out
        if self.x + p.w > 24:
            self._newline()
        datasource = p.targets[0]["datasource"]
        targets = [{"refId": chr(ord("A") + i), **t} for i, t in enumerate(p.targets)]
        out = {"type": p.kind, "id": self._id(), "title": p.title, "description": p.description,
               "datasource": datasource, "targets": targets,
               "gridPos": {"h": p.h, "w": p.w, "x": self.x, "y": self.y},
               "fieldConfig": _field_config(p), "options": _options(p)}
        self.x += p.w
        self.row_h = max(self.row_h, p.h)
        return out

    def _newline(self) -> None:
        self.y += self.row_h
        self.x = self.row_h = 0

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


# -- variables and the dashboard ------------------------------------------------------

def ds_var(name: str, plugin: str, label: str) -> dict:
    return {"type": "datasource", "name": name, "label": label, "query": plugin,
            "refresh": 1, "regex": "", "hide": 0, "includeAll": False, "multi": False,
            "options": []}


def _all() -> dict:
    return {"selected": True, "text": ["All"], "value": ["$__all"]}


def prom_var(name: str, label: str, query: str) -> dict:
    """A label_values() variable; "All" is the regex .* (matchers use =~)."""
    return {"type": "query", "name": name, "label": label, "datasource": PROM,
            "query": query, "refresh": 2, "regex": "", "sort": 1, "hide": 0,
            "includeAll": True, "allValue": ".*", "multi": True, "current": _all(), "options": []}


def ch_var(name: str, label: str, sql: str) -> dict:
    """A ClickHouse variable; "All" turns $__conditionalAll(...) into 1=1."""
    return {"type": "query", "name": name, "label": label, "datasource": CH,
            "query": _deduplicated(" ".join(sql.split())), "refresh": 2, "regex": "", "sort": 1, "hide": 0,
            "includeAll": True, "multi": True, "current": _all(), "options": []}


def text_var(name: str, label: str, default: str, description: str) -> dict:
    return {"type": "textbox", "name": name, "label": label, "query": default,
            "description": description, "hide": 0,
            "current": {"text": default, "value": default}, "options": []}


def dashboard(uid: str, title: str, description: str, variables: list[dict],
              panels: list[Panel]) -> dict:
    layout = Layout()
    return {
        "id": None, "uid": uid, "title": title, "description": description,
        "tags": [TAG], "timezone": "browser", "editable": True, "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION, "version": 1, "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"}, "timepicker": {},
        "fiscalYearStartMonth": 0, "liveNow": False, "weekStart": "",
        # Grafana adds its built-in annotation query itself when the list is empty.
        "annotations": {"list": []},
        "links": [{"title": "spanlet dashboards", "type": "dashboards", "tags": [TAG],
                   "asDropdown": True, "includeVars": True, "keepTime": True,
                   "icon": "external link", "tooltip": "", "url": "", "targetBlank": False}],
        "templating": {"list": variables},
        "panels": [layout.place(p) for p in panels],
    }
