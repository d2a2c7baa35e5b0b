"""Multi-node: the route to the rendezvous host, the job from torchrun's variables, combining
the nodes' probe reports, remedies between nodes, and the agreement protocol between nodes run
for real over a TCPStore (each node's local rank 0 in a thread, probes answered by FakeProber)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest

from resilient_strategy.core.call.arguments import Arguments, options_from
from resilient_strategy.core.measures.probe import OK, TIMEOUT, ProbeResult, ProbeSpec
from resilient_strategy.core.planning.plan import Candidate, plan
from resilient_strategy.deciding.decide import decide
from resilient_strategy.errors import NodeLostError, NodeMismatchError
from resilient_strategy.nodes import manynodes as multinode
from resilient_strategy.nodes import routes
from resilient_strategy.nodes import store as nodestore
from resilient_strategy.nodes.crossprobe import combine
from resilient_strategy.nodes.manynodes import contradictions
from resilient_strategy.nodes.messages import NodeSummary, RoundReport
from resilient_strategy.nodes.routes import ROUTE, route_interface
from resilient_strategy.nodes.store import Job
from resilient_strategy.testing import FakeProber, machine

ROUTES = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t0100000A\t0003\t0\t0\t100\t00000000\t0\t0\t0
eth1\t00000000\t0100000A\t0003\t0\t0\t50\t00000000\t0\t0\t0
ib0\t0000000A\t00000000\t0001\t0\t0\t0\t000000FF\t0\t0\t0
down0\t0002000A\t00000000\t0000\t0\t0\t0\t00FFFFFF\t0\t0\t0
"""
LOCAL = {"lo": "127.0.0.1", "eth0": "192.168.1.5", "ib0": "10.9.0.5"}


def test_route_interface_follows_the_kernel_routing_table() -> None:
    assert route_interface("127.0.0.1", ROUTES, LOCAL)[0] == "lo"
    assert route_interface("192.168.1.5", ROUTES, LOCAL)[0] == "eth0"  # this host's own address
    iface, how = route_interface("10.2.0.7", ROUTES, LOCAL)  # /8 beats the default; the down
    assert iface == "ib0" and "10.0.0.0/8" in how          # /24 route is skipped
    assert route_interface("8.8.8.8", ROUTES, LOCAL)[0] == "eth1"  # lowest metric default
    assert route_interface("8.8.8.8", ROUTES.splitlines()[0], LOCAL)[0] is None
    assert route_interface("fe80::1", ROUTES, LOCAL)[0] is None
    assert route_interface("not-an-ip", ROUTES, LOCAL)[0] is None


TORCHRUN = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0",
            "GROUP_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "3",
            "TORCHELASTIC_RUN_ID": "job7"}


def test_job_from_torchrun_variables() -> None:
    job = Job.from_env(TORCHRUN)
    assert job is not None
    assert (job.node, job.nodes, job.local_world, job.agent_store) == (1, 2, 2, True)
    assert job.prefix == "resilient_strategy/v1/job7/3/"  # a restart never reads the last one
    assert Job.from_env({**TORCHRUN, "GROUP_RANK": ""}) is not None
    for bad in ({"MASTER_ADDR": ""}, {"LOCAL_WORLD_SIZE": "4"}, {"MASTER_PORT": "x"},
                {"LOCAL_WORLD_SIZE": "3"}):
        assert Job.from_env({**TORCHRUN, **bad}) is None


JOB = Job(node=0, nodes=2, local_world=2, rank=0, master_addr="h", master_port=1,
          agent_store=True, prefix="p/")
SPEC = ProbeSpec("torch:nccl:0,1", "torch", "nccl", (0, 1), world_size=4, timeout_s=10.0)


def report(node: int, local: ProbeResult | None, cross: ProbeResult | None) -> RoundReport:
    return RoundReport(node, local, cross, "ib0", 3.0)


