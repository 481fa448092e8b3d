"""The queries of spanlet's Grafana dashboards (grafana/dashboards/*.json) with
Grafana's variables and the ClickHouse plugin's macros expanded, ready to run
on a real Prometheus or ClickHouse/chdb (tests/unit/test_grafana.py, end-to-end runs).

Expansion rules, the way Grafana would expand them on a dashboard left at its
defaults (every "All" variable at All, every text box at its default):

PromQL
- $__rate_interval -> `rate_interval` (default 1m: Grafana's
  max($__interval + scrape interval, 4 x scrape interval) for a 15 s scrape
  interval), $__interval -> `interval` (15s), $__interval_ms, $__range ->
  `range_` (1h), $__range_s, $__range_ms.
- A template variable ($v, ${v}, ${v:format}, [[v]]) -> its allValue (".*" on
  every spanlet variable; the matchers use =~) when it has "All", else its
  default (text box, constant). A variable with neither is an error.
- Variable queries: label_values(selector, label) -> the selector, so that the
  check is "the variable has values"; query_result(q) -> q; label_values(label)
  and metrics(...) name no series and are left out.

ClickHouse (grafana-clickhouse-datasource), in the order the plugin applies them
- Frontend: $__conditionalAll(condition, $v) -> 1=1 while $v is at All, else
  the condition (src/data/CHDatasource.ts applyConditionalAll; documented in
  docs/sources/query-editor.md, "Macros").
- Grafana's template variables: ${v:sqlstring} -> the value quoted '...' with
  ' doubled (Grafana's sqlstring format), $v / ${v} -> the raw value;
  ${__value.raw} of a data link -> `trace_id` (links are left out without one).
- Backend macros, exactly as pkg/macros/macros.go writes them (from/to are the
  time range, truncated to whole seconds or milliseconds like Go's Unix()/UnixMilli()):
  $__timeFilter(c)    -> c >= toDateTime(<from s>) AND c <= toDateTime(<to s>)
  $__timeFilter_ms(c) -> c >= fromUnixTimestamp64Milli(<from ms>) AND c <= fromUnixTimestamp64Milli(<to ms>)
  $__fromTime / $__toTime -> toDateTime(<s>); $__fromTime_ms / $__toTime_ms -> fromUnixTimestamp64Milli(<ms>)
  $__dateFilter(c)    -> c >= toDate('YYYY-MM-DD') AND c <= toDate('YYYY-MM-DD') (UTC)
  $__timeInterval(c)  -> toStartOfInterval(toDateTime(c), INTERVAL <interval_s> second)
  $__timeInterval_ms(c) -> toStartOfInterval(toDateTime64(c, 3), INTERVAL <ms> millisecond)
  $__interval_s       -> <interval_s>
  with the plugin's argument syntax: `$__name(args)`, args up to the first ')'.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "grafana" / "dashboards"
CLICKHOUSE = "grafana-clickhouse-datasource"
ALL = "$__all"

_VAR = re.compile(r"\$\{(\w+)(?::(\w+))?\}|\$(\w+)|\[\[(\w+)(?::(\w+))?\]\]")
_PROM_BUILTINS = ("rate_interval", "interval_ms", "interval", "range_ms", "range_s", "range")


# -- dashboards ----------------------------------------------------------------------

def dashboards() -> list[tuple[Path, dict]]:
    """(path, JSON) of every dashboard file, sorted by name."""
    return [(p, json.loads(p.read_text())) for p in sorted(DASHBOARDS.glob("*.json"))]


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel that is not a row, rows' nested panels included."""
    for p in dashboard.get("panels", []):
        if p.get("type") == "row":
            yield from (q for q in p.get("panels", []) if q.get("type") != "row")
        else:
            yield p


def variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}


def datasource_type(target: dict, panel: dict) -> str:
    return (target.get("datasource") or panel.get("datasource") or {}).get("type", "")


def _is_all(var: dict) -> bool:
    current = var.get("current", {}).get("value")
    return ALL in current if isinstance(current, list) else current == ALL


def _default(var: dict, name: str) -> str | list[str]:
    """The value a variable has on a dashboard left at its defaults (or as
    `select()` set it: a list of values)."""
    if var.get("includeAll") and _is_all(var):
        if var.get("allValue") is None:
            raise ValueError(f"variable {name} is at All without an allValue")
        return var["allValue"]
    if var["type"] in ("textbox", "constant"):
        return var.get("query", "")
    current = var.get("current", {}).get("value")
    if isinstance(current, (str, list)):
        return current
    raise ValueError(f"variable {name} has no default value")


def select(dashboard: dict, selected: dict[str, list[str]] | None) -> dict:
    """A copy of the dashboard with these variables set to these values (not All)."""
    if not selected:
        return dashboard
    out = json.loads(json.dumps(dashboard))
    for v in out.get("templating", {}).get("list", []):
        if v["name"] in selected:
            v["current"] = {"text": list(selected[v["name"]]), "value": list(selected[v["name"]])}
    return out


