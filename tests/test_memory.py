"""Memory-aware planning (issue 24): what each candidate needs per device against its devices'
free memory, sharding="auto" | "full" | "none", and the ladder that skips what cannot hold the
model. Pure: hand-written facts in, plans and typed events out."""

from __future__ import annotations

from typing import Any

import pytest

from resilient_strategy.core.call.model import repeated_blocks, unit_bytes_of
from resilient_strategy.core.call.options import Options
from resilient_strategy.core.knowledge.rules import load_rules
from resilient_strategy.core.measures.memory import (
    ASSUMED_UNITS,
    MEMORY_HEADROOM,
    TRANSIENT_UNITS,
    ModelMemory,
    model_memory,
)
from resilient_strategy.core.measures.probe import ProbeResult
from resilient_strategy.core.planning.plan import plan
from resilient_strategy.core.trace.fitting import (
    FewerDevices,
    MemoryChecked,
    OffloadConsidered,
    ShardingDecided,
)
from resilient_strategy.core.trace.ruling import CandidateRuledOut
from resilient_strategy.core.values.facts import Facts, FrameworkInfo, Gpu, Host, Link
from resilient_strategy.deciding.executor import resilient_strategy
from resilient_strategy.errors import InvalidOptionError, ModelDoesNotFitError
from resilient_strategy.machine.host import parse_meminfo
from resilient_strategy.testing import simulate
from resilient_strategy.testing.simulation import gpu, machine

RULES = load_rules()
TORCH = FrameworkInfo("torch", "2.11.0", "torch", "13.0", "2.28.9")
GiB = 2**30
LAUNCH = {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}


def a100s(free_gib: float | None = 79, n: int = 4, host_gib: int | None = 64) -> Facts:
    free = None if free_gib is None else int(free_gib * GiB)
    gpus = tuple(Gpu(i, "NVIDIA A100-SXM4-80GB", (8, 0), 80 * GiB, f"GPU-{i}",
                     memory_free_bytes=free) for i in range(n))
    links = tuple(Link(a, b, "hostbridge", 12, "ok", "ok") for a in range(n) for b in range(a + 1, n))
    host = Host(shm_bytes=64 * GiB, memory_available_bytes=None if host_gib is None
                else host_gib * GiB)
    return Facts(gpus=gpus, links=links, host=host, frameworks=(TORCH,))


def opts(param_gib: float | None, sharding: str = "auto", **kw: Any) -> Options:
    kw.setdefault("global_batch_size", 64)
    return Options("torch", world_size=4, sharding=sharding,
                   param_bytes=None if param_gib is None else int(param_gib * GiB), **kw)


def keys(p: Any) -> list[str]:
    return [c.key for c in p.candidates]


def event(p: Any, kind: type) -> Any:
    found = [e for e in p.events if isinstance(e, kind)]
    assert len(found) == 1, found
    return found[0]


# ----- the arithmetic ----------------------------------------------------------------------------
def test_replica_holds_params_grads_and_optimizer_state_sharded_a_share_plus_gathered_units() -> None:
    mem = ModelMemory(param_bytes=100, gradient_bytes=100, optimizer_bytes=200, unit_bytes=10)
    assert mem.state_bytes == 400
    assert mem.need(1) == 400
    assert mem.need(4) == 100 + TRANSIENT_UNITS * 10


def test_model_memory_defaults_gradients_to_params_and_assumes_a_unit() -> None:
    mem = model_memory(Options("torch", param_bytes=8000, optimizer_state_factor=1.0))
    assert mem is not None
    assert (mem.gradient_bytes, mem.optimizer_bytes) == (8000, 8000)
    assert mem.unit_bytes == 8000 // ASSUMED_UNITS and mem.unit_assumed
    assert model_memory(Options("torch")) is None


