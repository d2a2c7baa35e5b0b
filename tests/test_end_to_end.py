"""resilient_strategy() with real probe processes on this CPU machine, as rank 0 of a 2-process
torchrun launch: gloo between the processes is proven for real and chosen; when it hangs, the
runner sees it from the ranks' progress and cuts the probe, and one process trains with the global batch kept by accumulation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from resilient_strategy import resilient_strategy
from resilient_strategy.testing import machine

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.torch]


def run(tmp_path: Path, **env: str):  # type: ignore[no-untyped-def]
    facts = machine(0, torch="2.13.0", torch_cuda=None, torch_nccl=None, env={"WORLD_SIZE": "2"})
    base = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
            "MASTER_PORT": str(os.getpid()), **env}
    return resilient_strategy(facts=facts, env=base, framework="torch", global_batch_size=64,
                              gradient_bytes=100_000, sample_seconds=0.01, timeout=15,
                              cache_dir=tmp_path)


def test_gloo_between_processes_is_proven_for_real(tmp_path: Path) -> None:
    sel = run(tmp_path)
    assert sel.backend == "gloo" and sel.num_replicas == 2 and sel.per_replica_batch_size == 32
    res = sel.results[sel.candidate.key]
    assert res.ok and res.ranks == 2 and res.bus_bandwidth_gbps and res.step_seconds
    assert "its probe passed" in sel.explain()


def test_a_hang_is_cut_from_progress_and_one_process_trains(tmp_path: Path) -> None:
    sel = run(tmp_path, RESILIENT_STRATEGY_PROBE_FAULT="hang:1:gloo")
    res = sel.results["torch:gloo:cpu"]
    assert res.status == "timeout" and res.elapsed_s < 15  # judged a hang before the deadline
    assert dict(res.extra)["hang"] == "straggler"
    assert sel.backend == "cpu" and sel.accumulation_steps == 2 and sel.per_replica_batch_size == 32
    assert not sel.active or sel.launch.rank == 0
    assert "judged from its ranks' progress" in sel.explain()