def test_combine_blames_a_local_group_then_the_link_and_keeps_the_slowest_bus() -> None:
    ok_local = ProbeResult(SPEC.candidate, OK, 2.0, bus_bandwidth_gbps=100.0, step_seconds=0.01)
    ok_cross = ProbeResult(SPEC.candidate, OK, 2.0, bus_bandwidth_gbps=9.5, step_seconds=0.02,
                           message_bytes=1 << 24)
    bad_local = ProbeResult(SPEC.candidate, "error", 1.0, "cuda_error", "rank 1: boom")
    hung = ProbeResult(SPEC.candidate, TIMEOUT, 10.0, "timeout", "ranks [0]")
    refused = ProbeResult(SPEC.candidate, "error", 1.0, "nccl_error", "rank 1: refused")

    r = combine(SPEC, [report(0, ok_local, None), report(1, bad_local, None)], JOB)
    assert (r.status, r.cause, r.ranks) == ("error", "cuda_error", 4)  # local remedies apply

    r = combine(SPEC, [report(0, ok_local, hung), report(1, ok_local, refused)], JOB)
    assert (r.status, r.cause) == ("error", "inter_node")
    assert ("node_cause", "nccl_error") in r.extra

    r = combine(SPEC, [report(0, ok_local, hung), report(1, ok_local, hung)], JOB)
    assert (r.status, r.cause) == (TIMEOUT, "inter_node")

    # node 1 hung; stopping it closed node 0's link: node 0's error only echoes the hang
    echo = ProbeResult(SPEC.candidate, "error", 6.1, "worker_error",
                       "rank 0: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]")
    r = combine(SPEC, [report(0, ok_local, echo), report(1, ok_local, hung)], JOB)
    assert (r.status, r.cause) == (TIMEOUT, "inter_node") and "[1]" in r.detail
    r = combine(SPEC, [report(0, ok_local, echo), report(1, ok_local, echo)], JOB)
    assert (r.status, r.cause) == ("error", "inter_node")

    r = combine(SPEC, [report(0, ok_local, ok_cross), report(1, ok_local, None)], JOB)
    assert (r.status, r.cause) == ("error", "inter_node")  # node 1 never joined

    r = combine(SPEC, [report(0, ok_local, ok_cross), report(1, ok_local, ok_cross)], JOB)
    assert r.ok and r.bus_bandwidth_gbps == 9.5 and r.step_seconds == 0.02 and r.ranks == 4
    assert ("nodes", "2") in r.extra and ("route/1", "ib0") in r.extra
    assert ("inter_node_bus_gbps", "9.5") in r.extra and ("local_bus_gbps", "100") in r.extra


def mn_opts(facts, env, **kw):  # type: ignore[no-untyped-def]
    base = dict(framework="torch", global_batch_size=512, devices=None, probe=None, timeout=2.0,
                prefer=None, dry_run=False, model=None, gradient_bytes=100 << 20,
                sample_seconds=0.01, max_per_replica_batch=None, rules=(), disable_rules=(),
                cache=False, cache_dir=None, cache_ttl=None, precision="auto", logical_cpus=0)
    base.update(kw)
    return multinode.multinode_options(options_from(facts, env, Arguments.from_kwargs(**base)), facts)


def test_remedies_between_nodes_follow_plain_nccl_and_respect_the_users_variables() -> None:
    facts = machine(2, nvlink=18, env=TORCHRUN)
    opts = mn_opts(facts, TORCHRUN)
    nccl = "torch:nccl:0,1"
    failed = ProbeResult(nccl, TIMEOUT, 2.0, "inter_node", "between nodes")
    p = plan(facts, opts.rules, {nccl: failed}, opts)
    assert p.next_probe is not None and dict(p.next_probe.env) == {"NCCL_SOCKET_IFNAME": ROUTE}
    p = plan(facts, opts.rules, {nccl: failed, p.next_probe.key: failed}, opts)
    assert p.next_probe is not None and dict(p.next_probe.env) == {
        "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": ROUTE}
    assert not any(dict(r.candidate.env).get("NCCL_P2P_DISABLE") for r in p.ranked)

    user = {**TORCHRUN, "NCCL_SOCKET_IFNAME": "ens5"}
    facts = machine(2, nvlink=18, env=user)
    opts = mn_opts(facts, user)
    p = plan(facts, opts.rules, {nccl: failed}, opts)
    assert p.next_probe is not None and dict(p.next_probe.env) == {
        "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"}
    # a CPU-only node has no NCCL to remedy
    cpu = machine(0, torch_cuda=None, torch_nccl=None, env=TORCHRUN)
    assert not any(r.origin == "multinode" for r in mn_opts(cpu, TORCHRUN).rules)


def test_node_values_resolve_the_route_placeholder_per_node() -> None:
    env = {"MASTER_ADDR": "127.0.0.1"}
    assert routes.node_values({"NCCL_SOCKET_IFNAME": ROUTE, "X": "1"}, env)[
        "NCCL_SOCKET_IFNAME"] in ("lo", *routes.local_addresses())
    assert routes.node_values({"NCCL_SOCKET_IFNAME": ROUTE}, {}) == {}


