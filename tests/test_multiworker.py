"""TensorFlow multi-worker jobs (TF_CONFIG) without TensorFlow: the plan, the options, the
probe commands, the rounds' settling and the Selection, from described machines and simulated
probe outcomes. The real two-process job is tests/test_tf_multiworker.py."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from resilient_strategy.core.knowledge.rules import Rule
from resilient_strategy.core.measures.probe import ERROR, OK, TIMEOUT, ProbeResult, ProbeSpec
from resilient_strategy.core.trace.choosing import Chosen
from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.frameworks.tensorflow import TfRuntime
from resilient_strategy.nodes.tfworkers import (
    KILL_GRACE_S,
    SETTLE_S,
    SettlingProber,
    across_workers,
)
from resilient_strategy.probing.prober import build_commands
from resilient_strategy.testing import FakeProber, machine, simulate


def tf_config(index: int, workers: int = 2, chief: bool = False, kind: str = "worker") -> str:
    cluster: dict[str, Any] = {"worker": [f"10.0.0.{i + 1}:2222" for i in range(workers)]}
    if chief:
        cluster["chief"] = ["10.0.0.100:2222"]
    return json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})


def cpu_worker(index: int, **kw: Any) -> Any:
    return machine(0, tensorflow="2.21.0", torch=None, env={"TF_CONFIG": tf_config(index, **kw)})


def gpu_worker(index: int, gpus: int = 2, **kw: Any) -> Any:
    return machine(gpus, tensorflow="2.21.0", tf_cuda="12.5", tf_archs=("sm_80", "compute_90"),
                   torch=None, cc=(8, 0), env={"TF_CONFIG": tf_config(index, **kw)})


def multi_worker_event(sel: Any) -> dict[str, Any]:
    events = [e for e in sel.to_dict()["events"] if e["kind"] == "multi_worker"]
    assert len(events) == 1
    return events[0]


# ----- the plan ---------------------------------------------------------------------------------
def test_two_cpu_workers_plan_ring_across_both_then_worker_0_alone() -> None:
    prober = FakeProber({})
    sel = simulate(cpu_worker(1), prober, framework="tensorflow", global_batch_size=64)
    plan = [(c.backend, c.num_replicas, c.per_replica_batch_size, c.accumulation_steps)
            for c in sel.plan.candidates]
    assert plan == [("mw_ring", 2, 32, 1), ("mw_auto", 2, 32, 1), ("cpu", 1, 32, 2)]
    assert (sel.backend, sel.num_replicas, sel.batch_size, sel.active) == ("mw_ring", 2, 64, True)
    assert [(s.backend, s.workers, s.worker_rank, s.world_size) for s in prober.calls] == [
        ("mw_ring", 2, 1, 1)]
    d = sel.to_dict()
    assert (d["tf_workers"], d["tf_worker_rank"]) == (2, 1)
    ev = multi_worker_event(sel)
    assert (ev["workers"], ev["worker_rank"], ev["task"], ev["alone"], ev["active"]) == (
        2, 1, "worker:1", False, True)
    assert [(p["candidate"]["key"], p["status"]) for p in ev["probed"]] == [
        ("tensorflow:mw_ring:cpu", OK)]


@pytest.mark.parametrize("index", [0, 1])
def test_ring_and_auto_hang_worker_0_trains_alone_and_the_others_exit(index: int) -> None:
    sel = simulate(cpu_worker(index), {"mw_ring": "timeout", "mw_auto": "timeout"},
                   framework="tensorflow", global_batch_size=64)
    assert (sel.backend, sel.num_replicas, sel.accumulation_steps, sel.per_replica_batch_size) \
        == ("cpu", 1, 2, 32)
    assert sel.active is (index == 0)
    assert sel.is_main_process is (index == 0)
    ev = multi_worker_event(sel)
    assert (ev["alone"], ev["active"]) == (True, index == 0)
    assert [(p["candidate"]["key"], p["status"]) for p in ev["probed"]] == [
        ("tensorflow:mw_ring:cpu", TIMEOUT), ("tensorflow:mw_auto:cpu", TIMEOUT)]
    if index:
        with pytest.raises(SystemExit) as leave, sel.scope():
            pass
        assert leave.value.code == 0


def test_two_gpu_workers_nccl_then_ring_each_with_every_local_gpu() -> None:
    prober = FakeProber({"mw_nccl": "error:nccl_network", "mw_ring": "ok:1.5"})
    sel = simulate(gpu_worker(0, chief=True), prober, framework="tensorflow",
                   global_batch_size=384, gradient_bytes=100_000_000, sample_seconds=0.002)
    assert [s.backend for s in prober.calls] == ["mw_nccl", "mw_ring"]
    assert (sel.backend, sel.devices, sel.num_replicas, sel.per_replica_batch_size) == (
        "mw_ring", (0, 1), 6, 64)  # a chief and 2 workers, 2 GPUs each
    assert sel.batch_size == 384  # each worker feeds the global batch; the strategy splits it
    assert multi_worker_event(sel)["worker_rank"] == 1  # worker:0 comes after the chief


def test_a_small_model_trains_on_one_gpu_of_worker_0_without_probing() -> None:
    prober = FakeProber({})
    # the user's measured compute (issue 41: a model's size alone never drops GPUs)
    sel = simulate(gpu_worker(1), prober, framework="tensorflow", global_batch_size=256,
                   gradient_bytes=20_000_000, sample_seconds=1e-5)
    assert prober.calls == []  # the estimate says one GPU beats the network and its 2 GPUs
    assert (sel.backend, sel.accumulation_steps, sel.active) == ("single_device", 4, False)
    assert multi_worker_event(sel)["probed"] == []


def test_without_a_measured_compute_nccl_across_the_workers_is_proven_first() -> None:
    prober = FakeProber({})  # issue 41: NCCL on every GPU of the job is tried before one GPU
    sel = simulate(gpu_worker(1), prober, framework="tensorflow", global_batch_size=256,
                   gradient_bytes=20_000_000)
    assert [s.backend for s in prober.calls] == ["mw_nccl"]
    assert (sel.backend, sel.num_replicas) == ("mw_nccl", 4)  # 2 workers x 2 GPUs


def nvlink_worker(index: int, gpus: int = 4) -> Any:
    return machine(gpus, tensorflow="2.21.0", tf_cuda="12.5", tf_archs=("sm_80", "compute_90"),
                   torch=None, cc=(8, 0), nvlink=12, env={"TF_CONFIG": tf_config(index)})


@pytest.mark.parametrize("index", [0, 1])
def test_gradients_that_overwhelm_the_network_train_on_worker_0s_gpus(index: int) -> None:
    prober = FakeProber({})
    sel = simulate(nvlink_worker(index), prober, framework="tensorflow", global_batch_size=256,
                   gradient_bytes=4_000_000_000, sample_seconds=0.002)
    # the estimate: worker 0's 4 NVLinked GPUs beat one GPU, which beats 8 GPUs across the
    # network; worker 0 proves its MirroredStrategy, the other worker exits without probing it
    assert [s.backend for s in prober.calls] == (["nccl"] if index == 0 else [])
    assert (sel.backend, sel.devices, sel.num_replicas, sel.accumulation_steps, sel.active) == (
        "nccl", (0, 1, 2, 3), 4, 1, index == 0)
    assert sel.per_replica_batch_size == 64  # Keras cannot accumulate under MirroredStrategy
    assert multi_worker_event(sel)["probed"] == []
    assert multi_worker_event(sel)["alone"] is True
    how = [e.how for e in sel.plan.events if isinstance(e, Chosen)]
    assert how == (["probe_passed"] if index == 0 else ["worker_0_alone"])


LADDER = {"mw_nccl": "error:nccl_network", "mw_ring": "timeout", "mw_auto": "error:inter_worker"}
BIG = {"global_batch_size": 256, "gradient_bytes": 100_000_000, "sample_seconds": 0.002}


def test_the_ladder_is_nccl_ring_auto_then_worker_0s_gpus_then_one_gpu() -> None:
    sel = simulate(gpu_worker(0, gpus=4), FakeProber({}), framework="tensorflow",
                   probe="never", **BIG)
    assert [(c.backend, c.num_replicas) for c in sel.plan.candidates] == [
        ("mw_nccl", 8), ("mw_ring", 8), ("mw_auto", 8), ("nccl", 4), ("hierarchical_copy", 4),
        ("reduction_to_one_device", 4), ("single_device", 1), ("cpu", 1)]


@pytest.mark.parametrize(("local", "backend", "replicas", "acc"), [
    ("ok:120", "nccl", 4, 1),  # worker 0 alone on its 4 GPUs
    ("error:worker_error", "hierarchical_copy", 4, 1),  # its next local reduction
    ("timeout", "single_device", 1, 8),  # every local MirroredStrategy hangs: one GPU
])
def test_across_workers_fails_then_worker_0_proves_its_own_gpus(
        local: str, backend: str, replicas: int, acc: int) -> None:
    # anything unnamed (the local ones after NCCL, its remedies) ends as NCCL did, or passes
    prober = FakeProber({**LADDER, "nccl": local},
                        default="timeout" if local == "timeout" else "ok")
    sel = simulate(gpu_worker(0, gpus=4), prober, framework="tensorflow", **BIG)
    assert [s.backend for s in prober.calls][:4] == ["mw_nccl", "mw_ring", "mw_auto", "nccl"]
    assert all(s.workers == 1 for s in prober.calls[3:])  # worker 0's own probes
    assert (sel.backend, sel.num_replicas, sel.accumulation_steps, sel.active) == (
        backend, replicas, acc, True)
    assert sel.num_replicas * sel.per_replica_batch_size * sel.accumulation_steps == 256
    ev = multi_worker_event(sel)
    assert [p["candidate"]["key"].split(":")[1] for p in ev["probed"]] == [
        "mw_nccl", "mw_ring", "mw_auto"]
    assert (ev["alone"], ev["worker_rank"]) == (True, 0)
    rt = sel.runtime  # built without TensorFlow: one process, its own replicas
    assert (rt.workers, rt.num_replicas, rt.batch_size_to_feed) == (1, replicas, 256 // acc)


def test_a_worker_other_than_0_stops_at_worker_0s_gpus_without_probing_them() -> None:
    prober = FakeProber(LADDER)
    sel = simulate(gpu_worker(1, gpus=4), prober, framework="tensorflow", **BIG)
    assert [s.backend for s in prober.calls] == ["mw_nccl", "mw_ring", "mw_auto"]
    assert (sel.backend, sel.active, sel.proven) == ("nccl", False, True)
    assert [e.how for e in sel.plan.events if isinstance(e, Chosen)] == ["worker_0_alone"]
    with pytest.raises(SystemExit) as leave, sel.scope():
        pass
    assert leave.value.code == 0


def test_ring_passing_keeps_every_worker_and_auto_is_not_probed() -> None:
    prober = FakeProber({"mw_nccl": "error:nccl_network", "mw_ring": "ok:1.5"})
    sel = simulate(gpu_worker(0, gpus=4), prober, framework="tensorflow", **BIG)
    assert [s.backend for s in prober.calls] == ["mw_nccl", "mw_ring"]
    assert (sel.backend, sel.num_replicas, sel.active) == ("mw_ring", 8, True)


def test_a_slow_ring_measured_is_chosen_without_probing_auto() -> None:
    """AUTO is TensorFlow's ring too: RING's measured figure below AUTO's typical one must not
    spend a probe on AUTO (measured on two CPU workers over loopback: 0.145 GB/s)."""
    prober = FakeProber({"mw_ring": "ok:0.145"})
    sel = simulate(cpu_worker(0), prober, framework="tensorflow", global_batch_size=64)
    assert [s.backend for s in prober.calls] == ["mw_ring"]
    assert sel.backend == "mw_ring"


def test_one_gpu_per_worker_has_no_local_mirrored_candidate() -> None:
    sel = simulate(gpu_worker(0, gpus=1), FakeProber(LADDER), framework="tensorflow", **BIG)
    assert [c.backend for c in sel.plan.candidates] == ["single_device", "cpu"]
    assert (sel.backend, sel.accumulation_steps) == ("single_device", 2)


def test_a_batch_that_does_not_split_over_the_workers_rules_them_out() -> None:
    sel = simulate(cpu_worker(0, workers=3), {}, framework="tensorflow", global_batch_size=64)
    assert sel.backend == "cpu" and sel.per_replica_batch_size * sel.accumulation_steps == 64
    out = [r for r in sel.plan.ruled_out if r.candidate.backend == "mw_ring"]
    assert out and out[0].rule == ""  # ruled out by the batch, not a probe


def test_a_nccl_veto_covers_nccl_across_workers() -> None:
    veto = Rule(id="no-nccl", when=(), effect="veto", target=("nccl",), framework="tensorflow",
                message="no NCCL here", source="test")
    prober = FakeProber({})
    sel = simulate(gpu_worker(0), prober, framework="tensorflow", global_batch_size=256,
                   gradient_bytes=100_000_000, sample_seconds=0.002, rules=[veto])
    assert "mw_nccl" not in [c.backend for c in sel.plan.candidates]
    assert [s.backend for s in prober.calls] == ["mw_ring"]
    assert "nccl" not in [c.backend for c in sel.plan.candidates]  # worker 0's own NCCL too


def test_an_evaluator_task_plans_alone() -> None:
    f = machine(0, tensorflow="2.21.0", torch=None,
                env={"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:1"],
                                                          "evaluator": ["e:1"]},
                                              "task": {"type": "evaluator", "index": 0}})})
    sel = simulate(f, {}, framework="tensorflow", global_batch_size=64)
    assert (sel.backend, sel.tf_workers, sel.active) == ("cpu", 1, True)
    assert any(e["kind"] == "note" and e["topic"] == "tf_evaluator"
               for e in sel.to_dict()["events"])


def test_a_ps_cluster_is_a_clean_error() -> None:
    f = machine(0, tensorflow="2.21.0", torch=None, env={"TF_CONFIG": json.dumps(
        {"cluster": {"worker": ["a:1"], "ps": ["p:1"]}, "task": {"type": "worker", "index": 0}})})
    with pytest.raises(InvalidOptionError) as err:
        simulate(f, {}, framework="tensorflow")
    assert err.value.option == "TF_CONFIG"


def test_logical_cpus_and_tf_config_workers_do_not_mix() -> None:
    with pytest.raises(InvalidOptionError) as err:
        simulate(cpu_worker(0), {}, framework="tensorflow", logical_cpus=2)
    assert err.value.option == "logical_cpus"


def test_no_cache_is_read_or_written_across_workers(tmp_path: Path) -> None:
    for _ in range(2):
        prober = FakeProber({})
        sel = simulate(cpu_worker(0), prober, framework="tensorflow", global_batch_size=64,
                       cache=True, cache_dir=tmp_path)
        assert len(prober.calls) == 1 and not sel.from_cache
    assert list(tmp_path.iterdir()) == []


def test_torch_ignores_tf_config() -> None:
    f = machine(0, env={"TF_CONFIG": tf_config(1)})
    sel = simulate(f, {}, framework="torch")
    assert (sel.tf_workers, sel.backend) == (1, "cpu")


# ----- the probe across workers -----------------------------------------------------------------
def test_the_probe_command_names_the_workers_and_the_round() -> None:
    spec = ProbeSpec("tensorflow:mw_ring:cpu", "tensorflow", "mw_ring", (), timeout_s=12.0,
                     workers=2, worker_rank=1)
    (cmd,) = build_commands(spec, {"TF_CONFIG": tf_config(1)}, "/tmp/x", python="py",
                            parent_pid=1)
    argv = list(cmd.argv)

    def arg(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert argv[2] == "resilient_strategy.probing.workers.tf_worker"
    assert (arg("--backend"), arg("--workers"), arg("--worker-rank"), arg("--round-key"),
            arg("--budget")) == ("mw_ring", "2", "1", "tensorflow:mw_ring:cpu", "12")
    assert float(arg("--collective-timeout")) > 12.0  # the runner's deadline comes first
    assert cmd.env["TF_CONFIG"] == tf_config(1)  # the user's cluster, as is


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_a_round_after_a_failed_one_waits_for_every_workers_process_to_be_gone() -> None:
    clock = Clock()
    outcomes = {"a": ProbeResult("a", TIMEOUT, 10.0, "timeout"), "b": ProbeResult("b", OK, 3.0)}

    def prober(spec: ProbeSpec, env: Mapping[str, str]) -> ProbeResult:
        clock.now += outcomes[spec.candidate].elapsed_s
        return outcomes[spec.candidate]

    settle = SettlingProber(prober, clock, clock.sleep)
    spec = ProbeSpec("a", "tensorflow", "mw_nccl", (0,), timeout_s=10.0, workers=2)
    first = settle(spec, {})
    assert first.status == TIMEOUT and ("workers", "2") in first.extra
    assert clock.slept == []
    second = settle(ProbeSpec("b", "tensorflow", "mw_ring", (0,), timeout_s=10.0, workers=2), {})
    assert second.ok
    assert clock.slept == [pytest.approx(KILL_GRACE_S + SETTLE_S)]  # 100 + 10 + 4 + 5 - 110
    third = settle(ProbeSpec("b", "tensorflow", "mw_ring", (0,), timeout_s=10.0, workers=2), {})
    assert third.ok and len(clock.slept) == 1  # after a passed round: no wait


def test_a_local_probe_is_not_marked_or_delayed() -> None:
    clock = Clock()
    res = ProbeResult("c", ERROR, 1.0, "worker_error", "boom")
    settle = SettlingProber(lambda spec, env: res, clock, clock.sleep)
    assert settle(ProbeSpec("c", "tensorflow", "cpu", ()), {}) is res


def test_across_workers_names_the_workers_once() -> None:
    spec = ProbeSpec("k", "tensorflow", "mw_ring", (), workers=3, worker_rank=2)
    res = across_workers(ProbeResult("k", ERROR, 1.0, "inter_worker", "rank 0: x"), spec)
    assert res.detail.startswith("across 3 workers (this is worker 2)")
    assert across_workers(res, spec).detail == res.detail


# ----- the runtime (no TensorFlow needed to build it) --------------------------------------------
def test_the_runtime_feeds_the_global_batch_across_workers() -> None:
    rt = TfRuntime("mw_ring", (), 1, 64, 32, workers=2, timeout_s=300.0)
    assert (rt.replica_devices, rt.num_replicas, rt.batch_size_to_feed) == (("/cpu:0",), 2, 64)
    gpus = TfRuntime("mw_nccl", (0, 1), 1, 256, 32, workers=4)
    assert (gpus.num_replicas, gpus.batch_size_to_feed) == (8, 256)


@pytest.mark.parametrize(("backend", "acc", "workers"), [("mw_ring", 2, 2), ("cpu", 1, 2)])
def test_the_runtime_refuses_what_cannot_run(backend: str, acc: int, workers: int) -> None:
    with pytest.raises(InvalidOptionError):
        TfRuntime(backend, (), acc, 64, 32, workers=workers)
