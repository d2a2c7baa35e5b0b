"""The package's import graph: no cycle (lazy imports included), and nothing outside the testing
kit imports the kit, and the rooms of the house import only downwards (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from _imports import PKG, SRC, edges, modules


@functools.cache
def _edges() -> dict[str, set[str]]:
    return edges()


def test_import_graph_has_no_cycle() -> None:
    edges = _edges()
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
    """The kit (pytest plugin, hypothesis strategies, fakes) is for users' tests; the one
    exception is the CLI's ``--simulate FILE``, which reads the kit's described machines."""
    edges = _edges()
    kit = f"{PKG}.testing"
    users = sorted((m, t) for m, ts in edges.items() for t in ts
                   if not m.startswith(kit) and t.startswith(kit))
    assert users == [(f"{PKG}.cli", f"{PKG}.testing.simulation")]


#: The rooms of the house, bottom first. A module may import its own folder and any room below
#: its own; nothing imports up, and rooms on one floor do not import each other. The pure core
#: is floor 1, stacked in sub-floors of its own, one folder per kind (``core.*``).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors", "vocab", "process"),
    ("core", "core.values"),
    ("core.knowledge",),
    ("core.call",),
    ("core.measures",),
    ("core.trace",),
    ("core.planning",),
    ("machine",),
    ("records",),
    ("frameworks",),
    ("probing",),
    ("selection",),
    ("nodes",),
    ("deciding",),
    ("run",),
    ("integrations",),
    ("testing",),
    ("cli",),
    ("__main__", ""),
)


def _room(module: str) -> str:
    """The folder a module stands in: its top-level one, or its sub-folder of the core."""
    parts = module.split(".")[1:]
    if parts[:1] == ["core"] and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0] if parts else ""


def _floor(room: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if room in rooms)


def test_every_module_has_a_room() -> None:
    assert {_room(m) for m in _edges()} <= {r for rooms in FLOORS for r in rooms}


def test_rooms_import_only_downwards() -> None:
    bad = sorted((m, t) for m, ts in _edges().items() for t in ts
                 if _room(m) != _room(t) and _floor(_room(t)) >= _floor(_room(m)))
    assert bad == []


def test_the_core_imports_nothing_that_touches_the_machine() -> None:
    """The pure core (facts, rules, planning, the probe parser, the trace, options) reaches no
    folder that reads hardware, files, processes or the network."""
    effects = ("machine", "records", "frameworks", "probing", "nodes", "deciding", "run")
    bad = sorted((m, t) for m, ts in _edges().items() for t in ts
                 if _room(m).split(".")[0] == "core" and _room(t) in effects)
    assert bad == []


def test_the_graph_is_read() -> None:
    edges = _edges()
    assert f"{PKG}.core.call.options" in edges[f"{PKG}.deciding.executor"]
    assert f"{PKG}.testing.simulation" in edges[f"{PKG}.cli"]


def test_no_two_modules_share_a_file_name() -> None:
    """A file's name says what it is, once: ``routes.py`` in two folders reads as one thing."""
    names: dict[str, list[str]] = {}
    for m, f in modules().items():
        if f.name != "__init__.py":
            names.setdefault(f.name, []).append(m)
    assert {n: ms for n, ms in names.items() if len(ms) > 1} == {}


_DOTTED = re.compile(r"\bresilient_strategy(?:\.[A-Za-z_]\w*)+")
_ROOMS = "core|machine|records|frameworks|probing|nodes|deciding|run|integrations|testing"
_SLASHED = re.compile(rf"(?<![\w/.-])((?:{_ROOMS})/[\w/]*\w)(\.py|\.toml)?")


def _defined(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in n.names}
    return out


def _dotted_is_real(name: str, mods: dict[str, Path]) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if module in mods:
            rest = parts[i:]
            return not rest or rest[0] in _defined(mods[module])
    return False


def _named_paths() -> list[tuple[str, str]]:
    """(where, what) for every dotted ``resilient_strategy.*`` path in src's docstrings and
    comments and in ARCHITECTURE.md, and every ``room/...`` file path in ARCHITECTURE.md."""
    mods = modules()
    bad: list[tuple[str, str]] = []
    texts = {str(f.relative_to(SRC)): f.read_text() for f in mods.values()}
    texts["ARCHITECTURE.md"] = (SRC.parent / "ARCHITECTURE.md").read_text()
    for where, text in texts.items():
        for m in _DOTTED.finditer(text):
            name = m.group(0).rstrip(".")
            if text[:m.start()].endswith('getLogger("'):  # a logger's name, not a module
                continue
            if not _dotted_is_real(name, mods):
                bad.append((where, name))
    pkg = SRC / PKG
    for m in _SLASHED.finditer(texts["ARCHITECTURE.md"]):
        path, ext = m.group(1), m.group(2) or ""
        if not ((pkg / (path + ext)).exists() or (pkg / path).is_dir()
                or (pkg / (path + ".py")).is_file()):
            bad.append(("ARCHITECTURE.md", path + ext))
    return bad


def test_every_module_named_in_src_and_architecture_exists() -> None:
    assert _named_paths() == []


def test_every_module_has_its_line_in_architecture() -> None:
    """Each folder's row of ARCHITECTURE.md's floors table names every module in it."""
    text = (SRC.parent / "ARCHITECTURE.md").read_text()
    rows = {m[1]: m[2] for m in re.finditer(r"^\| \w+ \| `([\w/]+)/` \|([^|]*)\|", text, re.M)}
    missing = sorted(
        f"{folder}/{f.stem}" for folder, row in rows.items()
        for f in (SRC / PKG / folder).glob("*.py")
        if f.stem != "__init__" and f"`{f.stem}`" not in row)
    assert rows and missing == []
    folders = {str(f.parent.relative_to(SRC / PKG)) for f in (SRC / PKG).rglob("*.py")
               if f.stem != "__init__"}
    assert folders - set(rows) - {".", "probing/workers"} == set()
