"""The nodes of a multi-node job compared (core/nodefacts.py and node_differences.toml), the
platform facts they carry (machine/platform.py, machine/route_lookup.py, machine/nvml.py), the kit's
description of the other nodes, and what the planner does with a finding. Pure or fake trees:
no process, no network (the two-node runs over a real TCPStore are in test_multinode.py)."""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from _fake_nvml import GPU, FakeGpu, FakeLink, FakeNvml

from resilient_strategy.core.call.arguments import Arguments, options_from
from resilient_strategy.core.knowledge.nodefacts import (
    Difference,
    compare,
    differences,
    node_facts,
    parse_differences,
)
from resilient_strategy.core.planning.plan import plan
from resilient_strategy.core.values.facts import Facts, NodeFacts
from resilient_strategy.errors import InvalidOptionError, InvalidRuleError
from resilient_strategy.machine.nvml import read_nvml
from resilient_strategy.machine.platform import detect_platform, parse_net_plugins
from resilient_strategy.machine.route_lookup import address_family
from resilient_strategy.nodes.manynodes import with_nodes
from resilient_strategy.nodes.messages import NodeSummary
from resilient_strategy.testing import machine
from resilient_strategy.testing.simulation import gpu

A = NodeFacts(0, host="a", boot_id="boot-a", driver="580.1", nccl="2.28.9", gpus=8,
              net_plugins=("libnccl-net.so",), master_family="ipv4",
              env=(("NCCL_DEBUG", "INFO"), ("NCCL_IB_HCA", "mlx5_0")))


def ids(nodes: list[NodeFacts]) -> dict[str, tuple[int, ...]]:
    return {f.id: f.nodes for f in compare(nodes)}


def test_identical_nodes_and_a_single_node_have_no_finding() -> None:
    assert compare([A, replace(A, node=1, host="b", boot_id="boot-b")]) == ()
    assert compare([A]) == ()


def test_a_version_difference_names_the_node_its_value_and_rules_nccl_out() -> None:
    b = replace(A, node=1, boot_id="boot-b", nccl="2.21.5")
    (f,) = compare([b, A])  # any order: node 0 first
    assert (f.id, f.fact, f.effect, f.nodes) == ("nodes-nccl-version", "nccl", "rule_out", (1,))
    assert dict(f.values) == {0: "2.28.9", 1: "2.21.5"}
    assert f.source.startswith("https://")


def test_an_unknown_value_is_no_difference_but_a_missing_plugin_is() -> None:
    b = replace(A, node=1, boot_id="boot-b", driver=None, master_family="")
    assert compare([A, b]) == ()
    c = replace(A, node=1, boot_id="boot-b", net_plugins=())
    (f,) = compare([A, c])
    assert (f.id, f.nodes, f.keep_env) == ("nodes-net-plugin", (1,), (("NCCL_NET", "Socket"),))
    assert f.keeps({"NCCL_NET": "Socket"}) and not f.keeps({})


def test_pods_of_one_host_share_its_boot_id_and_loopback_is_named_where_it_is() -> None:
    nodes = [A, replace(A, node=1, hostname_loopback=True), replace(A, node=2, boot_id="c")]
    found = ids(nodes)
    assert found["nodes-one-host"] == (0, 1)
    assert found["nodes-hostname-loopback"] == (1,)


def test_variables_set_on_one_node_only_are_named_once_and_logging_is_ignored() -> None:
    b = replace(A, node=1, boot_id="b", env=(("NCCL_IB_HCA", "mlx5_1"), ("NCCL_ALGO", "Ring"),
                                              ("GLOO_SOCKET_IFNAME", "eth1")))
    found = {f.id: f for f in compare([A, b])}
    assert found["nodes-nccl-ib-settings"].variables == ("NCCL_IB_HCA",)
    assert found["nodes-socket-ifname"].variables == ("GLOO_SOCKET_IFNAME",)
    rest = found["nodes-nccl-env"]
    assert rest.variables == ("NCCL_ALGO",)  # NCCL_DEBUG differs too, but only logs
    assert dict(rest.values) == {0: "NCCL_ALGO unset", 1: "NCCL_ALGO=Ring"}


