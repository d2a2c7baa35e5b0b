"""testing.fakes: gpu() and machine() describe what detect_facts() would report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from resilient_strategy.core.knowledge.clauses import fact_values
from resilient_strategy.core.trace.choosing import Chosen
from resilient_strategy.core.trace.event import Note
from resilient_strategy.core.trace.inputs import FactsSeen
from resilient_strategy.core.trace.ruling import CandidateRuledOut
from resilient_strategy.errors import FrameworkInitializedError, InvalidOptionError
from resilient_strategy.testing import FakeProber, gpu, machine, simulate

MACHINES = Path(__file__).parents[1] / "examples" / "machines"


def test_cuda_visible_devices_picks_and_renumbers_the_gpus() -> None:
    f = machine(4, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert [(g.index, g.physical_index) for g in f.gpus] == [(0, 0)]
    assert f.visibility.raw == "0" and f.visibility.physical == (0,)
    assert f.links == ()
    f = machine(4, env={"CUDA_VISIBLE_DEVICES": "3,1"})
    assert [(g.index, g.physical_index, g.uuid) for g in f.gpus] == [
        (0, 3, "GPU-fake-0003"), (1, 1, "GPU-fake-0001")]
    assert f.visibility.physical == (3, 1)
    assert [(ln.a, ln.b) for ln in f.links] == [(0, 1)]
    assert f.env_map == {"CUDA_VISIBLE_DEVICES": "3,1"}


def test_unset_cuda_visible_devices_shows_every_gpu() -> None:
    f = machine(3)
    assert [(g.index, g.physical_index) for g in f.gpus] == [(0, 0), (1, 1), (2, 2)]
    assert f.visibility.raw is None and f.visibility.physical == (0, 1, 2)
    assert [(ln.a, ln.b) for ln in f.links] == [(0, 1), (0, 2), (1, 2)]


def test_an_empty_cuda_visible_devices_hides_every_gpu_but_nvml_still_works() -> None:
    f = machine(2, env={"CUDA_VISIBLE_DEVICES": ""})
    assert f.gpus == () and f.links == ()
    assert f.nvml_error is None and f.driver_version is not None
    assert f.visibility.notes


def test_visible_devices_decide_the_plan() -> None:
    sel = simulate(machine(4, env={"CUDA_VISIBLE_DEVICES": "2"}),
                   framework="torch", global_batch_size=32)
    assert sel.backend == "single_device" and sel.devices == (0,)
    seen = [e for e in sel.plan.events if isinstance(e, FactsSeen)]
    assert [e.gpus for e in seen] == [1] and sel.accumulation_steps == 1


def test_links_override_nvlink_per_pair_of_physical_gpus() -> None:
    pairs = {(0, 1): 4, (2, 3): 4, (4, 5): 4, (6, 7): 4}
    f = machine(8, name="NVIDIA RTX A6000", cc=(8, 6), links=pairs)
    assert f.link(0, 1) is not None and f.link(0, 1).nvlinks == 4  # type: ignore[union-attr]
    assert f.link(1, 0).p2p_nvlink == "ok"  # type: ignore[union-attr]
    assert f.link(1, 2).nvlinks == 0 and f.link(1, 2).p2p_nvlink == "not_supported"  # type: ignore[union-attr]
    assert sum(ln.nvlinks > 0 for ln in f.links) == 4 and len(f.links) == 28
    values = fact_values(f, "torch")
    assert values["links.any_pcie_only"] and not values["links.all_nvlink"]
    # the JSON spelling is the same machine
    assert machine(8, name="NVIDIA RTX A6000", cc=(8, 6),
                   links={f"{a}-{b}": n for (a, b), n in pairs.items()}) == f
    # links name physical GPUs: after CUDA_VISIBLE_DEVICES=3,2 the pair (2, 3) is ordinals 0-1
    sub = machine(8, links=pairs, env={"CUDA_VISIBLE_DEVICES": "3,2"})
    assert sub.link(0, 1).nvlinks == 4  # type: ignore[union-attr]
    # nvlink stays the default for pairs not listed
    assert machine(3, nvlink=12, links={(0, 2): 0}).link(0, 1).nvlinks == 12  # type: ignore[union-attr]
    assert machine(3, nvlink=12, links={(2, 0): 0}).link(0, 2).nvlinks == 0  # type: ignore[union-attr]


def test_a_list_of_gpus_is_the_physical_gpus() -> None:
    gs = [gpu(0, "NVIDIA A100-SXM4-80GB", (8, 0), 80), gpu(1, "NVIDIA H100 80GB HBM3", (9, 0), 80)]
    f = machine(gs, env={"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert [(g.index, g.physical_index, g.name) for g in f.gpus] == [(0, 1, "NVIDIA H100 80GB HBM3")]
    with pytest.raises(InvalidOptionError, match="distinct"):
        machine([gpu(0), gpu(0)])


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"cc": "9.0"}, "cc"),
        ({"cc": (9,)}, "cc"),
        ({"gpus": "two"}, "gpus"),
        ({"gpus": -3}, "gpus"),
        ({"gpus": True}, "gpus"),
        ({"nvlink": "x"}, "nvlink"),
        ({"memory_gb": "80"}, "memory_gb"),
        ({"p2p": "maybe"}, "p2p"),
        ({"topology": "pcie"}, "topology"),
        ({"iommu": True}, "iommu"),
        ({"shm_mb": -1}, "shm_mb"),
        ({"wsl2": "no"}, "wsl2"),
        ({"torch": 2.1}, "torch"),
        ({"torch_archs": "sm_90"}, "torch_archs"),
        ({"env": {"NCCL_DEBUG": 1}}, "env"),
        ({"links": {(0, 0): 4}}, "links"),
        ({"links": {(0, 2): 4}}, "links"),
        ({"links": {"0:1": 4}}, "links"),
        ({"links": {(0, 1): -1}}, "links"),
        ({"links": [[0, 1, 4]]}, "links"),
    ],
)
def test_bad_machine_arguments_name_the_argument(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidOptionError, match=rf"machine\({field}=") as info:
        machine(**{"gpus": 2, **kw})
    assert "expected" in str(info.value)


def test_bad_gpu_arguments_name_the_argument() -> None:
    with pytest.raises(InvalidOptionError, match=r"gpu\(cc="):
        gpu(0, cc="12.0")  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match=r"gpu\(index="):
        gpu(-1)


def test_seed003_file_describes_the_nvlink_pairs() -> None:
    data = json.loads((MACHINES / "seed003_a6000x8_shm.json").read_text())
    f = machine(**data["machine"])
    nvlinked = sorted((ln.a, ln.b) for ln in f.links if ln.nvlinks)
    assert nvlinked == [(0, 1), (2, 3), (4, 5), (6, 7)]


# ----- every fact inspection reports, and every outcome a probe reports, can be described --------
def test_per_pair_links_carry_topology_and_p2p() -> None:
    f = machine(4, links={"0-1": 4, "2-3": {"topology": "system", "p2p": "not_supported"},
                          (1, 2): {"nvlinks": 2, "topology": "single"}})
    assert (f.link(0, 1).nvlinks, f.link(0, 1).topology) == (4, "hostbridge")  # type: ignore[union-attr]
    assert (f.link(2, 3).topology, f.link(2, 3).p2p_read) == ("system", "not_supported")  # type: ignore[union-attr]
    assert (f.link(1, 2).nvlinks, f.link(1, 2).topology) == (2, "single")  # type: ignore[union-attr]
    summary = f.link_summary()
    assert summary.cross_socket and summary.p2p_unsupported and not summary.all_nvlink
    with pytest.raises(InvalidOptionError):
        machine(2, links={"0-1": {"topology": "warp"}})


def test_mig_instances_are_named_by_cuda_visible_devices() -> None:
    f = machine(2, memory_gb=80, mig={"0": 2}, env={"CUDA_VISIBLE_DEVICES": "MIG-fake-0000-1"})
    (g,) = f.gpus
    assert (g.index, g.physical_index, g.uuid, g.mig_enabled) == (0, 0, "MIG-fake-0000-1", True)
    assert g.memory_bytes == 40 * 2**30 and f.links == ()
    with pytest.raises(InvalidOptionError):
        machine(2, mig={5: 2})


def test_host_and_framework_state_are_described() -> None:
    f = machine(2, infiniband=True, cpu_count=8, platform="linux", kernel="5.15.0",
                tensorflow="2.21.0", tf_cuda="12.5", torch=None, imported=["tensorflow"],
                nvml_notes=["GPU 1 compute capability: unknown"])
    assert (f.host.infiniband, f.host.cpu_count, f.host.kernel) == (True, 8, "5.15.0")
    tf = f.framework("tensorflow")
    assert tf.imported and not tf.gpu_initialized and f.nvml_notes
    started = machine(2, tensorflow="2.21.0", tf_cuda="12.5", torch=None,
                      gpu_initialized=["tensorflow"], env={"CLIENT_API_TYPE": "EX_PROCESS_API"})
    # the rule leaves TF one GPU, so CUDA_VISIBLE_DEVICES would change under a started runtime
    with pytest.raises(FrameworkInitializedError):
        simulate(started, framework="tensorflow", global_batch_size=64)


def test_a_probe_outcome_can_carry_every_field_a_probe_reports() -> None:
    prober = FakeProber({"nccl": {"status": "ok", "bus_bandwidth_gbps": 9.5,
                                  "message_bytes": 256 << 20, "step_seconds": 0.01, "ranks": 2,
                                  "extra": [["value_check_iterations", "20"]]}})
    sel = simulate(machine(2, env={"WORLD_SIZE": "2"}), prober, global_batch_size=64)
    res = sel.results[sel.candidate.key]
    assert (res.bus_bandwidth_gbps, res.message_bytes, res.step_seconds, res.ranks) == (
        9.5, 256 << 20, 0.01, 2)
    assert dict(res.extra) == {"value_check_iterations": "20"}
    with pytest.raises(ValueError):
        FakeProber({"nccl": {"status": "sideways"}})


def test_a_machine_file_can_describe_all_of_it(tmp_path: Path) -> None:
    from resilient_strategy.cli import simulate_file

    path = tmp_path / "case.json"
    path.write_text(json.dumps({
        "framework": "torch", "global_batch_size": 64,
        "machine": {"gpus": 2, "links": {"0-1": {"topology": "system"}},
                    "infiniband": True, "env": {"WORLD_SIZE": "2"}},
        "probes": {"nccl": {"status": "ok", "bus_bandwidth_gbps": 100.0, "message_bytes": 1024}},
    }))
    sel = simulate_file(path)["torch"]
    assert sel.backend == "nccl" and sel.results[sel.candidate.key].message_bytes == 1024


def test_a_simulation_says_it_is_one() -> None:
    sel = simulate(machine(2, env={"WORLD_SIZE": "2"}), {"nccl": "timeout"})
    assert sel.simulated and sel.to_dict()["simulated"] is True
    failed = [e for e in sel.plan.events if isinstance(e, CandidateRuledOut)]
    chosen = [e for e in sel.plan.events if isinstance(e, Chosen)]
    assert failed and all(e.simulated for e in failed)
    assert [(e.how, e.simulated) for e in chosen] == [("probe_passed", True)]


def test_the_logical_cpu_mode_names_no_gpu() -> None:
    tf = machine(0, tensorflow="2.21.0", tf_cuda=None, torch=None)
    sel = simulate(tf, {"hierarchical_copy": "ok"}, framework="tensorflow", logical_cpus=2,
                   global_batch_size=8)
    assert sel.candidate.logical_cpus and sel.devices == (0,)
    on_devices = [c for c in sel.to_dict()["candidates"] if c["devices"]]
    assert len(on_devices) == 3 and all(c["logical_cpus"] for c in on_devices)


def test_no_nccl_candidate_on_logical_cpus_of_any_build() -> None:
    for cuda in (None, "12.5"):  # a CPU-only build, and a CUDA build in the CPU test mode
        tf = machine(0, tensorflow="2.21.0", tf_cuda=cuda, torch=None)
        prober = FakeProber({"hierarchical_copy": "ok"})
        sel = simulate(tf, prober, framework="tensorflow", logical_cpus=2, global_batch_size=256)
        assert (sel.backend, sel.num_replicas) == ("hierarchical_copy", 2)
        assert "nccl" not in [c["backend"] for c in sel.to_dict()["candidates"]]
        assert prober.probed == ["hierarchical_copy"]
        assert "no_nccl_on_cpu" in [e.topic for e in sel.plan.events if isinstance(e, Note)]


def test_a_cpu_only_tensorflow_build_gets_no_gpu_probe_on_a_gpu_machine() -> None:
    tf = machine(2, nvlink=18, tensorflow="2.21.0", tf_cuda=None, torch=None)
    prober = FakeProber({})
    sel = simulate(tf, prober, framework="tensorflow", global_batch_size=64)
    assert (sel.backend, prober.probed) == ("cpu", [])
    assert [c["backend"] for c in sel.to_dict()["candidates"]] == ["cpu"]


# ----- the deferred GPU health check in a simulated decision (issue 21 item 4) ----------------
LAUNCH4 = {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}


def test_a_gpu_the_health_check_finds_broken_after_a_hang_ends_the_decision() -> None:
    from resilient_strategy.errors import GpuUnusableError

    prober = FakeProber({"single_device": "ok"}, default="timeout",
                        broken_gpus={2: "did not initialize"})
    with pytest.raises(GpuUnusableError) as err:
        simulate(machine(4, env=LAUNCH4), prober, framework="torch", global_batch_size=256)
    assert err.value.gpus == ((2, "did not initialize"),)
    assert prober.health_checks == [(0, 1, 2, 3)]  # one check, after the whole ladder


def test_a_probe_stuck_before_its_devices_on_an_unproven_gpu_is_checked_at_once() -> None:
    from resilient_strategy.errors import GpuUnusableError

    # nccl hangs in collective 1 (killed: GPUs unproven); its remedy's ranks never all arrive
    prober = FakeProber({"nccl": "timeout", "nccl+*": "hang:straggler", "single_device": "ok"},
                        default="timeout", broken_gpus={1: "hangs in cuInit"})
    with pytest.raises(GpuUnusableError):
        simulate(machine(4, env=LAUNCH4), prober, framework="torch", global_batch_size=256)
    # issue 31: the first hang is checked at once, so no variant ever runs on the broken GPU
    assert prober.probed == ["nccl"]
    assert prober.health_checks == [(0, 1, 2, 3)]


def test_unused_gpus_whose_check_overruns_the_budget_are_named_in_a_note() -> None:
    from dataclasses import replace as _replace

    from resilient_strategy.probing.cost import TYPICAL

    slow = _replace(TYPICAL[("torch", True)], device_s=50.0)  # a check costs 50 s per GPU
    prober = FakeProber({"single_device": "ok"}, default="timeout", figures=slow)
    sel = simulate(machine(4, env=LAUNCH4), prober, framework="torch", global_batch_size=256,
                   timeout=30.0)
    assert sel.backend == "single_device" and sel.devices == (0,)
    assert prober.health_checks == [(0,)]  # the chosen GPU is never left unproven
    notes = [e for e in sel.plan.events if isinstance(e, Note) and e.topic == "gpus_unchecked"]
    assert len(notes) == 1 and "1,2,3" in notes[0].to_dict().get("message", "")


def test_a_wedged_gpu_is_named_after_the_first_hang_not_after_a_hung_variant() -> None:
    from resilient_strategy.errors import GpuUnusableError

    # plain NCCL hangs inside its first collective (every rank past its device); the GPU is
    # wedged since. Before issue 31 the hang was deferred and a hung variant ran on it first.
    prober = FakeProber({"nccl": "hang:collective", "*": "hang:straggler"},
                        broken_gpus={3: "Unable to determine the device handle: Unknown Error"})
    with pytest.raises(GpuUnusableError) as err:
        simulate(machine(4, env=LAUNCH4), prober, framework="torch", global_batch_size=256)
    assert prober.probed == ["nccl"] and prober.health_checks == [(0, 1, 2, 3)]
    assert [i for i, _ in err.value.gpus] == [3]
    assert [k.split(":")[1] for k in err.value.probed] == ["nccl"]


def test_a_hang_on_healthy_gpus_costs_one_check_and_the_search_goes_on() -> None:
    prober = FakeProber({"nccl": "hang:collective", "nccl+NCCL_P2P_DISABLE=1": "ok:20"})
    sel = simulate(machine(4, env=LAUNCH4), prober, framework="torch", global_batch_size=256)
    assert sel.backend == "nccl" and dict(sel.env) == {"NCCL_P2P_DISABLE": "1"}
    # checked after the hang; the passing variant proved the GPUs, so no check at the end
    assert prober.health_checks == [(0, 1, 2, 3)]


@pytest.mark.parametrize(("gpus", "env"), [
    (4, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "1,2"}),
    (1, {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}),
    (2, {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "0",
         "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}),
])
def test_more_processes_per_node_than_visible_gpus_is_an_error_not_fewer_gpus(
        gpus: int, env: dict[str, str]) -> None:
    from resilient_strategy.errors import InvalidOptionError

    prober = FakeProber()
    with pytest.raises(InvalidOptionError) as err:
        simulate(machine(gpus, env={**env, "RANK": "0", "LOCAL_RANK": "0"}), prober,
                 framework="torch", global_batch_size=64)
    assert err.value.option == "LOCAL_WORLD_SIZE" and prober.probed == []


def test_as_many_processes_as_gpus_or_cpu_processes_are_fine() -> None:
    sel = simulate(machine(2, env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}),
                   FakeProber(), framework="torch", global_batch_size=64)
    assert sel.num_replicas == 2
    cpu = simulate(machine(0, torch_cuda=None, env={"WORLD_SIZE": "4", "RANK": "0",
                                                      "LOCAL_RANK": "0"}),
                   FakeProber(), framework="torch", global_batch_size=64)
    assert cpu.backend == "gloo" and cpu.num_replicas == 4


def test_nodes_that_cannot_talk_keep_node_0s_own_gpus_with_the_global_batch() -> None:
    from resilient_strategy.core.trace.ruling import CandidateRuledOut

    env = {"WORLD_SIZE": "16", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8",
           "GROUP_RANK": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    facts = machine(8, nvlink=18, env=env, platform_facts={"master_ifname": "eth0"})
    prober = FakeProber({"nccl": "error:nccl_network", "nccl+*": "error:nccl_network",
                         "gloo": "error:gloo_connection", "gloo+*": "error:gloo_connection",
                         "nccl/node0": "ok:300"})
    sel = simulate(facts, prober, framework="torch", global_batch_size=256)
    assert sel.backend == "nccl" and sel.candidate.node_local
    assert sel.devices == tuple(range(8)) and sel.num_replicas == 8
    assert sel.accumulation_steps == 2 and sel.per_replica_batch_size == 16  # 256 kept
    # the link that failed is named: the probe across the nodes, ruled out with its cause
    out = [e for e in sel.plan.events if isinstance(e, CandidateRuledOut)
           and e.candidate.key == "torch:nccl:0,1,2,3,4,5,6,7"]
    assert out and out[0].result is not None and out[0].result.cause == "nccl_network"
    # node 0's ranks train, the other node's ranks idle
    other = simulate(machine(8, nvlink=18, env={**env, "RANK": "8", "GROUP_RANK": "1"},
                             platform_facts={"master_ifname": "eth0"}),
                     FakeProber(dict(prober.outcomes)), framework="torch", global_batch_size=256)
    assert sel.active and not other.active


def test_a_prober_of_your_own_runs_the_decision_through_the_public_engine() -> None:
    """`Prober` needs only `probe`: the rest are defaults the decision loop calls directly
    (no deferred GPU check, real outcomes); `Engine` injects it, with a clock of the test's."""
    from collections.abc import Mapping

    from resilient_strategy.core.measures.probe import ERROR, OK, ProbeResult, ProbeSpec
    from resilient_strategy.testing import Arguments, Engine, Prober

    class NcclFails(Prober):
        def __init__(self) -> None:
            self.seen: list[str] = []

        def probe(self, spec: ProbeSpec, env: Mapping[str, str]) -> ProbeResult:
            self.seen.append(spec.backend)
            if spec.backend == "nccl":
                return ProbeResult(spec.candidate, ERROR, 1.0, "nccl_error", "refused")
            return ProbeResult(spec.candidate, OK, 1.0)

    torchrun = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    facts = machine(2, nvlink=18, env=torchrun)
    prober = NcclFails()
    assert not prober.defers_gpu_check and prober.check_gpus("torch", (0,), {}) == []
    sel = Engine(prober, clock=lambda: 0.0, alone=True).select(
        Arguments.from_kwargs(framework="torch", global_batch_size=64, gradient_bytes=4 << 20,
                              sample_seconds=1e-3, cache=False), env=torchrun, facts=facts)
    assert prober.seen[0] == "nccl" and sel.backend != "nccl" and not sel.simulated
    # a plain function is a prober too (every default), through simulate's same seat
    calls: list[str] = []

    def ok(spec: ProbeSpec, env: Mapping[str, str]) -> ProbeResult:
        calls.append(spec.backend)
        return ProbeResult(spec.candidate, OK, 1.0)

    sel = simulate(facts, ok, framework="torch", global_batch_size=64, gradient_bytes=4 << 20,
                   sample_seconds=1e-3, alone=True)
    assert calls == ["nccl"] and sel.backend == "nccl"