# ----- sharding="auto" | "full" | "none" -----------------------------------------------------
def test_auto_shards_when_a_replica_does_not_fit_and_rules_out_one_device_fallbacks() -> None:
    p = plan(a100s(), RULES, {}, opts(28))
    assert keys(p) == ["torch:nccl/fsdp:0,1,2,3", "torch:gloo/fsdp:0,1,2,3"]
    decided = event(p, ShardingDecided)
    assert (decided.mode, decided.sharded, decided.reason) == ("auto", True,
                                                              "replica_does_not_fit")
    assert decided.replica_bytes == 112 * GiB
    assert decided.usable_bytes == int(79 * GiB * (1 - MEMORY_HEADROOM))
    out = {e.candidate.key: e for e in p.events
           if isinstance(e, CandidateRuledOut) and e.by == "memory"}
    assert sorted(out) == ["torch:cpu:cpu", "torch:single_device:0"]
    rows = {r.candidate.key: r for r in event(p, MemoryChecked).rows}
    assert rows["torch:single_device:0"].need_bytes == 112 * GiB
    assert rows["torch:single_device:0"].fits is False
    assert rows["torch:nccl/fsdp:0,1,2,3"].need_bytes == 28 * GiB + TRANSIENT_UNITS * (
        28 * GiB // ASSUMED_UNITS)
    assert rows["torch:nccl/fsdp:0,1,2,3"].fits is True
    assert rows["torch:cpu:cpu"].where == "host"
    assert {r.rule for r in p.ruled_out} == {"memory"}


def test_auto_replicates_when_a_replica_fits() -> None:
    p = plan(a100s(), RULES, {}, opts(1))
    assert not any(c.sharded for c in p.candidates)
    assert event(p, ShardingDecided).reason == "replica_fits"
    assert "torch:single_device:0" in keys(p)
    assert all(r.fits for r in event(p, MemoryChecked).rows)


def test_auto_without_a_model_size_replicates_and_checks_nothing() -> None:
    p = plan(a100s(), RULES, {}, opts(None))
    assert not any(isinstance(e, (MemoryChecked, ShardingDecided)) for e in p.events)
    assert not any(c.sharded for c in p.candidates)


def test_full_always_shards_and_keeps_fallbacks_that_fit() -> None:
    p = plan(a100s(), RULES, {}, opts(1, "full"))
    assert event(p, ShardingDecided).reason == "asked"
    assert [c.key for c in p.candidates if c.num_replicas > 1] == [
        "torch:nccl/fsdp:0,1,2,3", "torch:gloo/fsdp:0,1,2,3"]
    assert "torch:single_device:0" in keys(p)


def test_none_never_shards_so_a_model_that_fits_nowhere_leaves_nothing() -> None:
    p = plan(a100s(), RULES, {}, opts(28, "none"))
    assert p.candidates == () and p.chosen is None and p.next_probe is None
    assert {r.rule for r in p.ruled_out} == {"memory"}
    assert not any(isinstance(e, ShardingDecided) for e in p.events)


def test_unknown_free_memory_rules_nothing_out() -> None:
    p = plan(a100s(free_gib=None, host_gib=None), RULES, {}, opts(28))
    assert not any(r.rule == "memory" for r in p.ruled_out)
    assert not any(c.sharded for c in p.candidates)  # nothing known to decide on


def test_the_smallest_free_memory_among_the_devices_decides() -> None:
    facts = a100s()
    busy = Gpu(2, "NVIDIA A100-SXM4-80GB", (8, 0), 80 * GiB, "GPU-2", memory_free_bytes=20 * GiB)
    facts = Facts(gpus=(*facts.gpus[:2], busy, facts.gpus[3]), links=facts.links,
                  host=facts.host, frameworks=facts.frameworks)
    p = plan(facts, RULES, {}, opts(28))
    rows = {r.candidate.key: r for r in event(p, MemoryChecked).rows}
    assert rows["torch:nccl/fsdp:0,1,2,3"].where == "GPU 2"
    assert rows["torch:nccl/fsdp:0,1,2,3"].fits is False
    # the step-down shards over the GPUs with the most free memory (3 does not split 64)
    assert event(p, FewerDevices).unsplit == (3,)
    assert keys(p) == ["torch:nccl/fsdp:0,1", "torch:gloo/fsdp:0,1"]


def test_a_failed_sharded_probe_steps_down_to_sharded_gloo_never_to_one_gpu() -> None:
    results = {k: ProbeResult(k, "error", 2.0, "nccl_error", "x") for k in (
        "torch:nccl/fsdp:0,1,2,3", "torch:nccl/fsdp:0,1,2,3:NCCL_P2P_DISABLE=1",
        "torch:nccl/fsdp:0,1,2,3:NCCL_SHM_DISABLE=1")}
    p = plan(a100s(), RULES, results, opts(28))
    assert p.next_probe is not None and p.next_probe.key == "torch:gloo/fsdp:0,1,2,3"
    assert keys(p) == ["torch:gloo/fsdp:0,1,2,3"]


def test_sharded_estimate_moves_more_bytes_than_an_all_reduce() -> None:
    p = plan(a100s(), RULES, {}, opts(1, "full", gradient_bytes=GiB))
    q = plan(a100s(), RULES, {}, opts(1, "none", gradient_bytes=GiB))
    sharded = next(r for r in p.ranked if r.candidate.key == "torch:nccl/fsdp:0,1,2,3")
    replicated = next(r for r in q.ranked if r.candidate.key == "torch:nccl:0,1,2,3")
    assert sharded.estimate.step_seconds >= replicated.estimate.step_seconds


# ----- the typed error with the memory table ---------------------------------------------------
def test_nothing_fits_raises_the_memory_table() -> None:
    facts = machine([gpu(i, "NVIDIA A100-SXM4-80GB", (8, 0), 80, free_gb=10) for i in range(4)],
                    host_memory_gb=16, env=LAUNCH)
    with pytest.raises(ModelDoesNotFitError) as err:
        resilient_strategy("torch", facts=facts, env=LAUNCH, dry_run=True, cache=False,
                           param_bytes=28 * GiB, global_batch_size=64)
    table = {(row.key, row.where): row for row in err.value.table}
    assert {key for key, _ in table} == {
        "torch:nccl/fsdp:0,1,2,3", "torch:gloo/fsdp:0,1,2,3", "torch:single_device:0",
        "torch:cpu:cpu", "torch:nccl/fsdp:0,1", "torch:nccl/fsdp+offload:0,1,2,3",
        "torch:gloo/fsdp+offload:0,1,2,3", "torch:single_device/fsdp+offload:0"}
    assert not err.value.offload_would_fit
    assert all(row.fits is False for (key, _), row in table.items() if "offload" not in key)
    assert all(table[key, "host"].fits is False for key, _ in table if "offload" in key)
    table = {key: row for (key, _), row in table.items()}
    assert table["torch:nccl/fsdp:0,1,2,3"].shards == 4
    assert table["torch:nccl/fsdp:0,1,2,3"].free_bytes == 10 * GiB
    assert {c.cause for c in err.value.causes} == {"memory"}


# ----- options, facts, the testing kit ---------------------------------------------------------
@pytest.mark.parametrize("kw", [{"sharding": "some"}, {"optimizer_state_factor": -1.0},
                                {"optimizer_state_factor": float("nan")}, {"param_bytes": 0}])
def test_bad_memory_options_are_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidOptionError):
        Options("torch", **kw)


