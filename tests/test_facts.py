"""The fingerprint: what decides whether a cached probe result still holds on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import deadline

from resilient_strategy.core.values.facts import Facts, Gpu, relevant_env

GPUS = (Gpu(0, "NVIDIA H200", (9, 0), uuid="GPU-a"), Gpu(1, "NVIDIA H200", (9, 0), uuid="GPU-b"))
BASE = {"HOME": "/root", "NCCL_SOCKET_IFNAME": "eth0"}


def fingerprint(**env: str) -> str:
    return Facts(gpus=GPUS, env=relevant_env({**BASE, **env})).fingerprint()


@pytest.mark.parametrize("extra", [
    {"NCCL_DEBUG": "INFO"},
    {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": "/tmp/nccl.%h.%p"},
    {"TF_CLI_CONFIG_FILE": "/home/me/.terraformrc", "TF_LOG": "DEBUG"},  # Terraform's
    {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0"},  # TensorFlow, logging / CPU only
    {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},  # torchrun vs `python -m resilient_strategy`
    {"RANK": "1", "LOCAL_RANK": "1", "MASTER_PORT": "29501", "TORCHELASTIC_RUN_ID": "x"},
])
def test_fingerprint_ignores_what_does_not_change_the_result(extra: dict[str, str]) -> None:
    assert fingerprint(**extra) == fingerprint()


def test_launch_size_does_not_change_the_fingerprint() -> None:
    assert fingerprint(WORLD_SIZE="1") == fingerprint(WORLD_SIZE="2")


@pytest.mark.parametrize("extra", [
    {"NCCL_P2P_DISABLE": "1"},
    {"NCCL_SHM_DISABLE": "1"},
    {"TF_CONFIG": '{"cluster": {}}'},
    {"TF_GPU_ALLOCATOR": "cuda_malloc_async"},
    {"TF_FORCE_GPU_ALLOW_GROWTH": "true"},
    {"TF_XLA_FLAGS": "--tf_xla_auto_jit=2"},
    {"TORCH_NCCL_BLOCKING_WAIT": "1"},
    {"CUDA_VISIBLE_DEVICES": "1,0"},
])
def test_fingerprint_follows_what_changes_the_result(extra: dict[str, str]) -> None:
    assert fingerprint(**extra) != fingerprint()


def test_relevant_env_keeps_what_other_code_reads_but_not_terraform() -> None:
    env = relevant_env({"WORLD_SIZE": "2", "NCCL_DEBUG": "INFO", "TF_CLI_CONFIG_FILE": "x",
                        "TF_CPP_MIN_LOG_LEVEL": "2", "TF_CONFIG": "{}", "PATH": "/bin"})
    assert env == (("NCCL_DEBUG", "INFO"), ("TF_CONFIG", "{}"), ("WORLD_SIZE", "2"))


#: What torchrun (torch 2.x) sets in each worker's environment, as measured by
#: test_a_real_torchrun_sets_nothing_that_changes_the_fingerprint.
TORCHRUN_ENV = {
    "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "localhost", "MASTER_PORT": "35987", "OMP_NUM_THREADS": "1", "RANK": "1",
    "ROLE_NAME": "default", "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "2",
    "TORCHELASTIC_ERROR_FILE": "/tmp/torchelastic_x/none/attempt_0/1/error.json",
    "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_RUN_ID": "59e4a589", "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP",
    "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "NCCL_ASYNC_ERROR_HANDLING": "1", "WORLD_SIZE": "2",
}


def test_what_torchrun_sets_does_not_change_the_fingerprint() -> None:
    # a cache warmed by `python -m resilient_strategy probe` must serve the torchrun job
    assert fingerprint(**TORCHRUN_ENV) == fingerprint()


_DUMP = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"


@pytest.mark.slow
@pytest.mark.torch
def test_a_real_torchrun_sets_nothing_that_changes_the_fingerprint(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.run")
    script = tmp_path / "dump.py"
    script.write_text(_DUMP)
    parent = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
         "--master_port", "0", str(script), str(tmp_path / "env.json")],
        env=parent, capture_output=True, text=True, timeout=deadline(120), cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    child = json.loads((tmp_path / "env.json").read_text())
    assert "LOCAL_RANK" in child  # it really ran under torchrun
    added = set(child) - set(parent)
    unknown = sorted(added - set(TORCHRUN_ENV))
    base = Facts(gpus=GPUS, env=relevant_env(parent)).fingerprint()
    assert Facts(gpus=GPUS, env=relevant_env(child)).fingerprint() == base, unknown


# ----- a uniform fabric held once ------------------------------------------------------------
def _listed(facts: Facts) -> Facts:
    """The same machine with every pair listed (what NVML reports before compaction)."""
    from dataclasses import replace

    from resilient_strategy.core.values.facts import Link

    n = len(facts.gpus)
    links = tuple(facts.link(a, b) or Link(a, b) for a in range(n) for b in range(a + 1, n))
    return replace(facts, links=links, fabric=None)


@pytest.mark.parametrize("links", [None, {(0, 1): 0}, {"3-7": {"nvlinks": 0, "p2p": "not_supported"}}])
@pytest.mark.parametrize("nvlink", [0, 18])
def test_a_fabric_changes_no_answer_and_no_decision(links: object, nvlink: int) -> None:
    from resilient_strategy.core.values.facts import FABRIC_MIN_GPUS, compact_links
    from resilient_strategy.testing import machine, simulate

    n = FABRIC_MIN_GPUS + 4
    facts = machine(n, nvlink=nvlink, links=links, torch="2.13.0")
    full = _listed(facts)
    assert facts.fabric is not None and len(facts.links) <= 1
    assert compact_links(n, full.links) == (facts.links, facts.fabric)
    assert facts.link_summary() == full.link_summary()
    for devices in ((0, 1), (2, 3), tuple(range(n)), (3, 7, 9)):
        assert facts.all_nvlink(devices) == full.all_nvlink(devices)
    assert facts.link(5, 2) == full.link(2, 5) and facts.link(1, 1) is None
    assert Facts.from_dict(json.loads(json.dumps(facts.to_dict()))) == facts
    one, other = simulate(facts, global_batch_size=4 * n), simulate(full, global_batch_size=4 * n)
    assert one.candidate == other.candidate and one.plan.rules_fired == other.plan.rules_fired
    assert [r.candidate for r in one.plan.ranked] == [r.candidate for r in other.plan.ranked]


def test_small_machines_list_every_pair() -> None:
    from resilient_strategy.testing import machine

    facts = machine(8, nvlink=4)
    assert facts.fabric is None and len(facts.links) == 28


def test_platform_facts_round_trip_and_leave_old_fingerprints_alone() -> None:
    from resilient_strategy.core.values.facts import Platform
    from resilient_strategy.testing import machine

    plain = machine(2)
    described = machine(2, platform_facts=Platform(nvswitch=True, rdma_link_layer="ethernet",
                                                   rdma_devices=("mlx5_0",), master_ifname="eth0"))
    assert Facts.from_dict(described.to_dict()) == described
    assert Facts.from_dict(plain.to_dict()).fingerprint() == plain.fingerprint()
    assert described.fingerprint() != plain.fingerprint()
    key = plain.to_dict()
    del key["platform"]  # a description written before platform facts existed
    assert Facts.from_dict(key).fingerprint() == plain.fingerprint()
    with pytest.raises(ValueError):
        Facts.from_dict({**plain.to_dict(), "platform": {"rdma_link_layer": "token-ring"}})


def test_the_route_to_master_addr_is_not_part_of_the_fingerprint() -> None:
    """It follows MASTER_ADDR, a per-run variable: a single-node torchrun (127.0.0.1, lo) must
    read the cache a command-line probe (no MASTER_ADDR) warmed."""
    from resilient_strategy.core.values.facts import Platform
    from resilient_strategy.testing import machine

    routed = machine(2, platform_facts=Platform(master_ifname="lo", master_route="loopback"))
    assert routed.fingerprint() == machine(2).fingerprint()
    assert Facts.from_dict(routed.to_dict()) == routed
