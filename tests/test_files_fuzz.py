"""Hypothesis fuzz of every file parser: cache, agreement, rules, machine files, probe reports.

Whatever the bytes, each parser answers with data or one of the package's typed errors
(ResilientStrategyError and its subclasses); the cache answers with data only (its problems are
logged degrades). Inputs: arbitrary bytes, arbitrary JSON values, and valid files with one part
replaced by an arbitrary value (the shape a half-right or hostile file has).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient_strategy.core.knowledge.rules import parse_rules
from resilient_strategy.core.measures.probe import (
    CAUSES,
    ProbeResult,
    ProbeSpec,
    WorkerOutcome,
    parse_probe,
)
from resilient_strategy.deciding.cache import DecisionCache
from resilient_strategy.errors import ResilientStrategyError
from resilient_strategy.nodes.onenode import Agreement
from resilient_strategy.testing.simulation import load_simulation

FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=20,
)
deep = st.integers(min_value=60, max_value=3000).map(
    lambda n: ("[" * n + "]" * n).encode())
raw_bytes = st.one_of(st.binary(max_size=300), deep,
                      json_values.map(lambda v: json.dumps(v).encode()))


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a part of a JSON value (the root included)."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replaced(value[head], rest, new)}
    copy = list(value)
    copy[head] = _replaced(copy[head], rest, new)
    return copy


def mutations(valid: Any) -> st.SearchStrategy[bytes]:
    """``valid`` with one part (or one key's value) replaced by an arbitrary JSON value."""
    paths = _paths(valid)
    return st.tuples(st.sampled_from(paths), json_values).map(
        lambda pn: json.dumps(_replaced(valid, pn[0], pn[1])).encode())


OK_RESULT = ProbeResult("torch:nccl:0,1", "ok", 8.1, bus_bandwidth_gbps=301.5, ranks=2)
BAD_RESULT = ProbeResult("torch:gloo:0,1", "timeout", 30.0, "timeout", "ranks [1] did not finish")


def _valid_cache() -> dict[str, Any]:
    return {"version": 1, "fingerprint": "fp", "results": {
        r.candidate: {"at": 5.0, "seen": 2, "result": r.to_dict()} for r in (OK_RESULT, BAD_RESULT)}}


def _valid_agreement() -> dict[str, Any]:
    return {"chosen": OK_RESULT.candidate, "from_cache": False, "proven": True,
            "published_at": 10.0, "results": {OK_RESULT.candidate: OK_RESULT.to_dict()}}


def _fresh(tmp_path: Path) -> Path:
    """tmp_path emptied (hypothesis runs every example in the one test's tmp_path)."""
    d = tmp_path / "d"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(mode=0o700)
    return d


# ----- cache: data only, never an exception ---------------------------------------------------
@FUZZ
@given(st.one_of(raw_bytes, mutations(_valid_cache())))
def test_cache_file_fuzz_degrades_never_raises(tmp_path: Path, content: bytes) -> None:
    cache = DecisionCache(_fresh(tmp_path))
    cache.path("fp").write_bytes(content)
    got = cache.load("fp", now=6.0)
    assert all(isinstance(r, ProbeResult) and r.candidate == k for k, r in got.items())
    assert cache.store("fp", {OK_RESULT.candidate: OK_RESULT}, now=7.0)
    assert cache.load("fp", now=8.0)[OK_RESULT.candidate] == OK_RESULT


# ----- agreement: the payload, or a typed error -----------------------------------------------
@FUZZ
@given(st.one_of(raw_bytes, mutations(_valid_agreement())))
def test_agreement_file_fuzz_raises_only_typed_errors(tmp_path: Path, content: bytes) -> None:
    ag = Agreement(_fresh(tmp_path) / "agree.json")
    ag.path.write_bytes(content)
    try:
        payload = ag.wait(0.0, poll_s=0.0, not_before=-math.inf)
    except ResilientStrategyError:
        return
    # what a follower acts on is checked: every use in the executor is safe
    assert payload["chosen"] is None or isinstance(payload["chosen"], str)
    assert isinstance(payload["proven"], bool) and isinstance(payload["from_cache"], bool)
    for k, v in payload["results"].items():
        assert ProbeResult.from_dict(v).candidate == k


# ----- rules: Rule values, or InvalidRuleError -----------------------------------------------
rule_keys = st.sampled_from(["id", "when", "effect", "target", "env", "framework", "message",
                             "source", "first", "bogus"])


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v) if not isinstance(v, float) or math.isfinite(v) else "nan"
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string is close enough; bad escapes are fuzz too
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return '""'