def test_full_sharding_is_refused_for_tensorflow() -> None:
    with pytest.raises(InvalidOptionError) as err:
        Options("tensorflow", sharding="full")
    assert err.value.option == "sharding"


def test_gpu_describes_free_memory_and_machine_takes_gpu_objects() -> None:
    facts = machine([{"index": 0, "memory_gb": 80, "free_gb": 40}, {"index": 1}],
                    host_memory_gb=8)
    assert facts.gpus[0].memory_free_bytes == 40 * GiB
    assert facts.gpus[1].memory_free_bytes is None
    assert facts.host.memory_available_bytes == 8 * GiB
    with pytest.raises(InvalidOptionError):
        gpu(0, memory_gb=80, free_gb=81)


def test_meminfo_gives_available_bytes() -> None:
    text = "MemTotal:       16314856 kB\nMemFree:  1 kB\nMemAvailable:   12000000 kB\n"
    assert parse_meminfo(text) == 12000000 * 1024
    assert parse_meminfo("MemTotal: 5 kB\n") is None
    assert parse_meminfo(None) is None


class _P:
    def __init__(self, n: int) -> None:
        self.n = n

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return 4


class _M:
    """A duck-typed module: children, and parameters (own, or with its children's)."""

    def __init__(self, own: int = 0, *kids: _M) -> None:
        self.own, self.kids = own, kids

    def children(self) -> tuple[_M, ...]:
        return self.kids

    def modules(self) -> list[_M]:
        out: list[_M] = [self]
        for k in self.kids:
            out += k.modules()
        return out

    def parameters(self, recurse: bool = True) -> list[_P]:
        out = [_P(self.own)] if self.own else []
        if recurse:
            for k in self.kids:
                out += k.parameters()
        return out


