"""The package layering of ``docs/architecture.md`` holds: no upward import, no import
between packages of one layer, no package cycle.

The layer order is read from the fenced ``layers`` block of ``docs/architecture.md``
(top line first; ``|`` separates independent packages of one layer), so the page and
the test cannot disagree. Every ``import`` counts: at module level, inside functions
(lazy) and under ``TYPE_CHECKING`` alike.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "qwengyre"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


@dataclass(frozen=True)
class Edge:
    """``module`` (in package ``source``) imports ``target`` (in package ``dest``)."""

    source: str
    dest: str
    module: str
    target: str


def read_layers(text: str) -> list[list[str]]:
    """The layers of the page's ```` ```layers ```` block, top first."""
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    if block is None:
        raise AssertionError(f"{ARCHITECTURE} has no ```layers block")
    layers = []
    for line in block.group(1).splitlines():
        line = line.split("#")[0].strip()
        if line:
            layers.append([name.strip() for name in line.split("|")])
    return layers


def _package(module: str) -> str:
    """``qwengyre.a.b`` -> ``a``; the root package itself is ``qwengyre``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(src: Path, name: str) -> bool:
    return (src / name / "__init__.py").exists() or (src / f"{name}.py").exists()


def import_edges(src: Path) -> list[Edge]:
    """Every import from one package of ``src`` into another (``src``: the package dir)."""
    edges = []
    for path in sorted(src.rglob("*.py")):
        module = _module_name(path, src)
        package_parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package_parts[: len(package_parts) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                # `from qwengyre import training` names a package; `import __version__`, the root.
                targets = [
                    f"{base}.{alias.name}"
                    if base == src.name and _exists(src, alias.name)
                    else base
                    for alias in node.names
                ]
            for target in targets:
                if target.split(".")[0] != src.name:
                    continue
                source, dest = _package(module), _package(target)
                if source != dest and dest != src.name:
                    edges.append(Edge(source, dest, module, target))
    return edges


def violations(edges: Iterable[Edge], layers: list[list[str]]) -> list[str]:
    """Each edge that points up or sideways, or names a package the layers omit."""
    level = {name: depth for depth, layer in enumerate(layers) for name in layer}
    found = []
    for edge in edges:
        missing = [p for p in (edge.source, edge.dest) if p not in level]
        if missing:
            found.append(f"{edge.module}: package {missing[0]!r} is in no layer")
        elif level[edge.dest] <= level[edge.source]:
            how = "sideways" if level[edge.dest] == level[edge.source] else "upward"
            found.append(
                f"{edge.module} imports {edge.target} ({how}: {edge.source} -> {edge.dest})"
            )
    return sorted(set(found))


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_graph(edges: Iterable[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.dest)
    return graph


def test_every_import_follows_the_documented_layers():
    layers = read_layers(ARCHITECTURE.read_text())
    assert violations(import_edges(SRC), layers) == []


def test_no_package_cycle():
    assert cycles(package_graph(import_edges(SRC))) == []


def test_every_package_has_a_layer():
    layers = {name for layer in read_layers(ARCHITECTURE.read_text()) for name in layer}
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"}
    assert packages | modules | {"qwengyre"} == layers


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        # Edges the layering once had: each must be caught again if it comes back.
        ("training/trainer.py", "from qwengyre.cluster.weights import WeightsBoard", "upward"),
        ("rollout/harness.py", "from qwengyre.runtime.lock import lock_run_dir", "upward"),
        ("sim/measured.py", "from qwengyre.report.html import summarize", "upward"),
        ("config.py", "from qwengyre.sim.search import fastest", "upward"),
        ("proxy/server.py", "from qwengyre import cluster", "upward"),
        ("rollout/tasks.py", "    from .. import proxy", "sideways"),
    ],
)
def test_a_forbidden_edge_is_caught(tmp_path: Path, module: str, line: str, expected: str):
    tree = tmp_path / "qwengyre"
    for path in SRC.rglob("*.py"):
        copy = tree / path.relative_to(SRC)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
    target = tree / module
    body = f"def _late() -> None:\n{line if line.startswith(' ') else '    ' + line}\n"
    target.write_text(target.read_text() + "\n\n" + body)
    layers = read_layers(ARCHITECTURE.read_text())
    before = violations(import_edges(SRC), layers)
    found = [v for v in violations(import_edges(tree), layers) if v not in before]
    assert len(found) == 1 and f"({expected}:" in found[0], found


def test_a_cycle_is_found():
    graph = {"cluster": {"training", "engines"}, "training": {"cluster"}, "engines": set()}
    assert cycles(graph) == [["cluster", "training"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
