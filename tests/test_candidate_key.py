"""Candidate keys as values (`core/values/candidate.CandidateKey`): parse and format round-trip
exactly, and the sharded keys (``nccl/fsdp``) are read right end to end: NCCL's flight recorder
is on for FSDP over NCCL, and an FSDP probe failure is cached."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resilient_strategy.core.call.options import RunOptions
from resilient_strategy.core.values.candidate import Candidate, CandidateKey
from resilient_strategy.deciding.cache import DecisionCache, last_resort
from resilient_strategy.records import flight
from resilient_strategy.records.handoff import HandedDecision, renumber_key
from resilient_strategy.run.agent import worker_env
from resilient_strategy.testing import machine, simulate
from resilient_strategy.vocab import BACKENDS, FRAMEWORKS

_NAME = st.text(st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZ_0123456789"), min_size=1,
                max_size=12)
_VALUE = st.text(st.characters(codec="ascii", exclude_characters=";\n\r"), max_size=12)
KEYS = st.builds(
    CandidateKey, st.sampled_from(FRAMEWORKS), st.sampled_from(BACKENDS),
    st.lists(st.integers(0, 64), max_size=8).map(tuple),
    st.lists(st.tuples(_NAME, _VALUE), max_size=3).map(tuple),
    st.booleans(), st.booleans(), st.booleans())


@given(KEYS)
def test_format_then_parse_is_the_same_key(key: CandidateKey) -> None:
    text = key.format()
    assert CandidateKey.parse(text) == key
    assert CandidateKey.parse(text).format() == text


@pytest.mark.parametrize(("text", "backend", "sharded", "offload", "node_local", "devices"), [
    ("torch:nccl:0,1", "nccl", False, False, False, (0, 1)),
    ("torch:nccl/fsdp:0,1", "nccl", True, False, False, (0, 1)),
    ("torch:gloo/fsdp+offload:2,3", "gloo", True, True, False, (2, 3)),
    ("torch:single_device/fsdp+offload:0", "single_device", True, True, False, (0,)),
    ("torch:nccl/node0:0,1", "nccl", False, False, True, (0, 1)),
    ("torch:cpu:cpu", "cpu", False, False, False, ()),
])
def test_the_marks_are_not_the_backend(text: str, backend: str, sharded: bool, offload: bool,
                                       node_local: bool, devices: tuple[int, ...]) -> None:
    key = CandidateKey.parse(text)
    assert (key.backend, key.sharded, key.offload, key.node_local, key.devices) == (
        backend, sharded, offload, node_local, devices)
    assert key.format() == text


def test_an_env_value_may_hold_a_colon() -> None:
    key = CandidateKey.parse("torch:nccl:0,1:NCCL_IB_HCA=mlx5_0:1;NCCL_P2P_DISABLE=1")
    assert key.env == (("NCCL_IB_HCA", "mlx5_0:1"), ("NCCL_P2P_DISABLE", "1"))


@pytest.mark.parametrize("text", ["", "torch", "torch:nccl", "torch::0", "torch:nccl:a,b",
                                  "torch:nccl:01", "torch:nccl:0:NOEQUALS", "torch:/fsdp:0"])
def test_what_is_not_a_key(text: str) -> None:
    assert CandidateKey.read(text) is None
    with pytest.raises(ValueError):
        CandidateKey.parse(text)


def test_a_candidate_key_is_its_identity_formatted() -> None:
    c = Candidate("torch", "nccl", (0, 1), (("NCCL_P2P_DISABLE", "1"),), sharded=True,
                  offload=True)
    assert c.key == "torch:nccl/fsdp+offload:0,1:NCCL_P2P_DISABLE=1"
    assert CandidateKey.parse(c.key) == c.identity


def test_a_sharded_key_is_renumbered_with_its_marks() -> None:
    assert renumber_key("torch:nccl/fsdp:1,3", (1, 3)) == "torch:nccl/fsdp:0,1"
    assert renumber_key("torch:nccl/fsdp:1,2", (1, 3)) is None
    assert renumber_key("torch:cpu:cpu", (1, 3)) == "torch:cpu:cpu"


def test_fsdp_over_a_collective_is_not_a_last_resort() -> None:
    assert [last_resort(k) for k in ("torch:nccl/fsdp:0,1", "torch:gloo/fsdp+offload:0,1",
                                     "torch:single_device/fsdp:0", "torch:cpu:cpu")] == [
        False, False, True, True]


def _handed(chosen: str) -> HandedDecision:
    return HandedDecision(framework="torch", chosen=chosen, results={}, run_dir="/nonexistent")


@pytest.mark.parametrize(("chosen", "recorder"), [
    ("torch:nccl:0,1", True), ("torch:nccl/fsdp:0,1", True),
    ("torch:nccl/fsdp+offload:0,1", True), ("torch:gloo/fsdp:0,1", False),
])
def test_the_flight_recorder_is_on_for_fsdp_over_nccl(chosen: str, recorder: bool) -> None:
    env = worker_env(_handed(chosen), RunOptions("train.py"), 60.0, {}, "2.7.1")
    assert (flight.BUFFER_VAR in env) == recorder
    # never over the user's own
    assert flight.BUFFER_VAR not in worker_env(_handed(chosen), RunOptions("train.py"), 60.0,
                                               {flight.BUFFER_VAR: "0"}, "2.7.1")


def test_an_fsdp_probe_failure_is_cached(tmp_path: Path) -> None:
    facts = machine(2)
    sel = simulate(facts, {"nccl/fsdp": "error:nccl_error"}, framework="torch",
                   global_batch_size=64, env={**facts.env_map, "WORLD_SIZE": "2"},
                   sharding="full", cache=True, cache_dir=tmp_path)
    assert sel.sharded and sel.candidate.key != "torch:nccl/fsdp:0,1"  # a remedy trains
    cached = DecisionCache(tmp_path).load(facts.fingerprint())
    failed = cached["torch:nccl/fsdp:0,1"]
    assert not failed.ok and failed.cause == "nccl_error"