def _referenced(text: str, dashboard: dict, fixed: dict[str, str] | None = None) -> dict[str, str]:
    """Default values of the dashboard variables the text names."""
    vs, out = variables(dashboard), dict(fixed or {})
    for m in _VAR.finditer(text):
        name = m.group(1) or m.group(3) or m.group(4)
        if name in vs and name not in out and vs[name]["type"] != "datasource":
            out[name] = _default(vs[name], name)
    return out


def _substitute(text: str, values: dict[str, str], formats: dict | None = None) -> str:
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(3) or m.group(4)
        fmt = m.group(2) or m.group(5) or ""
        if name not in values:
            return m.group(0)
        value = values[name]
        if isinstance(value, str):
            value = [value]
        return ",".join((formats or {}).get(fmt, lambda v: v)(v) for v in value)
    return _VAR.sub(one, text)


# -- PromQL --------------------------------------------------------------------------

def expand_promql(expr: str, dashboard: dict, *, rate_interval: str = "1m", interval: str = "15s",
                  range_: str = "1h") -> str:
    """One PromQL expression as Prometheus gets it from Grafana (rules above)."""
    builtins = {"rate_interval": rate_interval, "interval": interval,
                "interval_ms": str(_seconds(interval) * 1000), "range": range_,
                "range_s": str(_seconds(range_)), "range_ms": str(_seconds(range_) * 1000)}
    out = re.sub(r"\$__(" + "|".join(_PROM_BUILTINS) + r")\b",
                 lambda m: builtins[m.group(1)], expr)
    out = _substitute(out, _referenced(out, dashboard))
    if "$" in out or "[[" in out:
        raise ValueError(f"unexpanded variable in {out!r}")
    return out


def _seconds(duration: str) -> int:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    m = re.fullmatch(r"(\d+)(ms|s|m|h|d|w)", duration)
    if not m:
        raise ValueError(f"not a Prometheus duration: {duration!r}")
    return int(int(m.group(1)) * units[m.group(2)])


def variable_selector(query: str) -> str | None:
    """The series a Prometheus variable query reads; None for those without."""
    q = query if isinstance(query, str) else query.get("query", "")
    m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", q, re.S)
    if m:
        return m.group(1)
    m = re.fullmatch(r"\s*query_result\((.*)\)\s*", q, re.S)
    return m.group(1) if m else None


def prometheus_queries(**expand) -> list[tuple[str, str, str]]:
    """(dashboard title, panel title, expanded PromQL) of every Prometheus
    target and every Prometheus variable query ("variable <name>")."""
    out = []
    for _, d in dashboards():
        title = d["title"]
        for name, v in variables(d).items():
            if v["type"] == "query" and v["datasource"]["type"] == "prometheus":
                sel = variable_selector(v["query"])
                if sel is not None:
                    out.append((title, f"variable {name}", expand_promql(sel, d, **expand)))
        for p in panels(d):
            for t in p.get("targets", []):
                if datasource_type(t, p) == "prometheus":
                    out.append((title, p["title"], expand_promql(t["expr"], d, **expand)))
    return out


# -- ClickHouse ------------------------------------------------------------------------

def sqlstring(value: str) -> str:
    """Grafana's sqlstring format of one value."""
    return "'" + value.replace("'", "''") + "'"


def _macro_args(sql: str, open_paren: int) -> tuple[list[str], int]:
    """Top-level comma-separated arguments of the call whose '(' is at open_paren,
    and the index after its ')'."""
    depth, args, start = 0, [], open_paren + 1
    for i in range(open_paren, len(sql)):
        c = sql[i]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                args.append(sql[start:i])
                return [a.strip() for a in args], i + 1
        elif c == "," and depth == 1:
            args.append(sql[start:i])
            start = i + 1
    raise ValueError(f"unbalanced $__conditionalAll in {sql!r}")


def conditional_all(sql: str, dashboard: dict) -> str:
    """The plugin's frontend macro: 1=1 for a variable at All, else the condition."""
    macro = "$__conditionalAll("
    while (i := sql.rfind(macro)) != -1:
        args, end = _macro_args(sql, i + len(macro) - 1)
        if len(args) != 2:
            raise ValueError(f"$__conditionalAll needs 2 arguments: {sql[i:end]!r}")
        name = re.search(r"(?<=\$\{)\w+(?=\})|(?<=\$)\w+", args[1]).group(0)
        var = variables(dashboard)[name]
        sql = sql[:i] + ("1=1" if _is_all(var) else args[0]) + sql[end:]
    return sql


