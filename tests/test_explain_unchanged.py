"""The issue-8 refactor (options, cost model, structured trace) changed no decision and no line of
``explain()`` for any machine case, but for the wording fixes the fixture lists one by one.

The fixture was recorded from the code before the refactor (commit e3f0d0b) with
``tests/fixtures/record_machine_cases.py``; its ``wording_fixes`` name each deliberate change
(issue 13's wording items) and the lines it replaces."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

from record_machine_cases import MACHINES, record_case  # noqa: E402

RECORDED = json.loads((FIXTURES / "machine_cases_e3f0d0b.json").read_text(encoding="utf-8"))


def _expected(case: str, framework: str, field: str, before: list[str]) -> list[str]:
    """The recorded lines with every documented fix of this case and field applied."""
    out = list(before)
    fixes = [f for f in RECORDED["wording_fixes"]
             if (f["case"], f["framework"], f["field"]) == (case, framework, field)]
    for f in sorted(fixes, key=lambda f: f.get("at", 0), reverse=True):
        at = f.get("at", 0)
        assert out[at:at + len(f["before"])] == f["before"], f
        out[at:at + len(f["before"])] = f["after"]
    return out


def test_every_fix_is_named() -> None:
    assert all(f["fix"] and f["fix"] != "TODO" for f in RECORDED["wording_fixes"])
    assert RECORDED["cases"]


def test_decisions_and_explanations_are_unchanged_but_for_the_listed_fixes() -> None:
    for case, frameworks in RECORDED["cases"].items():
        now = record_case(MACHINES / case)
        assert set(now) == set(frameworks), case
        for fw, before in frameworks.items():
            got: dict[str, Any] = dict(now[fw]["decision"])
            want: dict[str, Any] = dict(before["decision"])
            assert got.pop("warnings") == _expected(case, fw, "warnings", want.pop("warnings"))
            assert got == want, case
            assert now[fw]["explain"] == _expected(case, fw, "explain", before["explain"]), case
