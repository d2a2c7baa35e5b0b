"""`resilient-strategy run` and memory planning (issue 24): `--sharding` / `--offload` validated
once and handed to the workers, whose script must agree; FSDP over a subset of the GPUs that is
not the first ones launches exactly that many workers, bound to exactly those GPUs. Decisions
are made on described machines (simulated probes); the workers' side re-plans from the handed
file as a real worker does, and the worker wrapper is run for real on what it sets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

from resilient_strategy.core.call.options import RunOptions
from resilient_strategy.core.measures.probe import OK, ProbeResult
from resilient_strategy.core.trace.event import Note
from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.records import handoff
from resilient_strategy.run import supervisor
from resilient_strategy.testing import gpu, machine, simulate
from resilient_strategy.testing.simulation import SimulatedProber

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
A100 = "NVIDIA A100-SXM4-40GB"
#: FSDP over the four GPUs fails (NCCL, its remedies, gloo); over the two freest it works.
OUTCOMES = {"nccl/fsdp": "error:nccl_error", "nccl/fsdp+*": "error:nccl_error",
            "gloo/fsdp": "timeout"}


@pytest.fixture(autouse=True)
def _fresh_worker_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handoff, "WORKER", handoff.WorkerState())


def _gpus(free: dict[int, float]) -> list[Any]:
    return [gpu(i, A100, (8, 0), 40, free_gb=f) for i, f in free.items()]


def _facts(free: dict[int, float], env: dict[str, str] | None = None) -> Any:
    return machine(_gpus(free), nvlink=12, host_memory_gb=24, torch="2.13.0", env=env)


def _no_probe(spec: object, env: object) -> ProbeResult:
    raise AssertionError("a worker of `resilient-strategy run` must not probe")


def _decide(tmp: Path, monkeypatch: pytest.MonkeyPatch, facts: Any, env: dict[str, str],
            outcomes: dict[str, str], *flags: str) -> handoff.HandedDecision:
    """The supervisor's decision for `run --nproc-per-node N [flags] script` on ``facts``."""
    from resilient_strategy.run.cmdline import options_from_args

    monkeypatch.setattr(supervisor, "_prober", SimulatedProber(outcomes))
    opts = options_from_args(["--nproc-per-node", str(len(facts.gpus)), "--global-batch-size",
                              "96", "--param-bytes", str(8 * GIB), *flags,
                              str(ROOT / "examples" / "torch_fsdp_train.py")])
    env = {"RESILIENT_STRATEGY_CACHE": "0", **env}
    choice = supervisor._decide(opts, facts, env, {}, tmp, 0, ())
    loaded = handoff.HandedDecision.from_dict(json.loads((tmp / "attempt0" / "decision.json").read_text()))
    assert loaded == choice.decision  # what the workers read is what was decided
    return loaded


def _worker(tmp: Path, decision: handoff.HandedDecision, free: dict[int, float], rank: int = 0,
            user_visible: str | None = None, **kwargs: Any) -> Any:
    """One worker of the decision: its environment as the wrapper leaves it (the binding
    applied over the user's own), its facts as CUDA shows them there."""
    path = tmp / "handed.json"
    handoff.write_decision(path, decision)
    base = {} if user_visible is None else {"CUDA_VISIBLE_DEVICES": user_visible}
    env = {**base, handoff.DECISION_VAR: str(path), "RESILIENT_STRATEGY_CACHE": "0",
           "WORLD_SIZE": str(decision.processes), "LOCAL_WORLD_SIZE": str(decision.processes),
           "RANK": str(rank), "LOCAL_RANK": str(rank)}
    env.update(handoff.bound_env(env, handoff.WorkerState()))
    facts = _facts(free, env)
    kwargs.setdefault("param_bytes", 8 * GIB)
    return simulate(
        framework="torch", global_batch_size=96, facts=facts, env=env, outcomes=_no_probe,
        **{"cache": True, **kwargs})


def _notes(sel: Any, topic: str) -> list[str]:
    return [e.message for e in sel.plan.events if isinstance(e, Note) and e.topic == topic]