def plugin_macros(sql: str, since_ns: int, until_ns: int, interval_s: int) -> str:
    """The backend macros of pkg/macros/macros.go (rules in the module doc)."""
    frm_s, to_s = since_ns // 10**9, until_ns // 10**9
    frm_ms, to_ms = since_ns // 10**6, until_ns // 10**6
    day = lambda s: time.strftime("%Y-%m-%d", time.gmtime(s))  # noqa: E731
    secs = max(int(interval_s), 1)
    macros = {
        "timeFilter_ms": lambda c: f"{c} >= fromUnixTimestamp64Milli({frm_ms}) AND {c} <= "
                                   f"fromUnixTimestamp64Milli({to_ms})",
        "timeFilter": lambda c: f"{c} >= toDateTime({frm_s}) AND {c} <= toDateTime({to_s})",
        "dateFilter": lambda c: f"{c} >= toDate('{day(frm_s)}') AND {c} <= toDate('{day(to_s)}')",
        "timeInterval_ms": lambda c: f"toStartOfInterval(toDateTime64({c}, 3), INTERVAL "
                                     f"{secs * 1000} millisecond)",
        "timeInterval": lambda c: f"toStartOfInterval(toDateTime({c}), INTERVAL {secs} second)",
        "fromTime_ms": lambda: f"fromUnixTimestamp64Milli({frm_ms})",
        "toTime_ms": lambda: f"fromUnixTimestamp64Milli({to_ms})",
        "fromTime": lambda: f"toDateTime({frm_s})",
        "toTime": lambda: f"toDateTime({to_s})",
        "interval_s": lambda: str(secs),
    }
    # Longest names first, so that $__timeFilter never eats $__timeFilter_ms.
    for name in sorted(macros, key=len, reverse=True):
        fn = macros[name]
        pattern = re.compile(r"\$__" + name + (r"\((.*?)\)" if fn.__code__.co_argcount else r"\b"))
        sql = pattern.sub(lambda m, fn=fn: fn(*[a.strip() for a in m.groups()]), sql)
    return sql


def expand_sql(sql: str, dashboard: dict, *, database: str, since_ns: int, until_ns: int,
               interval_s: int, value: str | None = None,
               selected: dict[str, list[str]] | None = None) -> str:
    """One ClickHouse query as the store gets it from Grafana (rules above);
    `selected` sets variables to values instead of All (sqlstring: 'a','b')."""
    dashboard = select(dashboard, selected)
    sql = conditional_all(sql, dashboard)
    if value is not None:
        sql = sql.replace("${__value.raw}", value)
    sql = _substitute(sql, _referenced(sql, dashboard, {"database": database}),
                      {"sqlstring": sqlstring})
    sql = plugin_macros(sql, since_ns, until_ns, interval_s)
    if "$" in sql:
        raise ValueError(f"unexpanded variable or macro in {sql!r}")
    return sql


def link_queries(panel: dict) -> list[tuple[str, str]]:
    """(link title, rawSql) of every ClickHouse query a panel's data links run."""
    out = []
    fc = panel.get("fieldConfig", {})
    props = [p for o in fc.get("overrides", []) for p in o.get("properties", [])]
    links = list(fc.get("defaults", {}).get("links", []))
    links += [lk for p in props if p["id"] == "links" for lk in p["value"]]
    for link in links:
        url = link.get("url", "")
        if "panes=" not in url:
            continue
        state = json.loads(url.split("panes=", 1)[1])
        for pane in state.values():
            for q in pane.get("queries", []):
                if q.get("datasource", {}).get("type") == CLICKHOUSE:
                    out.append((link["title"], q["rawSql"]))
    return out


def clickhouse_queries(database: str = "spanlet", since_ns: int | None = None,
                       until_ns: int | None = None, *, interval_s: int = 60,
                       trace_id: str | None = None,
                       selected: dict[str, list[str]] | None = None) -> list[tuple[str, str, str]]:
    """(dashboard title, panel title, expanded SQL) of every ClickHouse target,
    every ClickHouse variable query ("variable <name>") and, given a trace id,
    every ClickHouse query a data link runs ("<panel> / link: <title>").
    Time range: [since_ns, until_ns], default the last hour. Variables at All
    unless `selected` names values for them."""
    until_ns = time.time_ns() if until_ns is None else until_ns
    since_ns = until_ns - 3600 * 10**9 if since_ns is None else since_ns
    kw = dict(database=database, since_ns=since_ns, until_ns=until_ns, interval_s=interval_s,
              selected=selected)
    out, seen_links = [], set()
    for _, d in dashboards():
        title = d["title"]
        for name, v in variables(d).items():
            if v["type"] == "query" and v["datasource"]["type"] == CLICKHOUSE:
                out.append((title, f"variable {name}", expand_sql(v["query"], d, **kw)))
        for p in panels(d):
            for t in p.get("targets", []):
                if datasource_type(t, p) == CLICKHOUSE:
                    out.append((title, p["title"], expand_sql(t["rawSql"], d, **kw)))
            if trace_id is None:
                continue
            for link_title, sql in link_queries(p):
                if (title, link_title, sql) in seen_links:
                    continue
                seen_links.add((title, link_title, sql))
                out.append((title, f"{p['title']} / link: {link_title}",
                            expand_sql(sql, d, value=trace_id, **kw)))
    return out
