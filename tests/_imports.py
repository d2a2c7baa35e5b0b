"""The package's import graph, read from the source (lazy imports included, ``if TYPE_CHECKING:``
blocks excluded): shared by the architecture test and the planner's purity test."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src"
PKG = "resilient_strategy"


def modules() -> dict[str, Path]:
    out = {}
    for f in (SRC / PKG).rglob("*.py"):
        parts = f.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _typing_only(tree: ast.AST) -> set[int]:
    return {
        id(x) for n in ast.walk(tree)
        if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"
        for x in ast.walk(n)
    }


def imports(module: str, path: Path) -> tuple[set[str], set[str]]:
    """(our modules it imports, the other top-level names it imports)."""
    mods = modules()
    tree = ast.parse(path.read_text())
    skip = _typing_only(tree)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    ours: set[str] = set()
    others: set[str] = set()
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        names: list[str] = []
        if isinstance(n, ast.ImportFrom):
            base = ".".join(package[: len(package) - (n.level - 1)]) if n.level else ""
            mod = ".".join(x for x in (base, n.module or "") if x)
            names = [f"{mod}.{a.name}" for a in n.names]
            if n.module:
                names.append(mod)
        elif isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        for t in names:
            if t in mods:
                if t not in (module, PKG):
                    ours.add(t)
            elif not t.startswith(PKG):
                others.add(t.split(".")[0])
    return ours, others


def edges() -> dict[str, set[str]]:
    return {m: imports(m, f)[0] for m, f in modules().items()}