toml_scalars = st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=30),
                         st.sampled_from(["veto", "prefer", "remedy", "set_env", "warn", "nccl",
                                          "torch", "gpus.count >= 2", "torch.nccl < 2.25.1",
                                          "bogus ~~ 3", "gloo"]))
toml_values = st.recursive(
    toml_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)
rule_tables = st.lists(st.dictionaries(rule_keys, toml_values, max_size=9), max_size=3).map(
    lambda tables: "".join(
        "[[rule]]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in t.items())
        for t in tables))
deep_toml = st.integers(min_value=60, max_value=3000).map(
    lambda n: "x = " + "[" * n + "]" * n)


@FUZZ
@given(st.one_of(st.text(max_size=300), rule_tables, deep_toml))
def test_rules_file_fuzz_raises_only_typed_errors(text: str) -> None:
    try:
        rules = parse_rules(text, "fuzz.toml")
    except ResilientStrategyError:
        return
    assert all(r.origin == "fuzz.toml" for r in rules)


# ----- machine files (--simulate): facts, or a typed error -----------------------------------
VALID_MACHINE = {"what": "two GPUs", "framework": "torch", "global_batch_size": 64,
                 "machine": {"n": 2, "nvlink": 18, "env": {"WORLD_SIZE": "2"}},
                 "probes": {"nccl": "timeout"}}


@FUZZ
@given(st.one_of(raw_bytes, mutations(VALID_MACHINE)))
def test_machine_file_fuzz_raises_only_typed_errors(tmp_path: Path, content: bytes) -> None:
    f = _fresh(tmp_path) / "machine.json"
    f.write_bytes(content)
    try:
        facts, data = load_simulation(f)
    except ResilientStrategyError:
        return
    assert isinstance(data, dict) and facts.fingerprint()


# ----- probe reports: a ProbeResult, never an exception ---------------------------------------
VALID_REPORT = {"status": "ok", "bus_bandwidth_gbps": 12.5, "message_bytes": 4 << 20,
                "step_seconds": 0.01, "detail": "gloo allreduce", "cause": "worker_error",
                "error": "x"}
SPEC = ProbeSpec("torch:gloo:cpu", "torch", "gloo", (), world_size=2, timeout_s=30.0)


@FUZZ
@given(st.lists(st.one_of(raw_bytes, mutations(VALID_REPORT)), min_size=1, max_size=2),
       st.lists(st.one_of(st.none(), st.integers(-9, 255)), min_size=2, max_size=2),
       st.booleans())
def test_probe_report_fuzz_never_raises(
    reports: list[bytes], codes: list[int | None], timed_out: bool
) -> None:
    outcomes = [
        WorkerOutcome(rank=i, returncode=codes[i], report=r.decode("utf-8", errors="replace"),
                      killed_by_runner=codes[i] is None)
        for i, r in enumerate(reports)
    ]
    res = parse_probe(SPEC, outcomes, 1.0, timed_out)
    assert res.candidate == SPEC.candidate and res.cause in CAUSES
    assert ProbeResult.from_dict(res.to_dict()) == res or not all(
        isinstance(x, float) and math.isfinite(x) for x in
        (res.bus_bandwidth_gbps or 0.0, res.step_seconds or 0.0))
