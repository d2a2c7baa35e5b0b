"""resilient_strategy() with real probe processes on this CPU machine, as rank 0 of a 2-process
torchrun launch: gloo between the processes is proven for real and chosen; when it hangs, the
runner sees it from the ranks' progress and cuts the probe, and one process trains with the global batch kept by accumulation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from resilient_strategy import resilient_strategy
from resilient_strategy.core.trace.choosing import Chosen
from resilient_strategy.core.trace.ruling import CandidateRuledOut
from resilient_strategy.testing import machine

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.torch]


def run(tmp_path: Path, rank: int = 0, **env: str):  # type: ignore[no-untyped-def]
    facts = machine(0, torch="2.13.0", torch_cuda=None, torch_nccl=None, env={"WORLD_SIZE": "2"})
    base = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank),
            "MASTER_PORT": str(os.getpid()), **env}
    return resilient_strategy(facts=facts, env=base, framework="torch", global_batch_size=64,
                              gradient_bytes=100_000, sample_seconds=0.01, timeout=15,
                              cache_dir=tmp_path)


def test_gloo_between_processes_is_proven_for_real(tmp_path: Path) -> None:
    sel = run(tmp_path)
    assert sel.backend == "gloo" and sel.num_replicas == 2 and sel.per_replica_batch_size == 32
    res = sel.results[sel.candidate.key]
    assert res.ok and res.ranks == 2 and res.bus_bandwidth_gbps and res.step_seconds
    chosen = [e for e in sel.plan.events if isinstance(e, Chosen)]
    assert [(e.how, e.result) for e in chosen] == [("probe_passed", res)]


def test_a_hang_is_cut_from_progress_and_one_process_trains(tmp_path: Path) -> None:
    sel = run(tmp_path, RESILIENT_STRATEGY_PROBE_FAULT="hang:1:gloo")
    res = sel.results["torch:gloo:cpu"]
    assert res.status == "timeout"
    assert dict(res.extra)["hang"] == "straggler"  # judged a hang from progress, not the deadline
    assert sel.backend == "cpu" and sel.accumulation_steps == 2 and sel.per_replica_batch_size == 32
    out = [e for e in sel.plan.events if isinstance(e, CandidateRuledOut)]
    assert [(e.candidate.key, e.by, e.result) for e in out] == [("torch:gloo:cpu", "probe", res)]
    # rank 0 trains alone; rank 1 follows rank 0's published results and stays idle
    assert sel.active and sel.launch.rank == 0
    follower = run(tmp_path, rank=1, RESILIENT_STRATEGY_PROBE_FAULT="hang:1:gloo")
    assert follower.candidate == sel.candidate and follower.launch.rank == 1
    assert not follower.active
