"""The decision `resilient-strategy run` hands to its workers: applied in the worker without a
probe, refused when the script asks for something it cannot train on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import deadline

from resilient_strategy.core.measures.probe import OK, ProbeResult
from resilient_strategy.errors import InvalidOptionError, ResilientStrategyError
from resilient_strategy.records import handoff
from resilient_strategy.testing import machine, simulate

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_worker_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reporter and the loaded decision are per process: give each test its own."""
    monkeypatch.setattr(handoff, "WORKER", handoff.WorkerState())


def _no_probe(spec: object, env: object) -> ProbeResult:
    raise AssertionError("a worker of `resilient-strategy run` must not probe")


def _decision(tmp: Path, chosen: str, framework: str = "torch",
              global_batch_size: int | None = None) -> Path:
    results = {"torch:gloo:cpu": ProbeResult("torch:gloo:cpu", OK, 1.0, ranks=2)}
    d = handoff.HandedDecision(framework=framework, chosen=chosen, results=results, run_dir=str(tmp),
                         attempt=1, notes=("Relaunched: NCCL failed mid-run at step 20.",),
                         label="x", processes=1, global_batch_size=global_batch_size)
    path = tmp / "decision.json"
    handoff.write_decision(path, d)
    assert handoff.HandedDecision.from_dict(json.loads(path.read_text())) == d
    return path


def test_a_handed_decision_is_applied_without_probing(tmp_path: Path) -> None:
    facts = machine(0, torch="2.13.0")
    env = {handoff.DECISION_VAR: str(_decision(tmp_path, "torch:cpu:cpu"))}
    sel = simulate(
        framework="torch", global_batch_size=64, facts=facts, env=env, outcomes=_no_probe, cache=True)
    assert (sel.backend, sel.num_replicas, sel.global_batch_size) == ("cpu", 1, 64)
    assert any("resilient-strategy run" in line for line in sel.plan.trace)
    assert any(line.startswith("Relaunched:") for line in sel.plan.trace)
    assert sel.progress is not None and sel.progress.collective is False
    sel.progress.writer.close()


def test_the_handoff_is_the_one_source_of_the_global_batch(tmp_path: Path) -> None:
    """Under `run --global-batch-size 64` the worker trains 64 whether the script passes it or
    not; a script that passes another value gets an error naming the option."""
    facts = machine(0, torch="2.13.0")
    env = {handoff.DECISION_VAR: str(_decision(tmp_path, "torch:cpu:cpu", global_batch_size=64))}
    for script_value in (None, 64):
        sel = simulate(
            framework="torch", global_batch_size=script_value, facts=facts, env=env,
            outcomes=_no_probe, cache=True)
        assert sel.global_batch_size == 64
        assert sel.progress is not None
        sel.progress.writer.close()
    with pytest.raises(InvalidOptionError) as err:
        simulate(framework="torch", global_batch_size=32,
                                              facts=facts, env=env, outcomes=_no_probe, cache=True)
    assert err.value.option == "global_batch_size"


@pytest.mark.parametrize(("reference", "global_batch", "per", "acc"), [
    (2, 256, 128, 2),  # issue 23.5: the relaunch's trace said `cpu 1x256x1`, it trained 1x128x2
    (4, 96, 24, 4),
    (3, 6, 2, 3),
    (4, None, None, 4),  # no global batch: the one device accumulates as many steps as replicas
])
def test_a_relaunch_on_fewer_replicas_says_the_split_it_trains(
        tmp_path: Path, reference: int, global_batch: int | None, per: int | None,
        acc: int) -> None:
    """The supervisor planned ``reference`` replicas and steps down to one process: the
    worker's own launch is one process, yet its trace (the batch-split event), its ranked
    candidates and its Selection all carry the split it trains, the one of the supervisor's
    plan (the job's per-device batch, accumulating)."""
    results = {"torch:gloo:cpu": ProbeResult("torch:gloo:cpu", OK, 1.0, ranks=reference)}
    d = handoff.HandedDecision(framework="torch", chosen="torch:cpu:cpu", results=results,
                         run_dir=str(tmp_path), attempt=1, label="CPU", processes=1,
                         reference_replicas=reference)
    handoff.write_decision(tmp_path / "decision.json", d)
    sel = simulate(
        framework="torch", global_batch_size=global_batch, facts=machine(0, torch="2.13.0"),
        env={handoff.DECISION_VAR: str(tmp_path / "decision.json")}, outcomes=_no_probe, cache=True)
    assert sel.progress is not None
    sel.progress.writer.close()
    trains = (sel.num_replicas, sel.per_replica_batch_size, sel.accumulation_steps)
    assert trains == (1, per, acc)
    if global_batch is not None:
        assert per == global_batch // reference  # the per-device batch of the wider plan
    data = sel.to_dict()
    said = [(s["replicas"], s["per_replica_batch"], s["accumulation_steps"])
            for e in data["events"] if e["kind"] == "batch_split"
            for s in e["splits"] if s["backend"] == "cpu"]
    assert said in ([trains], [])  # no batch-split event without a global batch
    assert (global_batch is None) == (said == [])
    [ranked] = [c for c in data["candidates"] if c["key"] == sel.candidate.key]
    assert (ranked["num_replicas"], ranked["per_replica_batch_size"],
            ranked["accumulation_steps"]) == trains
    assert sel.plan.reference_replicas == reference


def test_a_decision_the_script_cannot_train_on_is_an_error(tmp_path: Path) -> None:
    facts = machine(0, torch="2.13.0")
    env = {handoff.DECISION_VAR: str(_decision(tmp_path, "torch:nccl:0,1"))}
    with pytest.raises(ResilientStrategyError):
        simulate(framework="torch", facts=facts, env=env,
                                              outcomes=_no_probe, cache=True)
    env = {handoff.DECISION_VAR: str(tmp_path / "missing.json")}
    with pytest.raises(ResilientStrategyError):
        simulate(framework="torch", facts=facts, env=env,
                                              outcomes=_no_probe, cache=True)


def test_run_command_line_errors(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "resilient_strategy", "run", *args],
                              capture_output=True, text=True, timeout=deadline(120),
                              env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})

    pytest.importorskip("torch")
    assert run("--help").returncode == 0
    assert run(str(tmp_path / "missing.py")).returncode == 2
    assert run("--stall-timeout", "-1", str(ROOT / "examples" / "torch_train.py")).returncode == 2