class _Block(_M):
    pass


class _Layers(_M):
    pass




def test_repeated_blocks_are_the_default_sharding_units() -> None:
    blocks = [_Block(100), _Block(100), _Block(150)]
    # the embedding and the head are of one class too (two Linear layers): the blocks hold more
    model = _M(0, _M(200), _Layers(0, *blocks), _M(10))
    assert repeated_blocks(model) == blocks
    # the root keeps the embedding and the head: 210 parameters, the largest unit
    assert unit_bytes_of(model) == 210 * 4
    assert unit_bytes_of(model, blocks[:2]) == (150 + 210) * 4
    assert repeated_blocks(_M(5)) == []


# ----- `resilient-strategy run`: the supervisor's sharding decides ------------------------------
def test_a_worker_follows_the_supervisors_sharding(tmp_path: Any, monkeypatch: Any) -> None:
    from resilient_strategy.records import handoff

    monkeypatch.setattr(handoff, "WORKER", handoff.WorkerState())
    key = "torch:gloo/fsdp:cpu"
    results = {key: ProbeResult(key, "ok", 1.0, ranks=2)}
    path = tmp_path / "decision.json"
    handoff.write_decision(path, handoff.HandedDecision(
        framework="torch", chosen=key, results=results, run_dir=str(tmp_path), processes=2,
        reference_replicas=2))
    env = {handoff.DECISION_VAR: str(path), "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}

    def no_probe(spec: object, env: object) -> ProbeResult:
        raise AssertionError("a worker of `resilient-strategy run` must not probe")

    # the script said nothing of its model: its own plan replicates, the handed one shards
    sel = simulate(framework="torch", global_batch_size=64, facts=machine(0, torch="2.13.0"),
                             env=env, outcomes=no_probe, cache=True)
    assert sel.sharded and sel.candidate.key == key and sel.num_replicas == 2
    assert sel.progress is not None
    sel.progress.writer.close()


def test_run_takes_the_memory_options() -> None:
    from resilient_strategy.core.call.options import RunOptions

    with pytest.raises(InvalidOptionError):
        RunOptions("train.py", param_bytes=0)
    assert RunOptions("train.py", sharding="full", param_bytes=8).sharding == "full"


# ----- the step-down rungs: FSDP over fewer GPUs, CPU offload ----------------------------------
def _failed(*keys: str) -> dict[str, ProbeResult]:
    return {k: ProbeResult(k, "error", 2.0, "nccl_error", "x") for k in keys}


def test_fewer_gpus_only_once_fsdp_over_all_of_them_is_out() -> None:
    o = opts(8, "full", global_batch_size=96)
    first = plan(a100s(free_gib=40), RULES, {}, o)
    assert not any(isinstance(e, FewerDevices) for e in first.events)
    wide = ("torch:nccl/fsdp:0,1,2,3", "torch:nccl/fsdp:0,1,2,3:NCCL_P2P_DISABLE=1",
            "torch:nccl/fsdp:0,1,2,3:NCCL_SHM_DISABLE=1", "torch:gloo/fsdp:0,1,2,3")
    p = plan(a100s(free_gib=40), RULES, _failed(*wide), o)
    step = event(p, FewerDevices)
    assert step.widest == 4 and step.chosen is not None and step.chosen.num_replicas == 3
    sub = [c for c in p.candidates if c.num_replicas == 3]
    assert [c.key for c in sub] == ["torch:nccl/fsdp:0,1,2", "torch:gloo/fsdp:0,1,2"]
    # the job's per-device batch (24) stays; accumulation keeps the global batch exact
    assert [(c.per_replica_batch_size, c.accumulation_steps) for c in sub] == [(16, 2), (16, 2)]


def test_offload_is_planned_only_when_allowed_and_says_its_cost() -> None:
    facts = a100s(free_gib=16, host_gib=512)
    none = plan(facts, RULES, {}, opts(28))
    said = event(none, OffloadConsidered)
    assert said.mode == "none" and said.would_fit and not any(c.offload for c in none.candidates)
    auto = plan(facts, RULES, {}, opts(28, offload="auto"))
    planned = event(auto, OffloadConsidered)
    assert planned.mode == "auto" and planned.costs
    assert all(copy_s > 0 and opt_s > 0 for _, copy_s, opt_s in planned.costs)
    assert auto.next_probe is not None and auto.next_probe.offload
    assert {c.key for c in auto.candidates} >= {"torch:nccl/fsdp+offload:0,1,2,3",
                                                 "torch:single_device/fsdp+offload:0"}


def test_offload_is_validated_like_the_other_options() -> None:
    with pytest.raises(InvalidOptionError) as err:
        opts(28, offload="params")
    assert err.value.option == "offload"
    with pytest.raises(InvalidOptionError):
        Options("tensorflow", offload="auto")
    with pytest.raises(InvalidOptionError) as err:
        opts(28, "none", offload="auto")
    assert err.value.option == "offload"
    assert opts(28).offload == "none"  # the default never offloads


def test_ranks_beyond_the_subset_leave_and_the_first_ones_train_as_one_group() -> None:
    from pathlib import Path

    from resilient_strategy.testing.simulation import SimulatedProber, load_simulation

    case = Path(__file__).parents[1] / "examples/machines/a100x4_fsdp_steps_down_to_two_gpus.json"
    facts, sim = load_simulation(case)
    got = {}
    for rank in (1, 3):
        env = {**facts.env_map, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        sel = simulate(framework="torch", facts=facts, env=env, cache=False, quiet=True,
                                 param_bytes=sim["param_bytes"], global_batch_size=96,
                                 outcomes=SimulatedProber(sim["probes"]), alone=True)
        got[rank] = (sel.active, sel.world_size, sel.devices)
    assert got == {1: (True, 2, (0, 1)), 3: (False, 2, (0, 1))}


def test_full_sharding_ranks_the_one_device_fallback_below_every_sharded_candidate() -> None:
    """A 1 GiB model whose FSDP probe measured a slow link: one GPU is estimated faster (no
    communication), but sharding="full" is the user's choice: the one-device candidate stays a
    fallback, tried only once every sharded candidate is out (seen on 2 x H200: a 268M-parameter
    model asked to shard was trained on one GPU while the other rank left)."""
    facts = a100s(free_gib=140, n=2)
    key = "torch:nccl/fsdp:0,1"
    measured = {key: ProbeResult(key, "ok", 1.0, bus_bandwidth_gbps=5.0, message_bytes=GiB)}
    asked = Options("torch", world_size=2, sharding="full", param_bytes=GiB,
                    global_batch_size=64)
    ranked = [r.candidate for r in plan(facts, RULES, measured, asked).ranked]
    assert [c.key for c in ranked[:2]] == [key, "torch:gloo/fsdp:0,1"]
    assert ranked[2].key == "torch:single_device:0"
