"""Generates daemonset/prometheusrule.yaml (the prometheus-operator object)
from daemonset/prometheus-rules.yaml, the source of truth for the alert rules.

    .venv/bin/python scripts/prometheusrule.py           # rewrite the file
    .venv/bin/python scripts/prometheusrule.py --check   # exit 1 if it differs
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "daemonset" / "prometheus-rules.yaml"
PROMRULE = ROOT / "daemonset" / "prometheusrule.yaml"


def render_prometheusrule() -> str:
    """prometheusrule.yaml: the groups of prometheus-rules.yaml, unchanged."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    obj = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
           "metadata": {"name": "spanlet", "namespace": "spanlet",
                        "labels": {"app.kubernetes.io/name": "spanlet", "release": "prometheus"}},
           "spec": {"groups": groups}}

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, s):
        style = "|" if "\n" in s else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", s, style=style)

    Dumper.add_representer(str, text)
    head = ("# GENERATED from daemonset/prometheus-rules.yaml (the source of truth; edit that\n"
            "# file, then run: .venv/bin/python scripts/prometheusrule.py).\n"
            "# tests/unit/test_daemonset.py fails when the two differ.\n")
    return head + yaml.dump(obj, Dumper=Dumper, sort_keys=False, width=1000, allow_unicode=True)


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        if PROMRULE.read_text() != render_prometheusrule():
            print(f"{PROMRULE} differs from {RULES}: run {sys.argv[0]}", file=sys.stderr)
            return 1
        return 0
    if argv:
        print(f"usage: {sys.argv[0]} [--check]", file=sys.stderr)
        return 2
    PROMRULE.write_text(render_prometheusrule())
    print(f"wrote {PROMRULE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
