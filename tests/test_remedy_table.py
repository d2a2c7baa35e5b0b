"""The remedy table (core/knowledge/remedies.toml) as data: each remedy gated by facts and sourced, each
cause's list in order, the user's files layered on top; the planner queues what applies and never
a variable the user set."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient_strategy.core.knowledge.clauses import fact_values
from resilient_strategy.core.knowledge.remedies import (
    builtin_remedies,
    load_remedies,
    parse_remedies,
)
from resilient_strategy.core.trace.ruling import CandidateRuledOut, RemedyQueued, UserSettingKept
from resilient_strategy.errors import InvalidRuleError
from resilient_strategy.testing import FakeProber, Platform, machine, simulate

KW = {"global_batch_size": 64, "gradient_bytes": 1000, "sample_seconds": 1.0}


def _envs(facts: object, cause: str, backend: str = "nccl", nodes: int = 1) -> list[dict[str, str]]:
    values = fact_values(facts, "torch", nodes=nodes)  # type: ignore[arg-type]
    return [env for _, env in builtin_remedies().for_cause(cause, backend, values)]


def test_every_remedy_is_sourced_and_every_cause_names_known_remedies() -> None:
    table = builtin_remedies()
    ids = {r.id for r in table.remedies}
    assert {"nvls-off", "p2p-level-nvl", "p2p-level-pxb", "p2p-off", "shm-off", "ib-off",
            "ib-gid-index", "ib-hca", "cross-nic", "socket-ifname-route", "gloo-ifname-route",
            "net-socket", "store-no-libuv"} <= ids
    assert all(r.source.startswith("https://") for r in table.remedies)
    assert all(set(names) <= ids for _, names in table.causes)


def test_nvls_off_only_with_nvswitch_and_an_nccl_that_has_nvls() -> None:
    with_nvs = machine(8, nvlink=18, platform_facts=Platform(nvswitch=True))
    assert _envs(with_nvs, "nvls_multicast") == [{"NCCL_NVLS_ENABLE": "0"}]
    assert _envs(machine(8, nvlink=18), "nvls_multicast") == []
    old = machine(8, nvlink=18, torch_nccl="2.16.5", platform_facts={"nvswitch": True})
    assert _envs(old, "nvls_multicast") == []


def test_p2p_level_comes_before_p2p_off_only_where_nvlink_or_a_switch_exists() -> None:
    pairs = machine(4, links={"0-1": 4, "2-3": 4})
    assert _envs(pairs, "cuda_error")[:2] == [{"NCCL_P2P_LEVEL": "NVL"}, {"NCCL_P2P_DISABLE": "1"}]
    # NCCL 2.24+ meets 217 on its cuMem host path too (P2P off does not help there): last
    cumem = {"NCCL_CUMEM_HOST_ENABLE": "0"}
    switch = machine(4, topology="multiple")
    assert _envs(switch, "p2p_unsupported") == [{"NCCL_P2P_LEVEL": "PXB"},
                                                 {"NCCL_P2P_DISABLE": "1"}, cumem]
    plain = machine(2, topology="hostbridge")
    assert _envs(plain, "p2p_unsupported") == [{"NCCL_P2P_DISABLE": "1"}, cumem]
    older = machine(2, topology="hostbridge", torch_nccl="2.21.5")  # before cuMem host buffers
    assert _envs(older, "p2p_unsupported") == [{"NCCL_P2P_DISABLE": "1"}]


def test_rdma_remedies_only_with_hcas_and_fill_in_the_facts() -> None:
    roce = machine(8, infiniband=True, platform_facts={
        "rdma_link_layer": "ethernet", "rdma_devices": ["mlx5_0", "mlx5_3"],
        "master_ifname": "bond0"})
    assert _envs(roce, "rdma_error", nodes=2) == [
        {"NCCL_IB_GID_INDEX": "3"}, {"NCCL_IB_HCA": "=mlx5_0,mlx5_3"}, {"NCCL_CROSS_NIC": "0"},
        {"NCCL_IB_DISABLE": "1"}]
    assert _envs(machine(8), "rdma_error", nodes=2) == []
    # between nodes the interface is resolved on each node (its name may differ per node, and a
    # literal name would give the nodes different candidates): the value says so
    assert _envs(roce, "nccl_network", nodes=2) == [{"NCCL_SOCKET_IFNAME": "@route"}]
    assert _envs(roce, "nccl_network", nodes=1) == [{"NCCL_SOCKET_IFNAME": "lo"}]
    assert _envs(roce, "gloo_connection", "gloo", nodes=2) == [{"GLOO_SOCKET_IFNAME": "@route"}]
    other = machine(8, infiniband=True, platform_facts={
        "rdma_link_layer": "ethernet", "rdma_devices": ["mlx5_0", "mlx5_3"],
        "master_ifname": "enp1s0"})  # another node, another name: the same candidates
    assert _envs(other, "nccl_network", nodes=2) == _envs(roce, "nccl_network", nodes=2)
    assert _envs(machine(8), "nccl_network", nodes=2) == []  # no route known: nothing to set


def test_a_user_file_adds_a_remedy_and_replaces_a_cause_list(tmp_path: Path) -> None:
    path = tmp_path / "site.toml"
    path.write_text("""
