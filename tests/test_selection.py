"""Selection.rank / local_rank / world_size: where this process sits in the chosen strategy."""

from __future__ import annotations

import json
from dataclasses import replace

from resilient_strategy.selection import Launch
from resilient_strategy.testing import machine, simulate

LAUNCH2 = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}


def test_plain_python_is_rank_0_of_1() -> None:
    sel = simulate(machine(0, tensorflow=None), framework="torch", global_batch_size=64)
    assert (sel.rank, sel.local_rank, sel.world_size) == (0, 0, 1)
    assert sel.to_dict()["world_size"] == 1 and sel.to_dict()["local_rank"] == 0


def test_torch_under_torchrun_trains_in_a_group_of_the_launchers_size() -> None:
    facts = machine(2, nvlink=18, tensorflow=None)
    sel = simulate(facts, {"nccl": "ok"}, framework="torch", global_batch_size=64, env=LAUNCH2)
    assert (sel.backend, sel.num_replicas) == ("nccl", 2)
    assert (sel.rank, sel.local_rank, sel.world_size) == (0, 0, 2)
    other = replace(sel, launch=Launch(rank=1, local_rank=1, world_size=2, local_world_size=2))
    assert (other.rank, other.local_rank, other.world_size, other.active) == (1, 1, 2, True)


def test_a_one_device_fallback_is_a_world_of_one_and_the_idle_rank_lies_outside_it() -> None:
    facts = machine(2, nvlink=18, tensorflow=None)
    sel = simulate(facts, {"nccl": "error", "gloo": "error"}, framework="torch",
                   global_batch_size=64, env=LAUNCH2, probe="force")
    assert sel.num_replicas == 1 and sel.accumulation_steps == 2
    assert (sel.rank, sel.world_size, sel.active) == (0, 1, True)
    idle = replace(sel, launch=Launch(rank=1, local_rank=1, world_size=2, local_world_size=2))
    assert idle.active is False and idle.rank >= idle.world_size
    data = idle.to_dict()
    assert (data["rank"], data["world_size"], data["launch_world_size"]) == (1, 1, 2)


def test_tensorflow_drives_its_replicas_from_one_process() -> None:
    facts = machine(2, nvlink=18, torch=None, tensorflow="2.21.0", tf_cuda="12.5")
    sel = simulate(facts, {"nccl": "ok"}, framework="tensorflow", global_batch_size=64)
    assert sel.num_replicas == 2
    assert (sel.rank, sel.local_rank, sel.world_size) == (0, 0, 1)


def test_tensorflow_across_workers_is_a_world_of_the_workers() -> None:
    cluster = {"cluster": {"worker": ["h0:1", "h1:1"]}, "task": {"type": "worker", "index": 1}}
    facts = machine(0, torch=None, tensorflow="2.21.0")
    sel = simulate(facts, {"mw_ring": "ok"}, framework="tensorflow", global_batch_size=64,
                   env={"TF_CONFIG": json.dumps(cluster)})
    assert sel.backend == "mw_ring"
    assert (sel.rank, sel.local_rank, sel.world_size) == (1, 0, 2)