def test_fsdp_on_the_freest_gpus_binds_its_workers_to_them(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # GPUs 1 and 3 have the most free memory: the subset is not the first two GPUs
    free = {0: 14, 1: 30, 2: 14, 3: 30}
    d = _decide(tmp_path, monkeypatch, _facts(free), {},
                {**OUTCOMES, "nccl/fsdp@1,3": "ok"})
    assert (d.chosen, d.processes, d.devices) == ("torch:nccl/fsdp:1,3", 2, (1, 3))
    assert d.worker_env() == {"CUDA_VISIBLE_DEVICES": "GPU-fake-0001,GPU-fake-0003"}
    assert (d.sharding, d.offload, d.flags) == ("auto", "none", ())
    # rank 1 inspects its GPUs later, after its peer started CUDA there (less free than the
    # supervisor saw, too little for FSDP over two): it plans with the handed figures
    assert d.free_bytes == tuple(int(f * GIB) for f in free.values())
    for rank, now in ((0, free), (1, {0: 14, 1: 20, 2: 14, 3: 20})):
        sel = _worker(tmp_path, d, now, rank)
        # the worker trains exactly the handed candidate, in its own numbering, on GPUs 1 and 3
        assert (sel.backend, sel.sharded, sel.devices, sel.num_replicas) == ("nccl", True,
                                                                             (0, 1), 2)
        assert (sel.per_replica_batch_size, sel.accumulation_steps) == (24, 2)
        assert [g.physical_index for g in sel.facts.gpus] == [1, 3]
        assert len(_notes(sel, "bound_devices")) == 1
        assert sel.progress is not None
        sel.progress.writer.close()


def test_a_subset_of_the_first_gpus_is_not_bound(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    free = {0: 30, 1: 30, 2: 14, 3: 14}
    d = _decide(tmp_path, monkeypatch, _facts(free), {},
                {**OUTCOMES, "nccl/fsdp@0,1": "ok"})
    assert (d.chosen, d.processes, d.devices, d.worker_env()) == (
        "torch:nccl/fsdp:0,1", 2, (), {})
    sel = _worker(tmp_path, d, free)
    assert (sel.devices, sel.sharded, _notes(sel, "bound_devices")) == ((0, 1), True, [])
    assert sel.progress is not None
    sel.progress.writer.close()


def test_the_users_visible_devices_are_mapped_within_their_list(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 8 GPUs; the user shows the job 6,4,2,0 (its GPUs 0..3); physical 4 and 0 are the freest,
    # its GPUs 1 and 3: the workers get the user's own entries for them, in their order
    free = {i: 14.0 for i in range(8)} | {4: 30.0, 0: 30.0}
    user = {"CUDA_VISIBLE_DEVICES": "6,4,2,0"}
    facts = _facts(free, user)
    d = _decide(tmp_path, monkeypatch, facts, user, {**OUTCOMES, "nccl/fsdp@1,3": "ok"})
    assert (d.chosen, d.devices, d.visible_devices) == ("torch:nccl/fsdp:1,3", (1, 3), "4,0")
    sel = _worker(tmp_path, d, free, user_visible="6,4,2,0")
    assert [g.physical_index for g in sel.facts.gpus] == [4, 0]
    assert (sel.devices, sel.sharded, sel.num_replicas) == ((0, 1), True, 2)
    assert sel.progress is not None
    sel.progress.writer.close()


def test_renumbering_keeps_the_results_about_the_bound_gpus_only() -> None:
    results = {k: ProbeResult(k, OK, 1.0) for k in (
        "torch:nccl/fsdp:1,3", "torch:nccl/fsdp:0,1,2,3", "torch:nccl/fsdp:1,3:NCCL_P2P_DISABLE=1",
        "torch:cpu:cpu")}
    d = handoff.HandedDecision(framework="torch", chosen="torch:nccl/fsdp:1,3", results=results,
                         run_dir="x", devices=(1, 3), visible_devices="1,3")
    mine = d.renumbered()
    assert mine.chosen == "torch:nccl/fsdp:0,1"
    assert sorted(mine.results) == ["torch:cpu:cpu", "torch:nccl/fsdp:0,1",
                                    "torch:nccl/fsdp:0,1:NCCL_P2P_DISABLE=1"]
    assert all(r.candidate == k for k, r in mine.results.items())


CPU_RESULTS = {"torch:gloo/fsdp:cpu": ProbeResult("torch:gloo/fsdp:cpu", OK, 1.0, ranks=2),
               "torch:gloo:cpu": ProbeResult("torch:gloo:cpu", OK, 1.0, ranks=2)}


def _cpu_worker(tmp: Path, chosen: str, handed: tuple[str, str], flags: tuple[str, ...],
                **script: Any) -> Any:
    """Rank 0 of 2 CPU processes on a decision planned with ``handed`` (sharding, offload)."""
    d = handoff.HandedDecision(framework="torch", chosen=chosen, results=CPU_RESULTS,
                         run_dir=str(tmp), processes=2, sharding=handed[0], offload=handed[1],
                         flags=flags)
    path = tmp / f"decision{len(list(tmp.glob('decision*.json')))}.json"  # one per decision
    handoff.write_decision(path, d)
    env = {handoff.DECISION_VAR: str(path), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "RANK": "0", "LOCAL_RANK": "0", "RESILIENT_STRATEGY_CACHE": "0"}
    sel = simulate(
        framework="torch", facts=machine(0, torch="2.13.0"), env=env, outcomes=_no_probe,
        **script, cache=True)
    assert sel.progress is not None
    sel.progress.writer.close()
    return sel


def test_the_script_takes_the_flags_value_over_its_default_and_says_so(tmp_path: Path) -> None:
    sel = _cpu_worker(tmp_path, "torch:gloo/fsdp:cpu", ("full", "none"), ("--sharding full",))
    assert sel.sharded and len(_notes(sel, "handed_memory")) == 1
    sel = _cpu_worker(tmp_path, "torch:gloo/fsdp:cpu", ("full", "auto"),
                      ("--sharding full", "--offload auto"), sharding="full")
    assert sel.sharded and len(_notes(sel, "handed_memory")) == 1  # offload's; sharding agreed
    sel = _cpu_worker(tmp_path, "torch:gloo:cpu", ("auto", "none"), ())
    assert not sel.sharded and _notes(sel, "handed_memory") == []


@pytest.mark.parametrize(("handed", "flags", "script", "option"), [
    (("full", "none"), ("--sharding full",), {"sharding": "none"}, "sharding"),
    (("auto", "none"), (), {"sharding": "full"}, "sharding"),  # --sharding not given
    (("auto", "none"), (), {"offload": "auto"}, "offload"),
    (("full", "auto"), ("--sharding full", "--offload auto"), {"sharding": "none"}, "sharding"),
])
def test_a_script_that_disagrees_with_the_supervisor_is_an_error_naming_the_option(
        tmp_path: Path, handed: tuple[str, str], flags: tuple[str, ...], script: dict[str, str],
        option: str) -> None:
    chosen = "torch:gloo/fsdp:cpu" if handed[0] == "full" else "torch:gloo:cpu"
    with pytest.raises(InvalidOptionError) as err:
        _cpu_worker(tmp_path, chosen, handed, flags, **script)
    assert err.value.option == option


def test_run_memory_flags_are_validated_once_naming_the_flag() -> None:
    from resilient_strategy.run.cmdline import options_from_args

    script = str(ROOT / "examples" / "torch_fsdp_train.py")
    opts = options_from_args(["--nproc-per-node", "2", script])
    assert (opts.sharding, opts.offload) == (None, None)  # not given: planned as the defaults
    assert (opts.planned_sharding, opts.planned_offload) == ("auto", "none")
    opts = options_from_args(["--nproc-per-node", "2", "--offload", "auto", script])
    planned, _ = supervisor._options(opts, machine(0, torch="2.13.0"), {})
    assert (planned.sharding, planned.offload) == ("auto", "auto")
    for kwargs, flag in (({"offload": "auto", "sharding": "none"}, "--offload"),
                         ({"offload": "always"}, "--offload"),
                         ({"sharding": "half"}, "--sharding"),
                         ({"offload": "auto", "framework": "tensorflow"}, "--offload"),
                         ({"sharding": "full", "framework": "tensorflow"}, "--sharding")):
        with pytest.raises(InvalidOptionError) as err:
            RunOptions(script=script, **kwargs)
        assert err.value.option == flag
    with pytest.raises(InvalidOptionError, match="always"):  # a mode it does not know: one line
        options_from_args(["--offload", "always", script])


SHOW_ENV = "import json, os; print(json.dumps({'visible': os.environ.get('CUDA_VISIBLE_DEVICES')}))"


@pytest.mark.parametrize(("devices", "visible", "user", "expected"), [
    ((1, 3), "GPU-a,GPU-b", None, "GPU-a,GPU-b"),
    ((), "", "5,7", "5,7"),  # not bound: the user's own value, untouched
    ((), "", None, None),
])
def test_the_worker_wrapper_binds_the_script_before_it_runs(
        tmp_path: Path, devices: tuple[int, ...], visible: str, user: str | None,
        expected: str | None) -> None:
    d = handoff.HandedDecision(framework="torch", chosen="torch:nccl/fsdp:1,3", results={},
                         run_dir=str(tmp_path), devices=devices, visible_devices=visible)
    handoff.write_decision(tmp_path / "decision.json", d)
    script = tmp_path / "show.py"
    script.write_text(SHOW_ENV)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update({"PYTHONPATH": str(ROOT / "src"), "LOCAL_RANK": "0"})
    if user is not None:
        env["CUDA_VISIBLE_DEVICES"] = user
    out = subprocess.run(
        [sys.executable, "-m", "resilient_strategy.run.worker", "--supervisor", str(os.getpid()),
         str(tmp_path / "decision.json"), str(script)],
        env=env, capture_output=True, text=True, timeout=deadline(60))
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"visible": expected}


def _run_example(tmp: Path, *run_args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "RESILIENT_STRATEGY_CACHE_DIR": str(tmp / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node", "2",
         "--evidence-dir", str(tmp / "evidence"), *run_args,
         str(ROOT / "examples" / "torch_fsdp_train.py"), "--samples", "2048", "--epochs", "1"],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=deadline(300))


@pytest.mark.slow
@pytest.mark.torch
def test_run_trains_fsdp_as_its_flag_says_and_refuses_a_script_that_disagrees(
        tmp_path: Path) -> None:
    """The example passes sharding='full': under `run --sharding full` its 2 gloo workers train
    FSDP2 (8 optimizer steps of 256); without the flag the supervisor planned 'auto', and the
    workers stop at resilient_strategy() with the option error (a user error, not relaunched)."""
    pytest.importorskip("torch")
    from resilient_strategy.run.exitcodes import ExitCode

    ok = _run_example(tmp_path, "--sharding", "full")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "optimizer steps: 8" in ok.stdout
    refused = _run_example(tmp_path)
    assert refused.returncode == int(ExitCode.USER_ERROR), refused.stderr[-3000:]
    attempts = json.loads(next((tmp_path / "evidence").glob("**/attempts.json")).read_text())
    assert [a["verdict"]["kind"] for a in attempts["attempts"]] == ["user"]


def test_other_model_figures_in_the_script_train_the_handed_decision_and_say_so(
        tmp_path: Path) -> None:
    """The supervisor planned without the model's size (no --param-bytes) and chose DDP; the
    script's own figures would shard: the handed candidate trains, with a note naming it."""
    results = {"torch:nccl:0,1": ProbeResult("torch:nccl:0,1", OK, 1.0, ranks=2)}
    d = handoff.HandedDecision(framework="torch", chosen="torch:nccl:0,1", results=results,
                         run_dir=str(tmp_path), processes=2, sharding="auto", offload="none")
    sel = _worker(tmp_path, d, {0: 30, 1: 30})
    assert (sel.backend, sel.sharded, sel.devices) == ("nccl", False, (0, 1))
    assert len(_notes(sel, "handed_memory")) == 1
    assert sel.progress is not None
    sel.progress.writer.close()