version = 1
[causes]
rdma_error = ["site-ib-sl", "ib-off"]
[[remedy]]
id = "site-ib-sl"
env = { NCCL_IB_SL = "3" }
when = ["host.infiniband"]
source = "https://wiki.example.org/fabric"
""", encoding="utf-8")
    table = load_remedies([path])
    values = fact_values(machine(8, infiniband=True), "torch", nodes=2)
    assert [env for _, env in table.for_cause("rdma_error", "nccl", values)] == [
        {"NCCL_IB_SL": "3"}, {"NCCL_IB_DISABLE": "1"}]


@pytest.mark.parametrize(("body", "words"), [
    ("version = 9\n", "version"),
    ("version = 1\n[[remedy]]\nid = 'x'\nenv = { A = '1' }\n", "source"),
    ("version = 1\n[[remedy]]\nid = 'x'\nenv = {}\nsource = 's'\n", "env"),
    ("version = 1\n[[remedy]]\nid = 'x'\nenv = { A = '1' }\nsource = 's'\nbackends = ['x']\n",
     "backends"),
    ("version = 1\n[[remedy]]\nid = 'x'\nenv = { A = '{nope.fact}' }\nsource = 's'\n",
     "unknown fact"),
    ("version = 1\n[[remedy]]\nid = 'x'\nenv = { A = '1' }\nsource = 's'\nwhen = ['gpus.cnt > 1']\n",
     "unknown fact"),
])
def test_a_bad_remedy_file_is_refused_naming_the_problem(body: str, words: str) -> None:
    with pytest.raises(InvalidRuleError) as info:
        parse_remedies(body, "site.toml")
    assert words in str(info.value)


def test_a_cause_list_naming_an_unknown_remedy_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("version = 1\n[causes]\nrdma_error = ['no-such']\n", encoding="utf-8")
    with pytest.raises(InvalidRuleError, match="no-such"):
        load_remedies([path])


def test_the_planner_never_sets_a_variable_the_user_set_and_says_so() -> None:
    facts = machine(4, nvlink=18, platform_facts={"nvswitch": True},
                    env={"WORLD_SIZE": "4", "NCCL_NVLS_ENABLE": "1"})
    prober = FakeProber({"nccl": "error:nvls_multicast", "gloo": "ok:2"})
    sel = simulate(facts, prober, **KW)
    assert "nccl+NCCL_NVLS_ENABLE=0" not in prober.probed
    kept = [e for e in sel.plan.events if isinstance(e, UserSettingKept)]
    assert [(e.rule, e.variables) for e in kept] == [
        ("nvls-off (remedy for nvls_multicast)", ("NCCL_NVLS_ENABLE",))]


def test_a_gloo_failure_gets_the_gloo_interface_remedy() -> None:
    facts = machine(0, torch_cuda=None, torch_nccl=None,
                    env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "RANK": "0",
                         "LOCAL_RANK": "0", "GROUP_RANK": "0", "MASTER_ADDR": "10.0.0.1",
                         "MASTER_PORT": "29500"},
                    platform_facts={"master_ifname": "eth1", "hostname_loopback": True})
    prober = FakeProber({"gloo": "error:gloo_connection",
                         "gloo+GLOO_SOCKET_IFNAME=@route": "ok:1"})
    sel = simulate(facts, prober, **KW)
    assert (sel.backend, dict(sel.env)) == ("gloo", {"GLOO_SOCKET_IFNAME": "eth1"})  # resolved here
    queued = [e for e in sel.plan.events if isinstance(e, RemedyQueued)]
    assert [(e.candidate.backend, e.cause) for e in queued] == [("gloo", "gloo_connection")]


def test_a_cuda_that_cannot_initialise_rules_out_every_gpu_candidate() -> None:
    facts = machine(4, env={"WORLD_SIZE": "4"})
    prober = FakeProber({"nccl": "error:cuda_init"})
    sel = simulate(facts, prober, **KW)
    assert (sel.backend, prober.probed) == ("cpu", ["nccl"])
    out = {e.candidate.backend for e in sel.plan.events if isinstance(e, CandidateRuledOut)}
    assert {"nccl", "gloo", "single_device"} <= out
