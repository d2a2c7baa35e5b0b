"""The planner, from hand-written facts to whole ordered plans. No monkeypatching."""

from __future__ import annotations

import pytest
from _imports import PKG, imports, modules

from resilient_strategy.core.call.options import Options
from resilient_strategy.core.knowledge.rules import load_rules
from resilient_strategy.core.measures.estimate import MeasuredStep
from resilient_strategy.core.measures.probe import ProbeResult
from resilient_strategy.core.planning.plan import Candidate, Plan, plan, split_batch
from resilient_strategy.core.trace.choosing import Chosen, FewerGpusRanked, ProvisionalRanking
from resilient_strategy.core.trace.event import Note
from resilient_strategy.core.values.facts import Facts, FrameworkInfo, Gpu, Host, Link
from resilient_strategy.errors import InvalidOptionError

RULES = load_rules()
TORCH = FrameworkInfo("torch", "2.11.0", "torch", "13.0", "2.28.9")
H200 = "NVIDIA H200"


def h200s(n: int = 2, nvlinks: int = 18) -> Facts:
    gpus = tuple(Gpu(i, H200, (9, 0), 141 << 30, f"GPU-{i}") for i in range(n))
    links = tuple(Link(a, b, "hostbridge", nvlinks, "ok", "ok")
                  for a in range(n) for b in range(a + 1, n))
    return Facts(gpus=gpus, links=links, host=Host(shm_bytes=256 << 30), frameworks=(TORCH,))


def order(p) -> list[str]:  # type: ignore[no-untyped-def]
    return [c.key for c in p.candidates]


def topics(p: Plan) -> list[str]:
    return [e.topic for e in p.events if isinstance(e, Note)]


def fail(key: str, cause: str) -> ProbeResult:
    return ProbeResult(key, "timeout" if cause == "timeout" else "error", 5.0, cause, "x")


def test_healthy_nvlink_pair_plans_nccl_first_and_probes_it() -> None:
    p = plan(h200s(), RULES, {}, Options("torch", global_batch_size=512, gradient_bytes=400_000_000, world_size=2))
    assert order(p) == [
        "torch:nccl:0,1",
        "torch:single_device:0",
        "torch:gloo:0,1",
        "torch:cpu:cpu",
    ]
    assert p.next_probe is not None and p.next_probe.key == "torch:nccl:0,1"
    assert p.chosen is None
    nccl = p.candidates[0]
    assert (nccl.num_replicas, nccl.per_replica_batch_size, nccl.accumulation_steps) == (2, 256, 1)
    single = p.candidates[1]
    assert (single.num_replicas, single.per_replica_batch_size, single.accumulation_steps) == (1, 256, 2)


def test_proven_nccl_is_chosen() -> None:
    results = {"torch:nccl:0,1": ProbeResult("torch:nccl:0,1", "ok", 8.0, bus_bandwidth_gbps=300.0)}
    p = plan(h200s(), RULES, results, Options("torch", global_batch_size=512, gradient_bytes=400_000_000, world_size=2))
    assert p.chosen is not None and p.chosen.key == "torch:nccl:0,1"
    assert p.next_probe is None
    chosen = [e for e in p.events if isinstance(e, Chosen)]
    assert [(e.how, e.result and e.result.bus_bandwidth_gbps) for e in chosen] == [
        ("probe_passed", 300.0)]


def test_hung_nccl_tries_p2p_off_remedy_next_then_steps_down_by_speed() -> None:
    # issue 41: the P2P-off remedy is NCCL on both GPUs, so with nothing measured of the compute
    # it is probed next, whatever the estimate says of one GPU (a model's size is not its compute)
    policy = Options("torch", global_batch_size=512, gradient_bytes=400_000_000, world_size=2)
    r1 = {"torch:nccl:0,1": fail("torch:nccl:0,1", "timeout")}
    p = plan(h200s(), RULES, r1, policy)
    assert p.next_probe is not None and p.next_probe.key == "torch:nccl:0,1:NCCL_P2P_DISABLE=1"
    assert [r.candidate.key for r in p.ruled_out] == ["torch:nccl:0,1"]
    (provisional,) = [e for e in p.events if isinstance(e, ProvisionalRanking)]
    assert (provisional.kept, provisional.degraded) == ((0, 1), False)
    # with the user's measured compute (sample_seconds=): P2P-off over NVLink goes through SHM
    # (28 GB/s measured), slower than one GPU for a 100M-parameter model whose sample takes
    # 10 us, so one GPU with 2 accumulation steps wins without probing the remedy, and says why
    fast = Options("torch", global_batch_size=512, gradient_bytes=400_000_000, world_size=2,
                   sample_seconds=1e-5)
    p = plan(h200s(), RULES, r1, fast)
    assert order(p)[0] == "torch:single_device:0"
    assert p.chosen is not None and p.chosen.backend == "single_device"
    assert p.chosen.accumulation_steps == 2
    assert "torch:nccl:0,1:NCCL_P2P_DISABLE=1" in order(p)
    (fewer,) = [e for e in p.events if isinstance(e, FewerGpusRanked)]
    assert (fewer.candidate.key, fewer.over.key, fewer.source) == (
        "torch:single_device:0", "torch:nccl:0,1:NCCL_P2P_DISABLE=1", "sample_seconds")
    assert not [e for e in p.events if isinstance(e, ProvisionalRanking)]


