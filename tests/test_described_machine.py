"""The described machine is one typed value, `DescribedMachine`: its fields are exactly the keys
a machine case's ``"machine"`` object may hold, each documented; `machine()` and the
``--simulate`` loader build the same value, so a JSON case and a keyword call agree."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from resilient_strategy.errors import InvalidOptionError, ResilientStrategyError
from resilient_strategy.testing import machine
from resilient_strategy.testing.simulation import MACHINE_KEYS, DescribedMachine, load_simulation

ROOT = Path(__file__).parents[1]
CASE_DIRS = (ROOT / "examples" / "machines", ROOT / "tests" / "fixtures")


def _machine_objects() -> list[tuple[Path, dict[str, Any]]]:
    """Every ``"machine"`` object of the JSON machine cases (examples and fixtures)."""
    out = []
    for folder in CASE_DIRS:
        for path in sorted(folder.rglob("*.json")):
            data = json.loads(path.read_text())
            if isinstance(data, dict) and isinstance(data.get("machine"), dict):
                out.append((path, data["machine"]))
    return out


def test_the_fields_are_the_keys_of_machine_cases() -> None:
    objects = _machine_objects()
    assert len(objects) >= 100
    used = {key for _, described in objects for key in described}
    fields = {f.name for f in dataclasses.fields(DescribedMachine) if f.init}
    assert set(MACHINE_KEYS) == fields
    assert used <= fields, sorted(used - fields)
    # the keyword arguments of machine() are the fields, with the same defaults
    assert machine() == DescribedMachine().facts()


def test_every_field_is_documented() -> None:
    guide = (ROOT / "docs" / "how-to" / "testing-kit.md").read_text()
    section = guide[guide.index("## Described machines from the command line"):]
    listed = set(re.findall(r"`(\w+)`", section))
    in_docstring = set(re.findall(r"``(\w+)", DescribedMachine.__doc__ or ""))
    assert set(MACHINE_KEYS) <= listed, sorted(set(MACHINE_KEYS) - listed)
    assert set(MACHINE_KEYS) <= in_docstring, sorted(set(MACHINE_KEYS) - in_docstring)
    reference = (ROOT / "docs" / "reference" / "testing.md").read_text()
    assert "::: resilient_strategy.testing.simulation.DescribedMachine" in reference


@pytest.mark.parametrize("path", [p for p, _ in _machine_objects()][::7],
                         ids=lambda p: p.stem)
def test_a_case_and_its_keyword_call_agree(path: Path) -> None:
    described = json.loads(path.read_text())["machine"]
    value = DescribedMachine.from_mapping(described)
    assert value.facts() == machine(**described)
    if "midrun" not in path.parent.name:  # a mid-run case is replayed, not --simulate'd
        assert value.facts() == load_simulation(path)[0]
    assert dataclasses.replace(value) == value and value.facts() == value.facts()


def test_a_described_machine_is_frozen_and_checked_when_made() -> None:
    value = DescribedMachine(4, nvlink=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.nvlink = 0  # type: ignore[misc]
    with pytest.raises(InvalidOptionError):
        DescribedMachine(2, cc="9.0")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        machine(2, nvlinks=4)


@pytest.mark.parametrize("described", [
    {"gpus": 2, "nvlinks": 4},  # a key that is not a field
    {"nvlink": 4},  # no gpus
    {"gpus": 2, "cc": "9.0"},  # a wrong type
    [2],  # not an object
])
def test_a_wrong_machine_object_is_one_typed_error(described: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        DescribedMachine.from_mapping(described)
    path = tmp_path / "case.json"
    path.write_text(json.dumps({"machine": described}))
    with pytest.raises(ResilientStrategyError):
        load_simulation(path)
