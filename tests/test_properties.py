"""Property tests for the planner and the executor loop, over generated machines and outcomes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient_strategy.core.call.options import Options
from resilient_strategy.core.knowledge.rules import load_rules
from resilient_strategy.core.planning.plan import plan
from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.testing import FakeProber, simulate
from resilient_strategy.testing.strategies import global_batches, machines, outcome_tables

RULES = load_rules()


def _framework(facts) -> str:  # type: ignore[no-untyped-def]
    return "tensorflow" if facts.framework("tensorflow").installed and not \
        facts.framework("torch").installed else "torch"


@settings(max_examples=150, deadline=None)
@given(machines(), outcome_tables(), global_batches())
def test_every_decision_terminates_keeps_the_batch_and_ends_single_device(
    facts, outcomes, g  # type: ignore[no-untyped-def]
) -> None:
    fw = _framework(facts)
    prober = FakeProber(outcomes)
    world = int(facts.env_map.get("WORLD_SIZE", "1")) if fw == "torch" else 1
    if g is not None and g % world:
        with pytest.raises(InvalidOptionError) as err:
            simulate(facts, prober, framework=fw, global_batch_size=g)
        assert err.value.option == "global_batch_size"
        return
    sel = simulate(facts, prober, framework=fw, global_batch_size=g)
    # terminates: each candidate is probed at most once
    assert len(prober.calls) == len({s.candidate for s in prober.calls}) <= 12
    # ends in a single-device option that needs no collective
    last = sel.plan.ranked[-1].candidate
    assert last.backend == "cpu" and last.num_replicas == 1
    # the global batch is exact on every candidate
    for c in sel.plan.candidates:
        if g is not None:
            assert c.num_replicas * c.per_replica_batch_size * c.accumulation_steps == g
            assert c.global_batch_size == g
    # never lies: a chosen multi-replica candidate passed its probe
    if sel.candidate.needs_probe:
        assert sel.results[sel.candidate.key].ok
    assert sel.candidate.label in sel.explain()


@settings(max_examples=100, deadline=None)
@given(machines(), outcome_tables(), st.sampled_from([None, 64, 96, 1000]))
def test_plan_is_deterministic(facts, outcomes, g) -> None:  # type: ignore[no-untyped-def]
    fw = _framework(facts)
    world = int(facts.env_map.get("WORLD_SIZE", "1")) if fw == "torch" else 1
    if g is not None and g % world:
        g = world * 8
    sel = simulate(facts, FakeProber(outcomes), framework=fw, global_batch_size=g)
    policy = Options(fw, global_batch_size=g, user_env=tuple(facts.env_map), world_size=world)
    again = [plan(facts, RULES, dict(sel.results), policy) for _ in range(2)]
    assert again[0] == again[1]
    assert again[0].chosen == sel.candidate


@settings(max_examples=100, deadline=None)
@given(machines(), outcome_tables())
def test_user_environment_is_never_overridden(facts, outcomes) -> None:  # type: ignore[no-untyped-def]
    fw = _framework(facts)
    sel = simulate(facts, FakeProber(outcomes), framework=fw)
    user = facts.env_map
    for c in sel.plan.candidates:
        assert not set(dict(c.env)) & set(user)
    assert not set(sel.env) & set(user)


@settings(max_examples=100, deadline=None)
@given(machines(), outcome_tables())
def test_the_trace_is_its_events_and_serializes(facts, outcomes) -> None:  # type: ignore[no-untyped-def]
    fw = _framework(facts)
    sel = simulate(facts, FakeProber(outcomes), framework=fw)
    data = json.loads(json.dumps(sel.to_dict()))
    events = data["events"]
    assert [e["text"] for e in events if e["text"]] == data["trace"] == list(sel.plan.trace)
    assert events[0]["kind"] == "framework_picked" and events[-1]["kind"] == "chosen"
    assert events[-1]["candidate"]["key"] == sel.candidate.key
    # every candidate a probe ruled out is an event with the probe's result
    probed_out = {e["candidate"]["key"] for e in events
                  if e["kind"] == "ruled_out" and e["by"] == "probe"}
    assert probed_out == {k for k, r in sel.results.items() if not r.ok}