def test_contradictions_name_what_this_node_lacks() -> None:
    nccl = Candidate("torch", "nccl", (0, 1), num_replicas=4)
    leader = NodeSummary(0, gpus=2)
    assert contradictions(machine(2), "torch", nccl, leader) == []
    assert "no GPU" in contradictions(machine(0), "torch", nccl, leader)[0]
    assert "1 GPU(s)" in contradictions(machine(1), "torch", nccl, leader)[0]
    assert "node 0 sees 2" in contradictions(machine(4), "torch", nccl, leader)[0]
    assert "CPU-only" in contradictions(machine(2, torch_cuda=None), "torch", nccl, leader)[0]
    assert "no NCCL" in contradictions(machine(2, torch_nccl=None), "torch", nccl, leader)[0]
    # node 0 alone, or gloo between CPU processes: nothing on this node to contradict
    assert contradictions(machine(0), "torch", Candidate("torch", "cpu", ()), leader) == []
    gloo = Candidate("torch", "gloo", (), num_replicas=4)
    assert contradictions(machine(0), "torch", gloo, leader) == []


# --------------------------------------------------------------------------------------------
# The protocol, for real over a TCPStore: one thread per node's local rank 0
# --------------------------------------------------------------------------------------------
torch_dist = pytest.importorskip("torch.distributed")


@pytest.fixture
def store() -> Any:
    return torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def node_env(store: Any, node: int, nodes: int = 2, local: int = 2,
             port: int | None = None) -> dict[str, str]:
    """torchrun's variables for ``node``'s local rank 0; with ``port``, no agent store: global
    rank 0 hosts the store on MASTER_PORT itself."""
    env = {"WORLD_SIZE": str(nodes * local), "LOCAL_WORLD_SIZE": str(local),
           "RANK": str(node * local), "LOCAL_RANK": "0", "GROUP_RANK": str(node),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port or store.port),
           "TORCHELASTIC_RUN_ID": f"t{id(store)}"}
    if port is None:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return env


def run_nodes(
    store: Any, facts_by_node: list[Any], local: FakeProber, cross: FakeProber,
    skip: tuple[int, ...] = (), nodes_local: int = 2, port: int | None = None,
) -> dict[int, Any]:
    """Every node's agreed_decision in its own thread; node -> (plan...) or the exception."""
    out: dict[int, Any] = {}
    lock = threading.Lock()

    def cross_prober(spec: ProbeSpec, env: Mapping[str, str], job: Job, prefix: str,
                     stop: Any) -> ProbeResult:
        with lock:
            return cross(spec, env)

    def one(node: int) -> None:
        env = node_env(store, node, len(facts_by_node), nodes_local, port)
        facts = facts_by_node[node]
        opts = options_from(facts, env, Arguments.from_kwargs(framework="torch", global_batch_size=512, devices=None,
                            probe=None, timeout=2.0, prefer=None, dry_run=False, model=None,
                            gradient_bytes=100 << 20, sample_seconds=0.01,
                            max_per_replica_batch=None, rules=(), disable_rules=(), cache=False,
                            cache_dir=None, cache_ttl=None, precision="auto", logical_cpus=0))
        try:
            out[node] = multinode.agreed_decision(
                facts, opts, env, local, lambda: 0.0, decide, cross_prober=cross_prober)
        except Exception as exc:
            out[node] = exc

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(facts_by_node))
               if k not in skip]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return out


@pytest.fixture
def short_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multinode, "MARGIN_FLOOR_S", 1.0)


@pytest.mark.torch
def test_nodes_agree_on_the_remedy_proven_between_them(store: Any, short_margin: None) -> None:
    h200 = machine(2, nvlink=18)
    local = FakeProber()  # every local group works
    cross = FakeProber({"nccl": "timeout", "nccl+*": "ok"})  # NCCL's own pick hangs
    out = run_nodes(store, [h200, h200], local, cross)
    chosen = {k: v.plan.chosen for k, v in out.items()}
    assert all(c is not None for c in chosen.values()), out
    keys = {c.key for c in chosen.values()}
    assert len(keys) == 1  # no split
    c = chosen[0]
    assert c.backend == "nccl" and c.num_replicas == 4
    assert dict(c.env) == {"NCCL_SOCKET_IFNAME": ROUTE}
    # each node proved its local group, then joined the group across nodes, in every round
    assert sorted(cross.probed) == ["nccl", "nccl", "nccl+NCCL_SOCKET_IFNAME=lo",
                                    "nccl+NCCL_SOCKET_IFNAME=lo"]
    assert [s.world_size for s in local.calls] == [2] * 4
    for made in out.values():
        results, proven = made.results, made.proven
        assert proven and results[c.key].ok and ("nodes", "2") in results[c.key].extra


