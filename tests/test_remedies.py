"""Remedies through the testing kit: composed on a new cause (bounded), the loopback interface
for network causes and set-up hangs on one node, bad values, hangs judged from progress."""

from __future__ import annotations

from pathlib import Path

from resilient_strategy.core.measures.probe import TIMEOUT, ProbeResult
from resilient_strategy.core.trace.event import Note
from resilient_strategy.core.trace.inputs import FactsSeen
from resilient_strategy.core.trace.ruling import RemedyQueued, RuleFired
from resilient_strategy.deciding.decide import still_valid
from resilient_strategy.testing import FakeProber, machine, simulate

H200X2 = machine(2, nvlink=18, env={"WORLD_SIZE": "2"})  # under torchrun
KW = {"global_batch_size": 64, "gradient_bytes": 1000, "sample_seconds": 1.0}


def test_a_remedy_failing_on_another_cause_gets_that_remedy_on_top() -> None:
    prober = FakeProber({
        "nccl": "timeout",
        "nccl+NCCL_P2P_DISABLE=1": "error:shared_memory",
        "nccl+NCCL_P2P_DISABLE=1,NCCL_SHM_DISABLE=1": "ok:3.8",
    })
    sel = simulate(H200X2, prober, **KW)
    assert prober.probed == ["nccl", "nccl+NCCL_P2P_DISABLE=1",
                             "nccl+NCCL_P2P_DISABLE=1,NCCL_SHM_DISABLE=1"]
    assert sel.backend == "nccl"
    assert dict(sel.candidate.env) == {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
    assert sel.candidate.origin == "after shared_memory"
    queued = [e for e in sel.plan.events if isinstance(e, RemedyQueued)]
    assert [(e.candidate.key, e.cause, e.on_top_of.key if e.on_top_of else None)
            for e in queued] == [
        ("torch:nccl:0,1:NCCL_P2P_DISABLE=1", "timeout", None),
        ("torch:nccl:0,1:NCCL_P2P_DISABLE=1;NCCL_SHM_DISABLE=1", "shared_memory",
         "torch:nccl:0,1:NCCL_P2P_DISABLE=1"),
    ]


def test_composition_is_bounded_and_never_repeats_a_cause() -> None:
    prober = FakeProber({
        "nccl": "error:cuda_error",  # remedies: P2P off, then P2P and SHM off
        "nccl+NCCL_P2P_DISABLE=1": "error:nccl_network",  # -> P2P off + loopback
        "nccl+NCCL_P2P_DISABLE=1,NCCL_SOCKET_IFNAME=lo": "error:shared_memory",  # -> + SHM off
        "nccl+NCCL_P2P_DISABLE=1,NCCL_SHM_DISABLE=1": "error:shared_memory",  # -> SHM already
        "nccl+NCCL_P2P_DISABLE=1,NCCL_SHM_DISABLE=1,NCCL_SOCKET_IFNAME=lo": "error:cuda_error",
        "gloo": "ok",
    })
    sel = simulate(H200X2, prober, **KW)
    nccl = [p for p in prober.probed if p.startswith("nccl")]
    assert len(nccl) == len(set(nccl))
    assert all(p.count("=") <= 3 for p in nccl)
    assert "nccl+NCCL_P2P_DISABLE=1,NCCL_SHM_DISABLE=1,NCCL_SOCKET_IFNAME=lo" in nccl
    assert "nccl+NCCL_P2P_DISABLE=1,NCCL_SOCKET_IFNAME=lo" in nccl
    assert sel.backend == "gloo"


def test_a_remedy_that_hangs_or_fails_the_same_way_is_not_remedied_again() -> None:
    prober = FakeProber({"nccl": "error:shared_memory", "nccl+*": "error:shared_memory",
                         "gloo": "ok"})
    simulate(H200X2, prober, **KW)
    assert prober.probed == ["nccl", "nccl+NCCL_SHM_DISABLE=1", "gloo"]
    prober = FakeProber({"nccl": "error:shared_memory", "nccl+*": "timeout", "gloo": "ok"})
    simulate(H200X2, prober, **KW)
    assert prober.probed == ["nccl", "nccl+NCCL_SHM_DISABLE=1", "gloo"]


def test_a_network_cause_on_one_node_gets_the_loopback_interface() -> None:
    prober = FakeProber({"nccl": "error:nccl_network", "nccl+NCCL_SOCKET_IFNAME=lo": "ok"})
    sel = simulate(H200X2, prober, **KW)
    assert prober.probed == ["nccl", "nccl+NCCL_SOCKET_IFNAME=lo"]
    assert sel.env.get("NCCL_SOCKET_IFNAME") == "lo"


def test_a_user_interface_choice_is_never_replaced() -> None:
    facts = machine(2, nvlink=18, env={"WORLD_SIZE": "2", "NCCL_SOCKET_IFNAME": "eth9"})
    prober = FakeProber({"nccl": "error:nccl_network", "gloo": "ok"})
    simulate(facts, prober, **KW)
    assert prober.probed == ["nccl", "gloo"]


def test_a_hang_in_communicator_setup_tries_loopback_first() -> None:
    prober = FakeProber({"nccl": "hang:setup", "nccl+NCCL_SOCKET_IFNAME=lo": "ok"})
    sel = simulate(H200X2, prober, **KW)
    assert prober.probed == ["nccl", "nccl+NCCL_SOCKET_IFNAME=lo"]
    assert sel.candidate.origin == "after a hang in communicator set-up"
    # a hang inside a collective is P2P's classic sign: the usual remedy
    prober = FakeProber({"nccl": "hang:collective", "nccl+NCCL_P2P_DISABLE=1": "ok"})
    simulate(H200X2, prober, **KW)
    assert prober.probed == ["nccl", "nccl+NCCL_P2P_DISABLE=1"]


def test_nan_and_zero_results_try_p2p_off() -> None:
    for cause in ("nan_result", "zero_result"):
        prober = FakeProber({"nccl": f"error:{cause}", "nccl+NCCL_P2P_DISABLE=1": "ok"})
        sel = simulate(H200X2, prober, **KW)
        assert prober.probed == ["nccl", "nccl+NCCL_P2P_DISABLE=1"]
        failed = sel.results[next(iter(sel.results))]
        assert failed.cause == cause and "ACS" in failed.why()


def test_a_hang_judged_from_progress_is_cut_early_and_stays_cached(tmp_path: Path) -> None:
    outcomes = {"nccl": "hang:straggler", "nccl+*": "hang:collective", "gloo": "ok"}
    for _ in range(2):  # a failure is trusted from the cache once two runs saw it
        prober = FakeProber(outcomes)
        simulate(H200X2, prober, cache=True, cache_dir=tmp_path, timeout=30, **KW)
        assert prober.elapsed_s < 2 * 30  # two hangs, each cut well before its 30 s
    again = FakeProber({"gloo": "ok"})  # cut at 8 s of a 30 s timeout, and still trusted
    sel = simulate(H200X2, again, cache=True, cache_dir=tmp_path, timeout=30, **KW)
    assert again.probed == [] and sel.backend == "gloo"
    cut = ProbeResult("k", TIMEOUT, 4.0, "timeout", extra=(("hang", "setup"),))
    deadline = ProbeResult("k", TIMEOUT, 4.0, "timeout")
    assert set(still_valid({"a": cut, "b": deadline}, 30.0)) == {"a"}


# ----- advice that must reach the user -------------------------------------------------------
def test_advice_survives_when_an_earlier_rule_already_vetoed_the_candidates() -> None:
    # NCCL 2.20.5 on an RTX 5090: the Blackwell NCCL rule vetoes nccl first; the sm_120 rule
    # then finds nothing left to veto, and its advice (NCCL >= 2.26.2) must still be said
    facts = machine(2, name="NVIDIA GeForce RTX 5090", cc=(12, 0), torch="2.7.0",
                    torch_cuda="12.8", torch_nccl="2.20.5", env={"WORLD_SIZE": "2"})
    sel = simulate(facts, framework="torch", global_batch_size=64)
    fired = {e.rule: e for e in sel.plan.events if isinstance(e, RuleFired)}
    assert fired["torch-nccl-before-blackwell"].action == "veto"
    late = fired["nccl-sm120-needs-2.26.2"]
    assert (late.action, late.targets) == ("already_ruled_out", ("nccl",))
    assert "2.26.2" in late.message and late.text()  # it reaches the rendered trace


def test_a_tensorflow_build_without_kernels_says_which_tensorflow_to_install() -> None:
    facts = machine(2, name="NVIDIA GeForce GTX 980", cc=(5, 2), torch=None, torch_cuda=None,
                    torch_nccl=None, tensorflow="2.21.0", tf_cuda="12.5",
                    tf_archs=("sm_60", "sm_70", "sm_80", "sm_89", "compute_90"))
    sel = simulate(facts, framework="tensorflow", global_batch_size=64)
    assert sel.backend == "cpu"
    vetoed = {r.candidate.backend for r in sel.plan.ruled_out if r.rule == "tf-no-kernels-for-gpu"}
    assert "hierarchical_copy" in vetoed and "single_device" in vetoed
    rule = next(r for r in sel.plan.ruled_out if r.rule == "tf-no-kernels-for-gpu")
    assert "cuda_compute_capabilities" in rule.reason and "TensorFlow 2.16" in rule.reason


def test_rules_can_key_on_the_driver_version_and_the_trace_shows_it() -> None:
    from resilient_strategy.core.knowledge.rules import rule_from_dict

    rule = rule_from_dict({"id": "p2p-regression-driver", "when": [
        "gpus.count >= 2", "driver.version >= 570", "driver.version < 571"],
        "effect": "remedy", "env": {"NCCL_P2P_DISABLE": "1"}, "first": True,
        "message": "P2P regression in this driver branch", "source": "test"})
    bad = machine(2, driver="570.86.10", env={"WORLD_SIZE": "2"})
    good = machine(2, driver="580.159.04", env={"WORLD_SIZE": "2"})
    p1 = FakeProber()
    sel = simulate(bad, p1, rules=[rule], **KW)
    assert p1.probed[0] == "nccl+NCCL_P2P_DISABLE=1" and sel.env == {"NCCL_P2P_DISABLE": "1"}
    seen = [e for e in sel.plan.events if isinstance(e, FactsSeen)]
    assert [e.driver for e in seen] == ["570.86.10"]
    p2 = FakeProber()
    simulate(good, p2, rules=[rule], **KW)
    assert p2.probed == ["nccl"]


# ----- stable choices ------------------------------------------------------------------------
def _tf_results(hc: float, rod: float, spread: float) -> dict[str, ProbeResult]:
    from resilient_strategy.core.measures.probe import OK

    return {
        "hierarchical_copy": ProbeResult("x", OK, 2.0, bus_bandwidth_gbps=hc,
                                         bandwidth_spread=spread),
        "reduction_to_one_device": ProbeResult("x", OK, 2.0, bus_bandwidth_gbps=rod,
                                               bandwidth_spread=spread),
        "nccl": ProbeResult("x", "error", 1.0, "backend_unavailable"),
    }


def test_speeds_within_the_measured_noise_keep_the_chains_order() -> None:
    facts = machine(0, torch=None, torch_cuda=None, torch_nccl=None, tensorflow="2.21.0")
    for hc, rod in ((0.8, 0.9), (0.9, 0.8), (0.7, 0.95)):  # flips seen under load
        sel = simulate(facts, FakeProber(_tf_results(hc, rod, spread=0.5)),  # type: ignore[arg-type]
                       framework="tensorflow", global_batch_size=64, logical_cpus=2,
                       gradient_bytes=100 << 20, sample_seconds=1.0)
        assert sel.backend == "hierarchical_copy", (hc, rod)
    assert [e.topic for e in sel.plan.events if isinstance(e, Note)].count("within_noise") == 1
    sel = simulate(facts, FakeProber(_tf_results(0.3, 0.9, spread=0.2)),  # type: ignore[arg-type]
                   framework="tensorflow", global_batch_size=64, logical_cpus=2,
                   gradient_bytes=100 << 20, sample_seconds=1.0)
    assert sel.backend == "reduction_to_one_device"  # 3x faster is beyond 20 % noise


# ----- measured TensorFlow cross-device evidence --------------------------------------------
def test_hierarchical_copy_is_never_chosen_for_an_odd_replica_count() -> None:
    # benchmarks/verify_tf_cross_device.py: exact on 1, 2, 4, 6, 8 replicas, wrong on 3, 5, 7
    cpu_only = machine(0, torch=None, torch_cuda=None, torch_nccl=None, tensorflow="2.21.0")
    rid = "tf-hierarchical-copy-odd-replicas"
    for n, vetoed in ((2, False), (3, True), (4, False), (5, True), (7, True), (8, False)):
        sel = simulate(cpu_only, framework="tensorflow", global_batch_size=840 * 8,
                       logical_cpus=n, probe="never")
        assert (rid in {r.rule for r in sel.plan.ruled_out}) is vetoed, n
        assert sel.backend != "hierarchical_copy" or not vetoed
    three = machine(3, tensorflow="2.21.0", tf_cuda="12.5", torch=None, torch_cuda=None,
                    torch_nccl=None)
    prober = FakeProber({"nccl": "error:nccl_error", "nccl+*": "error:nccl_error"})
    sel = simulate(three, prober, framework="tensorflow", global_batch_size=96)
    assert "hierarchical_copy" not in prober.probed
    assert sel.backend == "reduction_to_one_device"
    rule = next(r for r in sel.plan.ruled_out if r.rule == rid)
    assert "1 + 2 = 3" in rule.reason


# ----- a silent hang steers the remedy search by the machine's facts (issue 31) --------------
def _queued(sel: object) -> list[tuple[str, str, tuple[str, ...]]]:
    events = sel.plan.events  # type: ignore[attr-defined]
    return [(e.remedy, e.cause, e.because) for e in events if isinstance(e, RemedyQueued)]


def test_a_silent_hang_on_nvswitch_tries_nvls_off_first_and_says_why() -> None:
    facts = machine(8, name="NVIDIA H100 80GB HBM3", nvlink=18, torch_nccl="2.21.5",
                    env={"WORLD_SIZE": "8"}, platform_facts={"nvswitch": True})
    prober = FakeProber({"nccl": "hang:collective", "nccl+NCCL_NVLS_ENABLE=0": "ok:300",
                         "nccl+*": "hang:collective"})
    sel = simulate(facts, prober, **KW)
    assert prober.probed == ["nccl", "nccl+NCCL_NVLS_ENABLE=0"]
    assert dict(sel.env) == {"NCCL_NVLS_ENABLE": "0"}
    queued = _queued(sel)
    assert queued[0] == ("nvls-off", "timeout", ("platform.nvswitch", "nccl.version >= 2.17"))
    assert [q[0] for q in queued] == ["nvls-off", "p2p-off"]  # nothing the facts rule out


def test_a_hang_on_a_plain_pcie_machine_keeps_the_one_remedy_it_had() -> None:
    prober = FakeProber({"nccl": "timeout", "nccl+NCCL_P2P_DISABLE=1": "ok:10"})
    sel = simulate(machine(2, env={"WORLD_SIZE": "2"}), prober, **KW)
    assert [q[0] for q in _queued(sel)] == ["p2p-off"]
    assert prober.probed == ["nccl", "nccl+NCCL_P2P_DISABLE=1"]


def test_a_host_bridge_path_between_switched_pairs_tries_the_p2p_level_before_p2p_off() -> None:
    switched = {"0-1": {"topology": "multiple"}, "2-3": {"topology": "multiple"}}
    facts = machine(4, name="Tesla V100-PCIE-32GB", cc=(7, 0), topology="hostbridge",
                    links=switched, torch_cuda="12.8", env={"WORLD_SIZE": "4"})
    prober = FakeProber({"nccl": "timeout", "nccl+NCCL_P2P_LEVEL=PXB": "ok:10",
                         "nccl+*": "timeout"})
    sel = simulate(facts, prober, **KW)
    assert [q[0] for q in _queued(sel)] == ["p2p-below-switches", "p2p-off"]
    assert dict(sel.env) == {"NCCL_P2P_LEVEL": "PXB"}
    # with the IOMMU on every peer copy is translated: P2P off, not a level
    iommu = machine(4, name="Tesla V100-PCIE-32GB", cc=(7, 0), topology="hostbridge",
                    links=switched, iommu="on", torch_cuda="12.8", env={"WORLD_SIZE": "4"})
    sel = simulate(iommu, FakeProber({"nccl": "timeout", "nccl+NCCL_P2P_DISABLE=1": "ok:7"}),
                   **KW)
    assert "p2p-below-switches" not in [q[0] for q in _queued(sel)]


def test_a_hang_between_nodes_over_roce_with_several_nics_tries_the_ib_transport() -> None:
    env = {"WORLD_SIZE": "16", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8",
           "GROUP_RANK": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    facts = machine(8, name="NVIDIA A100-SXM4-80GB", cc=(8, 0), nvlink=12, infiniband=True,
                    env=env, platform_facts={"rdma_link_layer": "ethernet",
                                             "rdma_devices": ["mlx5_0", "mlx5_1"],
                                             "master_ifname": "eth0"})
    prober = FakeProber({"nccl": "hang:collective", "nccl+*": "hang:collective",
                         "nccl+NCCL_IB_DISABLE=1": "ok:1"})
    sel = simulate(facts, prober, timeout=600, **KW)
    assert [q[0] for q in _queued(sel)] == [
        "ib-gid-index", "ib-hca", "cross-nic-several-nics", "ib-off-between-nodes", "p2p-off"]
    assert dict(sel.env) == {"NCCL_IB_DISABLE": "1"}
    # the same hang on one node with one NIC: none of the network remedies
    one = machine(8, name="NVIDIA A100-SXM4-80GB", cc=(8, 0), nvlink=12, infiniband=True,
                  env={"WORLD_SIZE": "8"}, platform_facts={"rdma_link_layer": "ethernet",
                                                           "rdma_devices": ["mlx5_0"]})
    sel = simulate(one, FakeProber({"nccl": "hang:collective",
                                    "nccl+NCCL_P2P_DISABLE=1": "ok:20"}), **KW)
    assert [q[0] for q in _queued(sel)] == ["p2p-off"]


def test_a_hang_with_the_hostname_on_loopback_tries_the_socket_interface() -> None:
    facts = machine(2, env={"WORLD_SIZE": "2"}, platform_facts={"hostname_loopback": True})
    prober = FakeProber({"nccl": "timeout", "nccl+NCCL_SOCKET_IFNAME=lo": "ok:20",
                         "nccl+*": "timeout"})
    sel = simulate(facts, prober, **KW)
    assert [q[0] for q in _queued(sel)] == ["socket-ifname-hostname-loopback", "p2p-off"]
    assert dict(sel.env) == {"NCCL_SOCKET_IFNAME": "lo"}