def test_small_model_prefers_remedy_to_single_gpu() -> None:
    # A small model: communication is cheap, two GPUs over P2P-off NCCL beat one.
    facts = h200s(nvlinks=0)
    policy = Options("torch", global_batch_size=512, gradient_bytes=4_000_000, sample_seconds=1e-4,
                    world_size=2)
    p = plan(facts, RULES, {"torch:nccl:0,1": fail("torch:nccl:0,1", "cuda_error")}, policy)
    assert order(p)[:2] == [
        "torch:nccl:0,1:NCCL_P2P_DISABLE=1",
        "torch:nccl:0,1:NCCL_P2P_DISABLE=1;NCCL_SHM_DISABLE=1",
    ]
    assert p.next_probe is not None and p.next_probe.key == "torch:nccl:0,1:NCCL_P2P_DISABLE=1"


def test_measured_slow_bandwidth_loses_to_one_gpu() -> None:
    # issue 41: only with a measured compute (here sample_seconds=) may one GPU beat a proven
    # transport across both; NCCL and its remedies failed, so gloo is a degraded option anyway
    policy = Options("torch", global_batch_size=512, gradient_bytes=400_000_000, world_size=2,
                     sample_seconds=2e-5)
    results = {
        "torch:nccl:0,1": fail("torch:nccl:0,1", "timeout"),
        "torch:nccl:0,1:NCCL_P2P_DISABLE=1": fail("torch:nccl:0,1:NCCL_P2P_DISABLE=1", "timeout"),
        "torch:gloo:0,1": ProbeResult("torch:gloo:0,1", "ok", 3.0, bus_bandwidth_gbps=2.2),
    }
    p = plan(h200s(), RULES, results, policy)
    assert p.chosen is not None and p.chosen.backend == "single_device"
    gloo = next(r for r in p.ranked if r.candidate.backend == "gloo")
    single = next(r for r in p.ranked if r.candidate.backend == "single_device")
    assert gloo.estimate.step_seconds > 10 * single.estimate.step_seconds
    assert (gloo.estimate.compute, single.estimate.compute) == ("sample_seconds",) * 2


def test_a_measured_step_is_the_rankings_compute_over_sample_seconds() -> None:
    # the seam for the user's step measured during training (issue 41): it stands over
    # sample_seconds= and may rank one GPU first; the trace says it came from the measurement
    policy = Options("torch", global_batch_size=512, gradient_bytes=400_000_000, world_size=2,
                     sample_seconds=1.0)
    r1 = {"torch:nccl:0,1": fail("torch:nccl:0,1", "timeout")}
    assert plan(h200s(), RULES, r1, policy).next_probe is not None  # 1 s a sample: two GPUs
    p = plan(h200s(), RULES, r1, policy, measured=MeasuredStep(1e-5))
    assert p.chosen is not None and p.chosen.backend == "single_device"
    assert {r.estimate.compute for r in p.ranked} == {"measured_step"}
    (fewer,) = [e for e in p.events if isinstance(e, FewerGpusRanked)]
    assert fewer.source == "measured_step"


def test_an_estimate_never_leaves_a_gpu_idle_that_nccl_proved() -> None:
    # issue 41 item 1: NCCL proven on both GPUs (or still to prove), any model size, no
    # measured compute: both GPUs, torch and TensorFlow alike
    tf = FrameworkInfo("tensorflow", "2.21.0", "tensorflow", "12.5.1", None, ("sm_90",))
    tf_facts = Facts(gpus=h200s().gpus, links=h200s().links, frameworks=(tf,))
    for grad in (None, 4_000_000, 400_000_000, 40_000_000_000):
        for fw, facts, key in (("torch", h200s(), "torch:nccl:0,1"),
                               ("tensorflow", tf_facts, "tensorflow:nccl:0,1")):
            policy = Options(fw, global_batch_size=64, gradient_bytes=grad,
                             world_size=2 if fw == "torch" else 1)
            unproven = plan(facts, RULES, {}, policy)
            assert unproven.next_probe is not None and unproven.next_probe.key == key, (fw, grad)
            ok = ProbeResult(key, "ok", 2.0, bus_bandwidth_gbps=1.0)  # even a slow one
            proven = plan(facts, RULES, {key: ok}, policy)
            # chosen, or a faster-estimated reduction on the same GPUs probed first
            nxt = proven.chosen or proven.next_probe
            assert nxt is not None and nxt.num_replicas == 2, (fw, grad)
            family = [i for i, c in enumerate(proven.candidates)
                      if c.backend in ("nccl", "hierarchical_copy", "reduction_to_one_device")]
            one = [i for i, c in enumerate(proven.candidates) if c.num_replicas == 1]
            assert max(family) < min(one), (fw, grad)
            assert [e.kept for e in proven.events if isinstance(e, ProvisionalRanking)] == [(0, 1)]


