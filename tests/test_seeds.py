"""The five seed reports, as simulated machines: the library reaches the decision the report
reached, or a better one with the reason in the trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from resilient_strategy.core.trace.ruling import CandidateRuledOut, RemedyQueued, RuleFired
from resilient_strategy.testing import FakeProber, machine, simulate

MACHINES = Path(__file__).parents[1] / "examples" / "machines"


def load(name: str) -> tuple[Any, dict[str, Any]]:
    data = json.loads((MACHINES / name).read_text())
    return machine(**data["machine"]), data


def fired(sel: Any, action: str) -> list[RuleFired]:
    return [e for e in sel.plan.events if isinstance(e, RuleFired) and e.action == action]


def hangs(sel: Any) -> list[str]:
    """Candidates a probe hang ruled out, in order."""
    return [e.candidate.key for e in sel.plan.events if isinstance(e, CandidateRuledOut)
            and e.result is not None and e.result.status == "timeout"]


def run(name: str, **kw: Any) -> tuple[Any, FakeProber]:
    facts, data = load(name)
    prober = FakeProber(data.get("probes", {}))
    for key in ("gradient_bytes", "sample_seconds"):
        if key in data:
            kw.setdefault(key, data[key])
    sel = simulate(facts, prober, framework=data["framework"],
                   global_batch_size=data["global_batch_size"], **kw)
    return sel, prober


def test_seed000_rtx5090_tf215_gets_hierarchical_copy_without_crashing_first() -> None:
    sel, prober = run("seed000_rtx5090_tf215.json")
    assert sel.backend == "hierarchical_copy"
    assert sel.num_replicas == 2 and sel.per_replica_batch_size == 64
    assert sel.batch_size == 128  # what to pass to model.fit
    # NCCL was ruled out by rule, never probed: no fit crash to wait for
    assert prober.probed == ["hierarchical_copy"]
    vetoes = [(e.rule, [c.backend for c in e.candidates]) for e in fired(sel, "veto")]
    assert vetoes == [("tf-nccl-before-blackwell", ["nccl"])]
    assert [e.rule for e in fired(sel, "warn")] == ["tf-ptx-jit-only"]  # the 30-minute JIT


def test_seed001_sagemaker_hang_falls_back_to_one_gpu_with_accumulation_x4() -> None:
    # issue 41: only a measured compute (here sample_seconds=: a 25M-parameter MLP's sample,
    # ~20 us on a V100) ranks one GPU above gloo across the four; a model's size alone does not
    sel, prober = run("seed001_sagemaker_p3_8xlarge.json", gradient_bytes=100_000_000,
                      sample_seconds=2e-5)
    assert sel.backend == "single_device"
    assert sel.accumulation_steps == 4 and sel.per_replica_batch_size == 32
    assert sel.num_replicas * sel.per_replica_batch_size * sel.accumulation_steps == 128
    assert prober.probed[0] == "nccl"
    assert hangs(sel)[0] == "torch:nccl:0,1,2,3"
    assert "aws-ofi-without-efa" in sel.plan.rules_fired
    # gloo worked at 1.9 GB/s but loses to one GPU for a 100 MB model: step down by speed
    assert any("gloo" in r.candidate.key for r in sel.plan.ranked)
    # without the compute: the degraded options by the estimate's assumed compute, provisional
    sel, _ = run("seed001_sagemaker_p3_8xlarge.json", gradient_bytes=100_000_000)
    assert (sel.backend, sel.num_replicas) == ("gloo", 4)
    assert [(e.degraded, e.kept) for e in sel.plan.events
            if e.kind == "ranking_provisional"] == [(True, ())]


def test_seed002_consumer_pcie_tries_p2p_off_first_and_keeps_nccl() -> None:
    sel, prober = run("seed002_rtx5090x4_pcie.json")
    assert sel.backend == "nccl" and sel.env == {"NCCL_P2P_DISABLE": "1"}
    assert sel.num_replicas == 4
    assert prober.probed == ["nccl+NCCL_P2P_DISABLE=1"]  # no hang of plain NCCL to sit through
    assert [(e.rule, e.first) for e in fired(sel, "remedy_added")] == [("consumer-pcie-p2p", True)]


def test_seed003_shm_failure_finds_shm_off_and_flags_nccl_timeout() -> None:
    sel, prober = run("seed003_a6000x8_shm.json")
    assert sel.backend == "nccl" and sel.env == {"NCCL_SHM_DISABLE": "1"}
    assert sel.num_replicas == 8 and sel.per_replica_batch_size == 2
    assert prober.probed == ["nccl+NCCL_SHM_DISABLE=1"]
    assert "nccl-timeout-is-not-a-variable" in [e.rule for e in fired(sel, "warn")]


def test_seed003_without_the_shm_rule_learns_from_the_probe() -> None:
    sel, prober = run("seed003_a6000x8_shm.json",
                      disable_rules=["small-dev-shm", "container-shm-remedy"])
    assert prober.probed == ["nccl", "nccl+NCCL_SHM_DISABLE=1"]
    assert sel.env == {"NCCL_SHM_DISABLE": "1"}
    queued = [(e.candidate.key, e.cause) for e in sel.plan.events if isinstance(e, RemedyQueued)]
    assert queued == [("torch:nccl:0,1,2,3,4,5,6,7:NCCL_SHM_DISABLE=1", "shared_memory")]


def test_seed004_nvflare_external_process_rules_out_mirrored_without_probing() -> None:
    sel, prober = run("seed004_a30x2_tf_launcher.json")
    assert sel.backend == "single_device" and prober.probed == []
    assert sel.accumulation_steps == 2 and sel.per_replica_batch_size == 32
    assert "tf-mirrored-in-nvflare-external-process" in sel.plan.rules_fired
    assert [len(e.candidates) for e in fired(sel, "veto")] == [3]  # one rule, named once


def test_seed004_deadlock_replayed_without_the_launcher_variable_steps_down_to_one_gpu() -> None:
    _, data = load("seed004_a30x2_tf_launcher.json")
    facts = machine(**{**data["machine"], "env": {}})
    prober = FakeProber(data["probes"])
    sel = simulate(facts, prober, framework="tensorflow", global_batch_size=64)
    assert sel.backend == "single_device"
    assert sel.accumulation_steps == 2 and sel.per_replica_batch_size == 32
    # P2P-off is tried after the hang; P2P+SHM-off (sockets, ~4 GB/s) would be slower than one
    # GPU for this model, so it is never probed.
    assert prober.probed == [
        "nccl", "nccl+NCCL_P2P_DISABLE=1", "hierarchical_copy", "reduction_to_one_device",
    ]
    assert all(r.status == "timeout" for r in sel.results.values())
    assert len(hangs(sel)) == 4


def test_healthy_h200_pair_chooses_nccl() -> None:
    sel, prober = run("h200x2_nvlink.json")
    assert sel.backend == "nccl" and sel.env == {} and prober.probed == ["nccl"]
