"""What the nodes of a job tell each other (`nodes/messages`): typed values, JSON only at the
store's edge; each survives the trip, and a message of another version is a typed error."""

from __future__ import annotations

import json
from typing import Any

import pytest

from resilient_strategy.core.measures.probe import ProbeResult, ProbeSpec
from resilient_strategy.core.values.facts import NodeFacts
from resilient_strategy.errors import MultiNodeError
from resilient_strategy.nodes.messages import (
    Ack,
    NodeDecision,
    NodeSummary,
    NodeVerdict,
    Round,
    RoundReport,
)

KEY = "torch:nccl/fsdp:0,1"
OK = ProbeResult(KEY, "ok", 2.0, bus_bandwidth_gbps=9.5, ranks=4)
SPEC = ProbeSpec(KEY, "torch", "nccl", (0, 1), world_size=4, timeout_s=10.0, sharded=True)
SUMMARY = NodeSummary(1, "h1", 2, ("H100",), "2.7.1", "12.8", "2.27.3", "ib0", "routing table",
                      NodeFacts(node=1, host="h1", gpus=2))


def _trip(value: Any) -> Any:
    """Through the store: JSON text, as `store.Channel` carries it."""
    return type(value).from_json(json.loads(json.dumps(value.to_json(), allow_nan=False)))


@pytest.mark.parametrize("value", [
    Ack(True), Ack(False, "this node sees no GPU"),
    NodeVerdict(True), NodeVerdict(False, 1, "lost", lost=True),
    RoundReport(1, OK, None, "ib0", 3.0), RoundReport(0),
    SUMMARY,
    NodeDecision(KEY, {KEY: OK}, True, False, {"1": SUMMARY}, ("agreed",)),
    NodeDecision(None, error="local rank 0 stopped"),
    Round("probe", spec=SPEC), Round("abort", why="node 0 failed"),
    Round("decision", decision=NodeDecision(KEY, {KEY: OK}, True)),
])
def test_every_message_survives_the_store(value: Any) -> None:
    assert _trip(value) == value


def test_a_message_of_another_version_is_a_typed_error() -> None:
    with pytest.raises(MultiNodeError):
        Round.from_json({"kind": "probe", "spec": {"candidate": KEY}})
    with pytest.raises(MultiNodeError):
        NodeDecision.from_json({"chosen": KEY, "results": [1, 2]})
    with pytest.raises(MultiNodeError):
        RoundReport.from_json({"node": 1, "local": {"candidate": KEY, "status": "weird"}})
    with pytest.raises(MultiNodeError):
        Ack.from_json(["ok"])


def test_unreadable_facts_are_said_not_guessed() -> None:
    got = NodeSummary.from_json({"node": 2, "facts": {"node": "one"}})
    assert got.facts is None and got.unreadable