def test_degraded_options_only_are_ranked_by_the_estimate_and_provisional() -> None:
    # no NCCL-family candidate left on both GPUs: gloo against one GPU, by the estimate (with
    # its assumed compute), and the trace says it is provisional
    policy = Options("torch", global_batch_size=512, gradient_bytes=40_000_000_000, world_size=2)
    results = {
        "torch:nccl:0,1": fail("torch:nccl:0,1", "timeout"),
        "torch:nccl:0,1:NCCL_P2P_DISABLE=1": fail("torch:nccl:0,1:NCCL_P2P_DISABLE=1", "timeout"),
        "torch:gloo:0,1": ProbeResult("torch:gloo:0,1", "ok", 3.0, bus_bandwidth_gbps=2.2),
    }
    p = plan(h200s(), RULES, results, policy)
    assert p.chosen is not None and p.chosen.backend == "single_device"  # 40 GB over gloo
    (provisional,) = [e for e in p.events if isinstance(e, ProvisionalRanking)]
    assert (provisional.kept, provisional.degraded) == ((), True)
    assert {r.estimate.compute for r in p.ranked} == {"none"}


def test_user_set_variable_is_never_overridden_by_a_remedy() -> None:
    facts = h200s()
    policy = Options("torch", global_batch_size=8, user_env=("NCCL_P2P_DISABLE",), world_size=2)
    p = plan(facts, RULES, {"torch:nccl:0,1": fail("torch:nccl:0,1", "cuda_error")}, policy)
    assert all("NCCL_P2P_DISABLE" not in dict(c.env) for c in p.candidates)
    assert "torch:nccl:0,1:NCCL_SHM_DISABLE=1" not in order(p)  # cuda_error remedies need P2P


def test_tensorflow_chain_order_and_batches() -> None:
    tf = FrameworkInfo("tensorflow", "2.21.0", "tensorflow", "12.5.1", None, ("sm_89", "compute_90"))
    facts = Facts(gpus=h200s().gpus, links=h200s().links, frameworks=(tf,))
    p = plan(facts, RULES, {}, Options("tensorflow", global_batch_size=256))
    assert [c.backend for c in p.candidates] == [
        "nccl", "hierarchical_copy", "reduction_to_one_device", "single_device", "cpu",
    ]
    for c in p.candidates:
        assert c.num_replicas * (c.per_replica_batch_size or 0) * c.accumulation_steps == 256


def test_batch_that_does_not_split_uses_fewer_gpus_and_stays_exact() -> None:
    tf = FrameworkInfo("tensorflow", "2.21.0", "tensorflow", "12.5.1")
    facts = Facts(gpus=h200s(4).gpus, links=h200s(4).links, frameworks=(tf,))
    p = plan(facts, RULES, {}, Options("tensorflow", global_batch_size=6))
    nccl = p.candidates[0]
    assert nccl.backend == "nccl" and nccl.devices == (0, 1, 2) and nccl.num_replicas == 3
    assert topics(p) == ["batch_shrinks_replicas"]
    for c in p.candidates:
        assert c.num_replicas * (c.per_replica_batch_size or 0) * c.accumulation_steps == 6


def test_plain_python_torch_on_two_gpus_trains_on_one_and_says_how_to_use_both() -> None:
    p = plan(h200s(), RULES, {}, Options("torch", global_batch_size=512))
    assert order(p) == ["torch:single_device:0", "torch:cpu:cpu"]
    single = p.candidates[0]
    assert (single.per_replica_batch_size, single.accumulation_steps) == (256, 2)
    assert topics(p) == ["one_process"] and p.warnings  # says how to use both: torchrun


def test_no_gpu_plans_cpu_only() -> None:
    p = plan(Facts(nvml_error="no driver", frameworks=(TORCH,)), RULES, {}, Options("torch"))
    assert order(p) == ["torch:cpu:cpu"]
    assert p.chosen is not None and p.chosen.backend == "cpu"
    assert topics(p) == ["no_gpu_facts"]


def test_cpu_build_of_torch_cannot_use_gpus() -> None:
    cpu_torch = FrameworkInfo("torch", "2.13.0", "torch", None, None)
    facts = Facts(gpus=h200s().gpus, links=h200s().links, frameworks=(cpu_torch,))
    p = plan(facts, RULES, {}, Options("torch"))
    assert order(p) == ["torch:cpu:cpu"]
    assert topics(p) == ["cpu_only_build"]