@pytest.mark.torch
def test_without_an_agent_store_rank_0_hosts_one_for_the_process_group_to_reuse(
    store: Any, short_margin: None
) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    h200 = machine(2, nvlink=18)
    out = run_nodes(store, [h200, h200], FakeProber(), FakeProber(), port=port)
    assert {v.plan.chosen.key for v in out.values()} == {"torch:nccl:0,1"}, out
    hosted = [s for s in nodestore.HOSTED if s.port == port]
    assert len(hosted) == 1  # kept alive: init_process_group(env://) on rank 0 reuses it
    # what torch's env:// rendezvous does on rank 0 without an agent store
    again = torch_dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,
                                wait_for_workers=False)
    again.set("k", "v")
    assert hosted[0].get("k") == b"v"


@pytest.mark.torch
def test_no_backend_between_nodes_leaves_node_0_alone(store: Any, short_margin: None) -> None:
    h200 = machine(2, nvlink=18)
    local = FakeProber()
    out = run_nodes(store, [h200, h200], local, FakeProber({"*": "timeout"}))
    for p in (made.plan for made in out.values()):
        # issue 31: node 0 keeps its own GPUs (NCCL inside the node, proven by node 0 alone),
        # not one GPU of the whole job; every node agrees on it
        assert p.chosen is not None and p.chosen.node_local and p.chosen.backend == "nccl"
        assert p.chosen.devices == (0, 1) and p.chosen.num_replicas == 2
        assert p.chosen.accumulation_steps == 2  # 512 = 2 x 128 x 2: the global batch kept
    assert "nccl" in local.probed  # the node-local probe ran on node 0 alone, no round


@pytest.mark.torch
def test_node_0_alone_falls_to_one_gpu_only_when_its_own_nccl_fails(
        store: Any, short_margin: None) -> None:
    h200 = machine(2, nvlink=18)
    out = run_nodes(store, [h200, h200], FakeProber({"nccl": "error:nccl_error", "*": "error:nccl_error"}),
                    FakeProber({"*": "timeout"}))
    for p in (made.plan for made in out.values()):
        assert p.chosen is not None and p.chosen.backend == "single_device"
        assert p.chosen.accumulation_steps == 4  # 512 = 1 x 128 x 4


@pytest.mark.torch
def test_a_node_with_other_gpus_stops_every_node(store: Any, short_margin: None) -> None:
    out = run_nodes(store, [machine(2, nvlink=18), machine(4, nvlink=18)], FakeProber(),
                    FakeProber())
    assert isinstance(out[1], NodeMismatchError) and isinstance(out[0], NodeMismatchError)
    assert "node 0 sees 2" in str(out[0])


@pytest.mark.torch
def test_a_node_that_never_joins_stops_node_0(store: Any, short_margin: None) -> None:
    h200 = machine(2, nvlink=18)
    out = run_nodes(store, [h200, h200], FakeProber(), FakeProber(), skip=(1,))
    assert isinstance(out[0], NodeLostError) and (out[0].node, out[0].how) == (1, "deadline")


