"""The package's import graph: no cycle (lazy imports included), and nothing outside the testing
kit imports the kit."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src"
PKG = "resilient_strategy"


def _modules() -> dict[str, Path]:
    out = {}
    for f in (SRC / PKG).rglob("*.py"):
        parts = f.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Every import of one of our modules, wherever it is written (functions too), except
    ``if TYPE_CHECKING:`` blocks, which never run."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        tree = ast.parse(f.read_text())
        typing_only = {
            id(x) for n in ast.walk(tree)
            if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"
            for x in ast.walk(n)
        }
        package = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
        for n in ast.walk(tree):
            if id(n) in typing_only:
                continue
            names: list[str] = []
            if isinstance(n, ast.ImportFrom):
                base = ".".join(package[: len(package) - (n.level - 1)]) if n.level else ""
                module = ".".join(x for x in (base, n.module or "") if x)
                names = [f"{module}.{a.name}" for a in n.names]
                if n.module:
                    names.append(module)
            elif isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            edges[m] |= {t for t in names if t in mods and t != m and t != PKG}
    return edges


def test_import_graph_has_no_cycle() -> None:
    edges = _edges(_modules())
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(u: str, path: list[str]) -> None:
        state[u] = 1
        for v in sorted(edges[u]):
            if state.get(v) == 1:
                cycles.append([*path[path.index(v):], v])
            elif v not in state:
                visit(v, [*path, v])
        state[u] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_only_the_testing_kit_imports_the_testing_kit() -> None:
    edges = _edges(_modules())
    kit = f"{PKG}.testing"
    users = sorted(m for m, ts in edges.items()
                   if not m.startswith(kit) and any(t.startswith(kit) for t in ts))
    assert users == []


def test_the_graph_is_read() -> None:
    edges = _edges(_modules())
    assert f"{PKG}.options" in edges[f"{PKG}.executor"]
    assert f"{PKG}.simulation" in edges[f"{PKG}.cli"]