def test_under_torchrun_on_cpu_gloo_between_processes() -> None:
    facts = Facts(frameworks=(FrameworkInfo("torch", "2.13.0", "torch", None, None),))
    p = plan(facts, RULES, {}, Options("torch", global_batch_size=8, world_size=2))
    assert order(p) == ["torch:gloo:cpu", "torch:cpu:cpu"]
    gloo, cpu = p.candidates
    assert (gloo.num_replicas, gloo.per_replica_batch_size, gloo.accumulation_steps) == (2, 4, 1)
    assert (cpu.num_replicas, cpu.per_replica_batch_size, cpu.accumulation_steps) == (1, 4, 2)


def test_prefer_puts_a_backend_first_and_devices_restricts() -> None:
    p = plan(h200s(4), RULES, {}, Options("torch", prefer="gloo", devices=(1, 2), world_size=2))
    assert order(p)[0] == "torch:gloo:1,2"
    assert all(set(c.devices) <= {1, 2} for c in p.candidates)
    with pytest.raises(InvalidOptionError, match=r"GPU\(s\) \[7\]"):
        plan(h200s(4), RULES, {}, Options("torch", devices=(1, 7)))


def test_policy_validation() -> None:
    with pytest.raises(InvalidOptionError):
        Options("jax")
    with pytest.raises(InvalidOptionError):
        Options("torch", global_batch_size=0)
    with pytest.raises(InvalidOptionError, match="multiple of 3"):
        Options("torch", global_batch_size=8, world_size=3)
    with pytest.raises(InvalidOptionError):
        Options("torch", prefer="mpi")
    with pytest.raises(InvalidOptionError):
        Options("torch", global_batch_size=True)


@pytest.mark.parametrize(
    ("g", "r", "cap", "expected"),
    [(512, 2, 256, (256, 1)), (512, 1, 256, (256, 2)), (12, 1, 5, (4, 3)), (7, 1, 3, (1, 7))],
)
def test_split_batch(g: int, r: int, cap: int, expected: tuple[int, int]) -> None:
    per, acc = split_batch(g, r, cap)
    assert (per, acc) == expected and r * per * acc == g


def test_candidate_labels_and_keys_are_stable() -> None:
    c = Candidate("torch", "nccl", (0, 1), (("NCCL_P2P_DISABLE", "1"),), num_replicas=2)
    assert c.key == "torch:nccl:0,1:NCCL_P2P_DISABLE=1"
    assert c.label == "NCCL on GPUs 0,1 with NCCL_P2P_DISABLE=1"
    assert c.needs_probe and not Candidate("torch", "single_device", (0,)).needs_probe


def test_planner_imports_no_os_subprocess_nvml_or_framework() -> None:
    """Follows plan.py's imports through the package (relative ones too): nothing it reaches may
    touch the OS, a subprocess, NVML or a framework, directly or through our own modules."""
    banned = {"os", "subprocess", "pynvml", "torch", "tensorflow", "keras", "jax"}
    banned_rooms = {"machine", "records", "probing", "nodes", "deciding", "run", "frameworks"}
    mods = modules()
    seen: set[str] = set()
    todo = [f"{PKG}.core.planning.plan"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        ours, others = imports(module, mods[module])
        assert not others & banned, (module, others & banned)
        for t in ours:
            assert t.split(".")[1] not in banned_rooms and t != f"{PKG}.selection", (module, t)
            todo.append(t)
    reached = ("core.planning.plan", "core.planning.chain", "core.planning.ranking",
               "core.knowledge.rules", "core.knowledge.clauses", "core.values.facts",
               "core.measures.probe", "core.trace.event", "errors")
    assert {f"{PKG}.{m}" for m in reached} <= seen


def test_on_logical_cpus_a_measured_hierarchical_copy_is_not_outbid_by_a_gpu_figure() -> None:
    # TF on 2 logical CPUs: the typical figures are the logical-CPU ones, so HierarchicalCopy
    # measured at its usual 4.98 GB/s is chosen without a second TensorFlow probe
    tf = FrameworkInfo("tensorflow", "2.21.0", "tensorflow", None)
    facts = Facts(frameworks=(tf,))
    opts = Options("tensorflow", global_batch_size=256, logical_cpus=2)
    first = plan(facts, RULES, {}, opts)
    assert first.next_probe is not None and first.next_probe.backend == "hierarchical_copy"
    key = first.next_probe.key
    measured = {key: ProbeResult(key, "ok", 12.0, bus_bandwidth_gbps=4.98)}
    p = plan(facts, RULES, measured, opts)
    assert p.chosen is not None and p.chosen.key == key and p.next_probe is None