def test_every_shipped_difference_is_sourced_and_the_data_is_checked() -> None:
    entries = differences()
    assert len(entries) >= 10 and all("https://" in e.source and e.message for e in entries)
    assert len({e.id for e in entries}) == len(entries)
    good = ('version = 1\n[[difference]]\nid = "x"\nfact = "nccl"\nmessage = "m"\n'
            'source = "https://example.org/s"\n')
    assert parse_differences(good, "t") == (Difference("x", "nccl", "differs", "warn", "m",
                                                       "https://example.org/s"),)
    for bad in (good.replace('"nccl"', '"colour"'), good.replace('"nccl"', '"env"'),
                good + 'kind = "sometimes"\n', good.replace('source = "https://example.org/s"\n',
                                                            "")):
        with pytest.raises(InvalidRuleError):
            parse_differences(bad, "t")


def test_node_facts_cross_the_store_as_json_and_back() -> None:
    facts = machine(2, env={"NCCL_IB_HCA": "mlx5_0", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "1"},
                    platform_facts={"boot_id": "b1", "net_plugins": ["libnccl-net.so"],
                                    "master_family": "ipv6", "master_ifname": "ib0"})
    mine = node_facts(facts, "torch", 3, "host3")
    assert (mine.nccl, mine.gpus, mine.boot_id, mine.master_family, mine.route, mine.env) == (
        "2.28.9", 2, "b1", "ipv6", "ib0", (("NCCL_IB_HCA", "mlx5_0"),))
    assert NodeFacts.from_dict(json.loads(json.dumps(mine.to_dict()))) == mine
    with pytest.raises(ValueError):
        NodeFacts.from_dict({**mine.to_dict(), "colour": "red"})
    # a node whose facts cannot be read is left out of the comparison, never guessed
    sent = {"0": {"facts": mine.to_dict()}, "1": {"facts": {"node": "one"}}, "2": {}}
    job = with_nodes(facts, {k: NodeSummary.from_json(v) for k, v in sent.items()})
    assert job.nodes == (mine,)


def test_the_nodes_are_facts_of_the_job_not_of_the_machines_fingerprint() -> None:
    facts = machine(2, nodes=[{"nccl": "2.21.5"}])
    assert facts.fingerprint() == machine(2).fingerprint()
    assert Facts.from_dict(json.loads(json.dumps(facts.to_dict(), default=list))).nodes == \
        facts.nodes
    plat = machine(2, platform_facts={"boot_id": "b", "master_family": "ipv4"})
    assert plat.fingerprint() == machine(2).fingerprint()  # per boot / per run: left out
    assert machine(2, platform_facts={"net_plugins": ["libnccl-net.so"]}).fingerprint() != \
        machine(2).fingerprint()  # a plugin changes what NCCL does: re-probed


def test_the_kit_describes_the_other_nodes_by_what_differs() -> None:
    facts = machine(2, env={"NCCL_IB_HCA": "mlx5_0"},
                    nodes=[{"env": {"NCCL_IB_HCA": None, "NCCL_ALGO": "Ring"}},
                           {"nccl": "2.21.5"}])
    assert [n.node for n in facts.nodes] == [0, 1, 2]
    assert facts.nodes[1].env == (("NCCL_ALGO", "Ring"),)
    assert facts.nodes[2].nccl == "2.21.5" and facts.nodes[2].env == facts.nodes[0].env
    for bad in ([{"colour": "red"}], [{"gpus": "two"}], {"nccl": "x"}, [{"env": "NCCL_X=1"}]):
        with pytest.raises(InvalidOptionError):
            machine(2, nodes=bad)  # type: ignore[arg-type]


def _opts(facts: Facts) -> object:
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
           **facts.env_map}
    return options_from(facts, env, Arguments.from_kwargs(framework="torch", global_batch_size=512, devices=None,
                        probe=None, timeout=2.0, prefer=None, dry_run=True, model=None,
                        gradient_bytes=100 << 20, sample_seconds=0.01, max_per_replica_batch=None,
                        rules=(), disable_rules=(), cache=False, cache_dir=None, cache_ttl=None,
                        precision="auto", logical_cpus=0))


