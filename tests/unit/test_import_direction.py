"""Dependencies point one way (DESIGN.md, "A module map that fits"): read from
the import statements of every module, nothing below imports anything above
it, and the client reaches nothing of the daemon."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Top to bottom; a module belongs to the first layer holding it or a package above it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("CLI", ("spanlet.cli", "spanlet.inspect", "spanlet.demo")),
    ("daemon", ("spanlet.daemon",)),
    ("pipelines", ("spanlet.pipeline",)),
    ("exporters, admin, metric engine", ("spanlet.exporters", "spanlet.admin", "spanlet.metrics",
                                         "spanlet.scheduler")),
    ("join, probes, node facts", ("spanlet.join", "spanlet.request_totals", "spanlet.probes",
                                  "spanlet.cgroups", "spanlet.cpu_throttle", "spanlet.discovery", "spanlet.k8s", "spanlet.nvml")),
    ("events, config", ("spanlet.events", "spanlet.config", "spanlet.modality", "spanlet.runtimes",
                        "spanlet.client",
                        "spanlet.batch",
                        "spanlet.bpf", "spanlet")),
]
# Upward imports that are known and on their way out (none left).
KNOWN_UPWARD: set[tuple[str, str]] = set()
# What the client (and the demo's serving processes) may reach: no daemon part.
CLIENT_SIDE = ("spanlet.client", "spanlet.batch", "spanlet.modality", "spanlet.runtimes", "spanlet.demo")


def package_dirs() -> dict[str, Path]:
    """Import package -> folder, as pyproject.toml installs them."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {pkg: ROOT / folder for pkg, folder in tool["package-dir"].items()}


def module_files() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg, folder in package_dirs().items():
        for f in folder.rglob("*.py"):
            rel = f.relative_to(folder).with_suffix("").parts
            name = ".".join([pkg, *(p for p in rel if p != "__init__")])
            if name not in out or f.name == "__init__.py":
                out[name] = f
    return out


def imports_of(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The spanlet modules one module's source imports (at any depth in it)."""
    found: set[str] = set()
    here = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here.split(".")[:len(here.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m == "spanlet" or m.startswith("spanlet.")}


def layer_of(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS: place it there")


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a module above its own layer, as 'a (layer) imports b (layer)'."""
    out = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if layer_of(dep) < layer_of(mod) and (mod, dep) not in KNOWN_UPWARD:
                out.append(f"{mod} ({LAYERS[layer_of(mod)][0]}) imports {dep} "
                           f"({LAYERS[layer_of(dep)][0]})")
    return out


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imports_of(name, f.read_text(), f.name == "__init__.py", known)
            for name, f in files.items()}


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        mod = todo.pop()
        for dep in graph.get(mod, ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_every_module_has_a_layer():
    for mod in import_graph():
        layer_of(mod)


def test_nothing_below_imports_anything_above_it():
    assert upward(import_graph()) == []


def test_the_client_reaches_nothing_of_the_daemon():
    graph = import_graph()
    for start in [m for m in graph if m.startswith(CLIENT_SIDE)]:
        beyond = {m for m in reach(graph, start) if m != "spanlet" and not m.startswith(CLIENT_SIDE)}
        assert beyond == set(), f"{start} reaches {sorted(beyond)}"


def test_the_check_sees_an_upward_import():
    """The checker itself: the metric engine importing the daemon is caught,
    lazily inside a function and relatively too."""
    known = {"spanlet.daemon", "spanlet.metrics", "spanlet.metrics.engine", "spanlet.config"}
    for source in ("from spanlet.daemon import Daemon\n",
                   "def f():\n    import spanlet.daemon\n",
                   "from .. import daemon\n"):
        graph = {"spanlet.metrics.engine": imports_of("spanlet.metrics.engine", source, False, known)}
        assert upward(graph) == ["spanlet.metrics.engine (exporters, admin, metric engine) imports "
                                 "spanlet.daemon (daemon)"], source
    ok = imports_of("spanlet.metrics.engine", "from spanlet import config\n", False, known)
    assert upward({"spanlet.metrics.engine": ok}) == []