@pytest.mark.torch
def test_a_node_that_stops_beating_is_lost_before_the_deadline(
    store: Any, short_margin: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nodestore, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(nodestore, "HEARTBEAT_STALE_S", 0.5)
    job1 = Job.from_env(node_env(store, 1))
    assert job1 is not None
    # node 1 joins and beats for a moment, then dies before its part of the first probe
    client = torch_dist.TCPStore("127.0.0.1", store.port, is_master=False)
    nodestore.Channel(client, job1.prefix).put("hello/1", {"node": 1, "gpus": 2})
    with nodestore.Heartbeat(client, job1.prefix, 1):
        time.sleep(0.3)
    h200 = machine(2, nvlink=18)
    out = run_nodes(store, [h200, h200], FakeProber(), FakeProber(), skip=(1,))
    # lost by its silent heartbeat, not by the end of the wait ("deadline")
    assert isinstance(out[0], NodeLostError) and (out[0].node, out[0].how) == (1, "heartbeat")


@pytest.mark.torch
def test_fault_records_for_the_supervisor(store: Any) -> None:
    job = Job.from_env(node_env(store, 1))
    assert job is not None
    assert nodestore.recorded_faults(store, job) == {}
    nodestore.record_fault(store, job, {"backend": "nccl", "cause": "timeout"})
    assert nodestore.recorded_faults(store, job) == {
        1: {"backend": "nccl", "cause": "timeout", "node": 1}}


@pytest.mark.torch
def test_other_local_ranks_take_their_nodes_decision_or_its_error(
    store: Any, short_margin: None, tmp_path: Any
) -> None:
    from resilient_strategy.errors import MultiNodeError
    from resilient_strategy.nodes.onenode import Agreement

    h200 = machine(2, nvlink=18)
    env = {**node_env(store, 1), "RANK": "3", "LOCAL_RANK": "1"}
    opts = options_from(h200, env, Arguments.from_kwargs(framework="torch", global_batch_size=512, devices=None,
                        probe=None, timeout=2.0, prefer=None, dry_run=False, model=None,
                        gradient_bytes=100 << 20, sample_seconds=0.01, max_per_replica_batch=None,
                        rules=(), disable_rules=(), cache=True, cache_dir=tmp_path,
                        cache_ttl=None, precision="auto", logical_cpus=0))
    local = Agreement.for_job(env, h200.fingerprint(), tmp_path)
    key = "torch:nccl:0,1"
    ok = ProbeResult(key, OK, 1.0, bus_bandwidth_gbps=10.0, ranks=4, extra=(("nodes", "2"),))
    local.publish({"chosen": key, "results": {key: ok.to_dict()}, "proven": True,
                   "from_cache": False, "multinode_trace": ["Node 1 of 2: ..."]})
    made = multinode.agreed_decision(h200, opts, env, FakeProber(), lambda: 0.0, decide)
    p = made.plan
    assert p.chosen is not None and p.chosen.key == key and made.proven and made.results[key].ok
    assert p.trace[-1] == "Node 1 of 2: ..."
    local.publish({"chosen": None, "results": {}, "proven": False, "from_cache": False,
                   "error": "node 0 is gone"})
    with pytest.raises(MultiNodeError):
        multinode.agreed_decision(h200, opts, env, FakeProber(), lambda: 0.0, decide)


@pytest.mark.torch
def test_a_node_with_another_nccl_is_named_before_any_probe_and_keeps_nccl_off_the_link(
        store: Any, short_margin: None) -> None:
    # issue 31: node 1's torch carries another NCCL; its facts cross the job's store and node 0
    # compares them before any probe: a typed finding naming node 1 and both versions, NCCL
    # between the nodes ruled out (never probed), every node agreeing
    local, cross = FakeProber(), FakeProber()
    out = run_nodes(store, [machine(2, nvlink=18), machine(2, nvlink=18, torch_nccl="2.27.3")],
                    local, cross)
    keys = set()
    for made in out.values():
        found = {e.finding.id: e for e in made.plan.events if e.kind == "nodes_differ"}
        event = found["nodes-nccl-version"]
        f = event.finding
        assert (f.nodes, dict(f.values), f.effect) == ((1,), {0: "2.28.9", 1: "2.27.3"},
                                                       "rule_out")
        assert "torch:nccl:0,1" in {c.key for c in event.ruled_out}
        assert made.plan.chosen is not None and not (
            made.plan.chosen.backend == "nccl" and not made.plan.chosen.node_local)
        keys.add(made.plan.chosen.key)
    assert len(keys) == 1  # no split
    assert not [k for k in cross.probed if k.startswith("nccl")]  # never probed across nodes


@pytest.mark.torch
def test_a_node_with_other_nccl_settings_is_named_and_nccl_still_proven(
        store: Any, short_margin: None) -> None:
    node0 = machine(2, nvlink=18, env={"NCCL_IB_HCA": "mlx5_0"})
    node1 = machine(2, nvlink=18, env={"NCCL_IB_HCA": "mlx5_1", "NCCL_DEBUG": "INFO"})
    cross = FakeProber()
    out = run_nodes(store, [node0, node1], FakeProber(), cross)
    for made in out.values():
        found = [e.finding for e in made.plan.events if e.kind == "nodes_differ"]
        assert [(f.id, f.nodes, f.variables, f.effect) for f in found] == [
            ("nodes-nccl-ib-settings", (1,), ("NCCL_IB_HCA",), "warn")]  # NCCL_DEBUG: logs only
        assert dict(found[0].values) == {0: "NCCL_IB_HCA=mlx5_0", 1: "NCCL_IB_HCA=mlx5_1"}
        assert made.plan.chosen is not None and made.plan.chosen.key == "torch:nccl:0,1"
    assert "nccl" in cross.probed  # a warning: the probe between the nodes still decides
