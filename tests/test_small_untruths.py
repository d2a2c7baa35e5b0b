"""Issue 47's small untruths in the messages: a misspelt framework gets the closest one, a
batch no device takes is said, and no time is printed for a model of unknown size."""

from __future__ import annotations

import re

import pytest

import resilient_strategy
from resilient_strategy.cli import _selection_text
from resilient_strategy.deciding.notices import PLAUSIBLE_DEVICE_BATCH
from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.testing import machine, simulate


@pytest.mark.parametrize(("typed", "near"), [("torh", "torch"), ("TORCH", "torch"),
                                             ("tensorflwo", "tensorflow"), ("jax", None)])
def test_a_misspelt_framework_is_offered_the_closest_one(typed: str, near: str | None) -> None:
    with pytest.raises(InvalidOptionError) as raised:
        resilient_strategy.resilient_strategy(framework=typed, global_batch_size=8, dry_run=True)
    assert (raised.value.option, raised.value.suggestion) == ("framework", near)


def _notes(sel: resilient_strategy.Selection, topic: str) -> list[str]:
    return [e.message for e in sel.plan.events if e.kind == "note" and e.topic == topic]


def test_a_batch_no_device_takes_is_said() -> None:
    huge = simulate(machine(0), framework="torch", global_batch_size=10**9)
    assert huge.per_replica_batch_size is not None
    assert huge.per_replica_batch_size > PLAUSIBLE_DEVICE_BATCH
    said = _notes(huge, "batch_implausible")
    assert len(said) == 1 and said[0] in huge.plan.warnings
    assert _notes(simulate(machine(0), framework="torch", global_batch_size=256),
                  "batch_implausible") == []


_FIGURE = re.compile(r"~\d")  # an estimated time on a candidate's line (human_duration)


def _candidate_lines(sel: resilient_strategy.Selection) -> list[str]:
    lines = _selection_text(sel, False)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Candidates"))
    return [ln for ln in lines[start + 1:] if re.match(r" [ *]\d+\. ", ln)]


def test_no_time_is_printed_for_a_model_of_unknown_size() -> None:
    facts = machine(2)
    unknown = _candidate_lines(simulate(facts, {"*": "ok"}, framework="torch",
                                        global_batch_size=256, dry_run=True))
    sized = _candidate_lines(simulate(facts, {"*": "ok"}, framework="torch",
                                      global_batch_size=256, gradient_bytes=400_000_000,
                                      dry_run=True))
    assert unknown and not any(_FIGURE.search(ln) for ln in unknown)
    assert sized and all(_FIGURE.search(ln) for ln in sized)
