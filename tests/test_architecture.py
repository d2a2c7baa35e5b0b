"""The package's import graph: no cycle (lazy imports included), and nothing outside the testing
kit imports the kit, and the rooms of the house import only downwards (ARCHITECTURE.md)."""

from __future__ import annotations

import functools

from _imports import PKG, edges


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
    ("errors", "vocab"),
    ("core", "core.values"),
    ("core.knowledge",),
    ("core.measures",),
    ("core.trace", "core.call"),
    ("core.planning",),
    ("machine", "records"),
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
