"""ARCHITECTURE.md's value paths stay true: for ``--stall-timeout`` and ``timeout``, every
``module.function`` step named on its line exists in that module (read from the source, no
import: a step under ``run/`` would import torch)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "resilient_strategy"
VALUES = ("--stall-timeout", "timeout")


def value_path(value: str) -> list[str]:
    """The steps of ``value``'s line in ARCHITECTURE.md: the first backquoted name of each
    ``->`` segment after the colon."""
    lines = [ln for ln in (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8").splitlines()
             if ln.startswith(f"- `{value}`: ")]
    assert len(lines) == 1, f"one line for {value}"
    steps = []
    for segment in lines[0].split(": ", 1)[1].split(" -> "):
        match = re.match(r"\s*`([\w.]+)`", segment)
        assert match, segment
        steps.append(match.group(1))
    return steps


def defined(dotted: str) -> bool:
    """Whether ``dotted`` (``package.module.function`` or ``...module.Class.method``) is
    defined in a module under src/resilient_strategy."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        path = SRC.joinpath(*parts[:cut]).with_suffix(".py")
        if path.is_file():
            break
    else:
        return False
    body: list[ast.stmt] = ast.parse(path.read_text(encoding="utf-8")).body
    for name in parts[cut:]:
        found = [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.ClassDef)) and n.name == name]
        if not found:
            return False
        body = found[0].body
    return True


def test_every_step_of_each_value_path_exists() -> None:
    missing = {v: [s for s in value_path(v) if not defined(s)] for v in VALUES}
    assert missing == {v: [] for v in VALUES}
    assert all(len(value_path(v)) >= 4 for v in VALUES)


def test_a_step_that_does_not_exist_is_seen() -> None:
    assert defined("run.watch.TrainingWatch.poll")
    assert not defined("run.watch.TrainingWatch.no_such_method")
    assert not defined("run.no_such_module.f")