def test_the_planner_rules_nccl_between_the_nodes_out_and_keeps_node_0s_own() -> None:
    facts = machine(2, nvlink=18, nodes=[{"nccl": "2.21.5"}])
    p = plan(facts, (), {}, _opts(facts))  # type: ignore[arg-type]
    (event,) = [e for e in p.events if e.kind == "nodes_differ"]
    assert [c.key for c in event.ruled_out] == ["torch:nccl:0,1"]
    keys = [c.key for c in p.candidates]
    assert "torch:nccl:0,1" not in keys and "torch:nccl/node0:0,1" in keys
    assert "torch:gloo:0,1" in keys
    assert event.to_dict()["finding"]["nodes"] == [1]
    # a warning rules nothing out; one node alone is never compared
    warn = machine(2, nvlink=18, nodes=[{"driver": "550.1"}])
    p = plan(warn, (), {}, _opts(warn))  # type: ignore[arg-type]
    assert "torch:nccl:0,1" in [c.key for c in p.candidates]
    assert [e.finding.id for e in p.events if e.kind == "nodes_differ"] == ["nodes-driver"]


def test_a_plugin_on_one_node_keeps_nccl_on_nccls_own_sockets() -> None:
    facts = machine(2, nvlink=18, env={"NCCL_NET": "Socket"},
                    platform_facts={"net_plugins": ["libnccl-net.so"]},
                    nodes=[{"net_plugins": []}])
    p = plan(facts, (), {}, _opts(facts))  # type: ignore[arg-type]
    (event,) = [e for e in p.events if e.kind == "nodes_differ"]
    assert event.finding.id == "nodes-net-plugin" and event.ruled_out == ()


# ----- the platform facts the nodes carry ----------------------------------------------------
def test_net_plugins_boot_id_and_family_from_a_fake_tree(tmp_path: Path) -> None:
    (tmp_path / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (tmp_path / "usr/lib/x86_64-linux-gnu/libnccl-net-ofi.so").write_text("")
    (tmp_path / "usr/lib/x86_64-linux-gnu/libnccl.so.2").write_text("")
    (tmp_path / "opt/mine").mkdir(parents=True)
    (tmp_path / "opt/mine/libnccl-net.so.1").write_text("")
    (tmp_path / "proc/sys/kernel/random").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/random/boot_id").write_text("5f0c6c1e-0d38\n")
    got = detect_platform({"LD_LIBRARY_PATH": "/opt/mine:relative", "MASTER_ADDR": "::1"},
                          str(tmp_path))
    assert got.net_plugins == ("libnccl-net-ofi.so", "libnccl-net.so.1")
    assert (got.boot_id, got.master_family) == ("5f0c6c1e-0d38", "ipv6")
    assert parse_net_plugins({"/x": ["libnccl-net-aws-ofi.so", "libnccl.so"], "/y": []}) == (
        "libnccl-net-aws-ofi.so",)


def test_the_address_family_of_a_name_within_a_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    assert address_family("10.0.0.1") == "ipv4" and address_family("[fe80::1]") == "ipv6"
    assert address_family("node0", lookup=lambda h: socket.AF_INET6) == "ipv6"
    release = threading.Event()

    def hang(*args: object, **kwargs: object) -> object:
        release.wait(10)
        raise OSError("released")

    monkeypatch.setattr(socket, "getaddrinfo", hang)
    try:
        assert address_family("node0", deadline_s=0.05) == ""  # unknown, never a blocked decision
    finally:
        release.set()


def test_nvlinks_to_gpus_this_container_cannot_see() -> None:
    # one H20 of an NVSwitch box given to this pod: its 18 links land on switches
    pod = FakeNvml([FakeGpu("NVIDIA H20", "GPU-a", "00000000:00:06.0", (9, 0), 1 << 36,
                            links=[FakeLink() for _ in range(18)])])
    assert [g.nvlinks_outside for g in read_nvml(pod).gpus] == [18]
    # direct NVLinks: 4 to the GPU it sees, 4 to a GPU it does not
    pair = FakeNvml([
        FakeGpu("A100", "GPU-a", "00000000:00:06.0", (8, 0), 1 << 35,
                links=[FakeLink(remote_type=GPU, remote_bus="00000000:00:07.0")] * 4
                + [FakeLink(remote_type=GPU, remote_bus="00000000:00:09.0")] * 4),
        FakeGpu("A100", "GPU-b", "00000000:00:07.0", (8, 0), 1 << 35,
                links=[FakeLink(remote_type=GPU, remote_bus="00000000:00:06.0")] * 4),
    ])
    snap = read_nvml(pair)
    assert [g.nvlinks_outside for g in snap.gpus] == [4, 0]
    assert snap.links[0].nvlinks == 4
    described = machine([gpu(0, nvlinks_outside=18)], container="kubernetes")
    assert described.gpus[0].nvlinks_outside == 18
