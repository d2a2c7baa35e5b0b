"""The five seed reports, as simulated machines: the library reaches the decision the report
reached, or a better one with the reason in the trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from resilient_strategy.testing import FakeProber, machine, simulate

MACHINES = Path(__file__).parents[1] / "examples" / "machines"


def load(name: str) -> tuple[Any, dict[str, Any]]:
    data = json.loads((MACHINES / name).read_text())
    return machine(**data["machine"]), data


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
    text = sel.explain()
    assert "tf-nccl-before-blackwell" in text and "unhandled cuda error" in text
    assert "tf-ptx-jit-only" in text  # the 30-minute JIT warning


def test_seed001_sagemaker_hang_falls_back_to_one_gpu_with_accumulation_x4() -> None:
    sel, prober = run("seed001_sagemaker_p3_8xlarge.json", gradient_bytes=100_000_000)
    assert sel.backend == "single_device"
    assert sel.accumulation_steps == 4 and sel.per_replica_batch_size == 32
    assert sel.num_replicas * sel.per_replica_batch_size * sel.accumulation_steps == 128
    assert prober.probed[0] == "nccl"
    assert "hung until the probe's deadline" in sel.explain()
    assert "aws-ofi-without-efa" in sel.explain()
    # gloo worked at 1.9 GB/s but loses to one GPU for a 100 MB model: step down by speed
    assert any("gloo" in r.candidate.key for r in sel.plan.ranked)


def test_seed002_consumer_pcie_tries_p2p_off_first_and_keeps_nccl() -> None:
    sel, prober = run("seed002_rtx5090x4_pcie.json")
    assert sel.backend == "nccl" and sel.env == {"NCCL_P2P_DISABLE": "1"}
    assert sel.num_replicas == 4
    assert prober.probed == ["nccl+NCCL_P2P_DISABLE=1"]  # no hang of plain NCCL to sit through
    assert "consumer-pcie-p2p" in sel.explain()


def test_seed003_shm_failure_finds_shm_off_and_flags_nccl_timeout() -> None:
    sel, prober = run("seed003_a6000x8_shm.json")
    assert sel.backend == "nccl" and sel.env == {"NCCL_SHM_DISABLE": "1"}
    assert sel.num_replicas == 8 and sel.per_replica_batch_size == 2
    assert prober.probed == ["nccl+NCCL_SHM_DISABLE=1"]
    assert "NCCL_TIMEOUT does nothing" in sel.explain()


def test_seed003_without_the_shm_rule_learns_from_the_probe() -> None:
    sel, prober = run("seed003_a6000x8_shm.json",
                      disable_rules=["small-dev-shm", "container-shm-remedy"])
    assert prober.probed == ["nccl", "nccl+NCCL_SHM_DISABLE=1"]
    assert sel.env == {"NCCL_SHM_DISABLE": "1"}
    assert "usual remedy for shared_memory" in sel.explain()


def test_seed004_nvflare_external_process_rules_out_mirrored_without_probing() -> None:
    sel, prober = run("seed004_a30x2_tf_launcher.json")
    assert sel.backend == "single_device" and prober.probed == []
    assert sel.accumulation_steps == 2 and sel.per_replica_batch_size == 32
    assert "tf-mirrored-in-nvflare-external-process" in sel.plan.rules_fired
    assert "PyTorch DDP" in sel.explain()


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
    assert sel.explain().count("hung until the probe's deadline") == 4


def test_healthy_h200_pair_chooses_nccl() -> None:
    sel, prober = run("h200x2_nvlink.json")
    assert sel.backend == "nccl" and sel.env == {} and prober.probed == ["nccl"]
