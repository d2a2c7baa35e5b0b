"""The executor: options, environment precedence, cache, budget, agreement between ranks."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from resilient_strategy.core.call.arguments import Arguments, options_from
from resilient_strategy.core.knowledge.rules import rule_from_dict
from resilient_strategy.core.trace.choosing import Chosen
from resilient_strategy.core.trace.event import Event, Note
from resilient_strategy.core.trace.inputs import CachedFailure, FrameworkPicked
from resilient_strategy.core.trace.ruling import CandidateRuledOut, UserSettingKept
from resilient_strategy.core.values.facts import relevant_env
from resilient_strategy.deciding.cache import DecisionCache
from resilient_strategy.deciding.decide import FAULT_VAR, MAX_ROUNDS, Decision, decide
from resilient_strategy.errors import (
    DryRunError,
    FailureCause,
    FrameworkNotInstalledError,
    InvalidOptionError,
    NoWorkingStrategyError,
    RanksDisagreeError,
)
from resilient_strategy.machine import env as _env
from resilient_strategy.nodes.onenode import Agreement, AgreementTimeoutError
from resilient_strategy.testing import FakeProber, machine, simulate


def events(sel_or_plan: object, kind: type[Event]) -> list[Event]:
    plan = getattr(sel_or_plan, "plan", sel_or_plan)
    return [e for e in plan.events if isinstance(e, kind)]  # type: ignore[attr-defined]

H200X2 = machine(2, nvlink=18, env={"WORLD_SIZE": "2"})  # under torchrun


def opts_for(facts, env=None, **kw):  # type: ignore[no-untyped-def]
    base = dict(framework="torch", global_batch_size=64, devices=None, probe=None, timeout=None,
                prefer=None, dry_run=False, model=None, gradient_bytes=None, sample_seconds=None,
                max_per_replica_batch=None, rules=(), disable_rules=(), cache=False,
                cache_dir=None, cache_ttl=None, precision="auto", logical_cpus=0)
    base.update(kw)
    return options_from(facts, env or {}, Arguments.from_kwargs(**base))


def test_framework_resolution() -> None:
    both = machine(2, tensorflow="2.21.0", tf_cuda="12.5")
    with pytest.raises(InvalidOptionError, match="both torch and tensorflow"):
        simulate(both)
    assert simulate(machine(2)).framework == "torch"
    picked = events(simulate(machine(2)), FrameworkPicked)
    assert [(e.framework, e.reason) for e in picked] == [  # type: ignore[attr-defined]
        ("torch", "framework=None: torch is the one installed")]
    with pytest.raises(FrameworkNotInstalledError) as err:
        simulate(machine(2), framework="tensorflow")
    assert err.value.framework == "tensorflow"
    with pytest.raises(FrameworkNotInstalledError) as none:
        simulate(machine(2, torch=None))
    assert none.value.framework is None
    assert simulate(both, framework="keras").framework == "tensorflow"


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"probe": "sometimes"}, "probe must be"), ({"timeout": 0}, "timeout"),
     ({"global_batch_size": -1}, "positive"), ({"precision": "fp8"}, "precision"),
     ({"framework": "jax"}, "framework must be"), ({"framework": ["torch"]}, "framework must be"),
     ({"timeout": "30"}, "timeout must be a number"), ({"devices": 5}, "devices must be"),
     ({"devices": ["a"]}, "devices must be"), ({"devices": "01"}, "devices must be"),
     ({"cache_ttl": "x"}, "cache_ttl must be"), ({"sample_seconds": "1"}, "sample_seconds"),
     ({"global_batch_size": True}, "positive integer"), ({"gradient_bytes": 1.5}, "positive")],
)
def test_bad_options_are_typed_errors(kw: dict, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidOptionError, match=match):
        simulate(H200X2, **kw)


def test_environment_fills_unset_options_and_arguments_win() -> None:
    env = {"RESILIENT_STRATEGY_PROBE": "never", "RESILIENT_STRATEGY_TIMEOUT": "7",
           "RESILIENT_STRATEGY_DISABLE_RULES": "small-dev-shm", "RESILIENT_STRATEGY_PREFER": "gloo"}
    o = opts_for(H200X2, env)
    assert (o.probe, o.timeout_s, o.budget_s) == ("never", 7.0, 28.0)
    assert o.prefer == "gloo"
    assert opts_for(H200X2, env, prefer="nccl").prefer == "nccl"
    assert "small-dev-shm" not in {r.id for r in o.rules}
    o = opts_for(H200X2, env, probe="force", timeout=3.0)
    assert (o.probe, o.timeout_s) == ("force", 3.0)
    with pytest.raises(InvalidOptionError):
        opts_for(H200X2, {"RESILIENT_STRATEGY_TIMEOUT": "soon"})


def test_probe_never_chooses_unproven_and_says_so() -> None:
    prober = FakeProber()
    sel = simulate(H200X2, prober, probe="never")
    assert sel.backend == "nccl" and not sel.proven and prober.calls == []
    assert [e.how for e in events(sel, Chosen)] == ["probing_off"]  # type: ignore[attr-defined]


def test_dry_run_probes_nothing_and_sets_nothing() -> None:
    prober = FakeProber()
    sel = simulate(H200X2, prober, dry_run=True)
    assert prober.calls == [] and sel.dry_run and not sel.proven
    assert [e.how for e in events(sel, Chosen)] == ["dry_run"]  # type: ignore[attr-defined]
    with pytest.raises(DryRunError):
        _ = sel.runtime


def test_cache_hit_costs_no_probe_and_changed_machine_reprobes(tmp_path: Path) -> None:
    first = FakeProber({"nccl": "timeout"})
    a = simulate(H200X2, first, cache=True, cache_dir=tmp_path, global_batch_size=64)
    assert first.probed == ["nccl", "nccl+NCCL_P2P_DISABLE=1"] and not a.from_cache
    # a failure seen in one run only is probed again; the remedy's pass is trusted
    again = FakeProber({"nccl": "timeout"})
    a2 = simulate(H200X2, again, cache=True, cache_dir=tmp_path, global_batch_size=64)
    assert again.probed == ["nccl"] and a2.candidate == a.candidate
    second = FakeProber({"nccl": "ok"})  # would answer differently: proves it is not asked
    b = simulate(H200X2, second, cache=True, cache_dir=tmp_path, global_batch_size=64)
    assert second.calls == [] and b.from_cache and b.candidate == a.candidate
    assert b.to_dict()["from_cache"] is True
    forced = FakeProber({"nccl": "ok"})
    c = simulate(H200X2, forced, cache=True, cache_dir=tmp_path, probe="force", global_batch_size=64)
    assert forced.probed == ["nccl"] and c.backend == "nccl" and c.env == {}
    other = machine(2, nvlink=18, driver="590.1", env={"WORLD_SIZE": "2"})
    d_prober = FakeProber()
    simulate(other, d_prober, cache=True, cache_dir=tmp_path, global_batch_size=64)
    assert d_prober.probed == ["nccl"]


def test_corrupt_cache_degrades_to_probing(tmp_path: Path) -> None:
    DecisionCache(tmp_path).path(H200X2.fingerprint()).write_text("garbage")
    prober = FakeProber()
    sel = simulate(H200X2, prober, cache=True, cache_dir=tmp_path)
    assert prober.probed == ["nccl"] and sel.backend == "nccl"


def test_probe_budget_is_one_deadline_for_the_decision(tmp_path: Path) -> None:
    # consumer cards on AWS in a container with a small /dev/shm: SHM-off and P2P-off first,
    # plain NCCL, NCCL_NET=Socket, then gloo: 5 probes, each hanging to its deadline, for a
    # budget of 4 timeouts
    facts = machine(2, name="NVIDIA GeForce RTX 4090", cc=(8, 9), aws=True, container="docker",
                    shm_mb=64, env={"WORLD_SIZE": "2"})
    # a hang no progress judges, described with its elapsed time (the deadline)
    prober = FakeProber({"*": {"status": "timeout", "cause": "timeout", "elapsed_s": 10.0}})
    o = opts_for(facts, {"WORLD_SIZE": "2"}, timeout=10.0, gradient_bytes=1000,
                 sample_seconds=1.0, cache=True, cache_dir=tmp_path)
    d = decide(facts, o, {}, prober, clock=prober.clock)
    assert isinstance(d, Decision)
    p, results = d.plan, d.results
    assert d.proven and p.chosen is not None and p.chosen.backend == "single_device"
    # the probes keep to the budget; the GPU health checks are charged on top, never skipped:
    # the first hang is checked at once (issue 31), a later deadline hang on GPUs a killed probe
    # left is checked at once as well (where it stopped is unknown: issue 21 item 4), here
    # after the 1st and the 3rd probe, and the chosen GPU the 4th left unproven at the end
    assert sum(r.elapsed_s for r in results.values()) <= o.budget_s == 40.0
    assert prober.health_checks == [(0, 1), (0, 1), (0,)]
    probed = [r for r in results.values() if r.cause == "timeout"]
    skipped = [r for r in results.values() if r.cause == "budget"]
    assert len(probed) == 4 and len(skipped) == 1  # the last was never started
    budget = [e for e in events(p, CandidateRuledOut)
              if e.result is not None and e.result.cause == "budget"]  # type: ignore[attr-defined]
    assert len(budget) == 1 and budget[0].by == "probe"  # type: ignore[attr-defined]
    # what was never probed is not remembered as a failure: the next run probes it
    cached = DecisionCache(tmp_path, 3600).load(facts.fingerprint())
    assert set(cached) == {r.candidate for r in probed}


def test_a_failed_remedy_is_not_remedied_again() -> None:
    prober = FakeProber({"*": "timeout"})
    sel = simulate(H200X2, prober, global_batch_size=64, gradient_bytes=1000,
                   sample_seconds=1.0)
    # plain NCCL hangs -> one remedy (P2P off) -> gloo; never P2P+SHM off on top of P2P off
    assert prober.probed == ["nccl", "nccl+NCCL_P2P_DISABLE=1", "gloo"]
    assert sel.backend == "single_device"


def test_no_working_strategy_is_a_typed_error_with_causes() -> None:
    veto_all = rule_from_dict({"id": "nothing-works", "effect": "veto",
                               "target": ["nccl", "gloo", "single_device", "cpu"],
                               "message": "lab policy", "source": "test"})
    with pytest.raises(NoWorkingStrategyError) as err:
        simulate(H200X2, rules=[veto_all])
    causes = err.value.causes
    assert all(isinstance(c, FailureCause) for c in causes)
    assert [(c.status, c.cause, c.detail) for c in causes] == [
        ("ruled_out", "nothing-works", "lab policy")] * 4
    assert {c.key for c in causes} == {"torch:nccl:0,1", "torch:gloo:0,1", "torch:single_device:0",
                                       "torch:cpu:cpu"}


def test_failed_probes_are_causes_with_their_status() -> None:
    cpu_vetoed = rule_from_dict({"id": "no-cpu", "effect": "veto", "target": ["single_device", "cpu"],
                                 "message": "lab policy", "source": "test"})
    with pytest.raises(NoWorkingStrategyError) as err:
        simulate(H200X2, {"nccl": "timeout", "nccl+*": "error:nccl_error", "gloo": "error:crash"},
                 rules=[cpu_vetoed])
    by_key = {c.key: (c.status, c.cause) for c in err.value.causes}
    assert by_key["torch:nccl:0,1"] == ("timeout", "timeout")
    assert by_key["torch:gloo:0,1"] == ("error", "crash")
    assert by_key["torch:cpu:cpu"] == ("ruled_out", "no-cpu")


def test_a_used_up_round_limit_is_not_called_probing_off() -> None:
    """More probes than the per-decision limit: the choice says the limit was reached."""
    prober = FakeProber({"*": "timeout"})
    o = opts_for(H200X2, {"WORLD_SIZE": "2"}, timeout=1)
    d = decide(H200X2, o, {}, prober, clock=prober.clock, max_rounds=1)
    assert len(prober.calls) == 1 and not d.proven and MAX_ROUNDS > 1
    assert [e.how for e in events(d.plan, Chosen)] == ["rounds_spent"]  # type: ignore[attr-defined]


def test_user_variables_are_never_overwritten() -> None:
    environ = {"NCCL_P2P_DISABLE": "0"}
    applied = _env.apply({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}, environ)
    assert applied == {"NCCL_SHM_DISABLE": "1"}
    assert environ == {"NCCL_P2P_DISABLE": "0", "NCCL_SHM_DISABLE": "1"}
    consumer = machine(2, name="NVIDIA GeForce RTX 4090", cc=(8, 9),
                       env={"NCCL_P2P_DISABLE": "0", "WORLD_SIZE": "2"})
    sel = simulate(consumer, FakeProber({"nccl": "timeout"}))
    assert "NCCL_P2P_DISABLE" not in sel.env
    kept = events(sel, UserSettingKept)
    assert [(e.rule, e.variables) for e in kept] == [  # type: ignore[attr-defined]
        ("consumer-pcie-p2p", ("NCCL_P2P_DISABLE",)),
        # the remedy table's P2P off after the hang is skipped too, and the trace says so
        ("p2p-off (remedy for timeout)", ("NCCL_P2P_DISABLE",))]


def test_ranks_agree_local_rank_0_decides_others_follow(tmp_path: Path) -> None:
    facts = machine(2, nvlink=18)
    launch = {"WORLD_SIZE": "2", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "t1"}
    leader = FakeProber({"nccl": "timeout", "nccl+*": "ok:20"})
    a = simulate(facts=facts, env={**launch, "RANK": "0", "LOCAL_RANK": "0"},
                           cache_dir=tmp_path, outcomes=leader, global_batch_size=64,
                           gradient_bytes=1000, sample_seconds=1e-3, cache=True)
    follower = FakeProber()  # would say NCCL is fine: must not be asked
    b = simulate(facts=facts, env={**launch, "RANK": "1", "LOCAL_RANK": "1"},
                           cache_dir=tmp_path, outcomes=follower, global_batch_size=64,
                           gradient_bytes=1000, sample_seconds=1e-3, cache=True)
    assert follower.calls == [] and leader.probed[0] == "nccl"
    assert a.candidate == b.candidate and a.env == b.env
    assert (a.launch.rank, b.launch.rank) == (0, 1) and a.num_replicas == 2


def test_a_waiting_rank_imports_torch_while_rank_0_probes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 imports torch to fork its probe workers from itself; the waiting ranks import it
    while they wait (their scripts would right after), never with a simulated prober, and
    rank 0 never through this path."""
    from resilient_strategy.deciding import executor

    asked: list[tuple[str, ...]] = []
    monkeypatch.setattr(executor, "import_while_waiting", lambda *names: asked.append(names))

    class Real(FakeProber):
        starts_processes = True  # as the real prober: it starts processes

    facts = machine(2, nvlink=18)
    launch = {"WORLD_SIZE": "2", "MASTER_PORT": "29502", "TORCHELASTIC_RUN_ID": "t3"}
    for rank in ("0", "1"):
        simulate(facts=facts, env={**launch, "RANK": rank, "LOCAL_RANK": rank},
                 cache_dir=tmp_path, outcomes=Real(), global_batch_size=64, cache=True)
    assert asked == [("torch", "torch.distributed")]
    launch["TORCHELASTIC_RUN_ID"] = "t4"
    for rank in ("0", "1"):
        simulate(facts=facts, env={**launch, "RANK": rank, "LOCAL_RANK": rank},
                 cache_dir=tmp_path, outcomes=FakeProber(), global_batch_size=64, cache=True)
    assert asked == [("torch", "torch.distributed")]  # a simulated prober: nothing imported


def test_ranks_that_disagree_raise_a_typed_error(tmp_path: Path) -> None:
    launch = {"WORLD_SIZE": "2", "MASTER_PORT": "29501", "TORCHELASTIC_RUN_ID": "t2"}
    simulate(facts=machine(2, nvlink=18), env={**launch, "RANK": "0", "LOCAL_RANK": "0"},
                       cache_dir=tmp_path, outcomes=FakeProber(), global_batch_size=64, cache=True)
    with pytest.raises(RanksDisagreeError) as err:  # rank 1 prefers gloo, which nobody proved
        simulate(facts=machine(2, nvlink=18),
                           env={**launch, "RANK": "1", "LOCAL_RANK": "1"}, cache_dir=tmp_path,
                           outcomes=FakeProber(), global_batch_size=64, prefer="gloo", cache=True)
    assert (err.value.rank, err.value.planned, err.value.chosen) == (
        1, None, "torch:nccl:0,1")


def test_agreement_wait_has_a_deadline(tmp_path: Path) -> None:
    ag = Agreement(tmp_path / "agree.json")
    with pytest.raises(AgreementTimeoutError, match="crashed"):
        ag.wait(0.3, poll_s=0.05)
    ag.publish({"chosen": "x", "results": {}, "from_cache": False, "proven": True})
    assert ag.wait(1.0)["chosen"] == "x"


@pytest.mark.torch
def test_model_gives_gradient_bytes() -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(100, 10), torch.nn.Linear(10, 1))
    o = opts_for(H200X2, model=model)
    assert o.gradient_bytes == (100 * 10 + 10 + 10 + 1) * 4


def test_multi_node_plans_nccl_over_every_process_without_store_or_cache(tmp_path: Path) -> None:
    """A simulated multi-node job (issue 19): the described outcomes are the whole job's (a
    simulated prober spans the nodes), decided with no store, no network and no cache."""
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"}
    facts = machine(2, nvlink=18, env=env)
    prober = FakeProber({"nccl": "timeout", "nccl+NCCL_P2P_DISABLE=1": "ok:20"})
    sel = simulate(facts, prober, global_batch_size=512, cache=True, cache_dir=tmp_path)
    cached = [f for f in tmp_path.glob("*.json") if not f.name.startswith("agree-")]
    assert prober.probed == ["nccl", "nccl+NCCL_P2P_DISABLE=1"] and not cached
    assert (sel.backend, sel.devices, sel.num_replicas) == ("nccl", (0, 1), 4)
    assert dict(sel.env) == {"NCCL_P2P_DISABLE": "1"} and sel.per_replica_batch_size == 128
    # node 0's own NCCL (issue 31) is estimated faster than NCCL across the nodes, and is
    # kept after them: the note says so
    assert [e.topic for e in events(sel, Note)] == [  # type: ignore[attr-defined]
        "multi_node", "alone_after_nodes"]
    assert [e.how for e in events(sel, Chosen)] == ["probe_passed"]  # type: ignore[attr-defined]
    with pytest.raises(InvalidOptionError, match="LOCAL_WORLD_SIZE=3"):
        simulate(machine(2, env={"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "3"}))


def test_a_failure_seen_once_is_probed_again_and_trusted_once_seen_twice(
    tmp_path: Path,
) -> None:
    # eight deciders on two cores: the NCCL probe timed out from load, not from NCCL
    loaded = FakeProber({"nccl": "timeout"})
    simulate(H200X2, loaded, cache=True, cache_dir=tmp_path, global_batch_size=64)
    quiet = FakeProber()
    sel = simulate(H200X2, quiet, cache=True, cache_dir=tmp_path, global_batch_size=64)
    assert quiet.probed == ["nccl"] and sel.backend == "nccl" and sel.env == {}
    assert events(sel, CachedFailure) == [CachedFailure("torch:nccl:0,1", "timeout", 1, False)]
    entries = DecisionCache(tmp_path).entries(H200X2.fingerprint())
    assert entries["torch:nccl:0,1"].result.ok and entries["torch:nccl:0,1"].seen == 1
    # a real failure, seen in two runs in a row, is trusted from then on
    for _ in range(2):
        simulate(H200X2, {"nccl": "error"}, cache=True, cache_dir=tmp_path, probe="force",
                 global_batch_size=64)
    assert DecisionCache(tmp_path).entries(H200X2.fingerprint())["torch:nccl:0,1"].seen == 2
    trusting = FakeProber()
    sel = simulate(H200X2, trusting, cache=True, cache_dir=tmp_path, global_batch_size=64)
    assert trusting.probed == [] and sel.from_cache and sel.candidate.key != "torch:nccl:0,1"
    assert CachedFailure("torch:nccl:0,1", "error", 2, True) in events(sel, CachedFailure)


def test_results_under_fault_injection_are_never_cached(tmp_path: Path) -> None:
    # the same machine (the fault variable is not part of the fingerprint), rehearsing a failure
    assert relevant_env({FAULT_VAR: "exit:1"}) == ()
    prober = FakeProber({"nccl": "error", "nccl+*": "error", "gloo": "error"})
    sel = simulate(H200X2, prober, cache=True, cache_dir=tmp_path, global_batch_size=64,
                   env={**H200X2.env_map, FAULT_VAR: "exit:1"})
    assert sel.backend == "single_device"
    assert [e.topic for e in events(sel, Note)].count("fault_injection") == 1  # type: ignore[attr-defined]
    assert not DecisionCache(tmp_path).path(H200X2.fingerprint()).exists()
    real = FakeProber()
    sel = simulate(H200X2, real, cache=True, cache_dir=tmp_path, global_batch_size=64)
    assert real.probed == ["nccl"] and sel.backend == "nccl" and not sel.from_cache


def test_fault_variable_is_the_one_the_workers_read() -> None:
    from resilient_strategy.probing.workers.common import FAULT_VAR as WORKERS

    assert FAULT_VAR == WORKERS


def test_probe_never_still_uses_what_the_cache_knows(tmp_path: Path) -> None:
    simulate(H200X2, {"nccl": "timeout"}, cache=True, cache_dir=tmp_path, gradient_bytes=1000,
             sample_seconds=1.0)
    prober = FakeProber()
    sel = simulate(H200X2, prober, probe="never", cache=True, cache_dir=tmp_path,
                   gradient_bytes=1000, sample_seconds=1.0)
    assert prober.probed == [] and sel.proven and sel.from_cache
    assert sel.candidate.key == "torch:nccl:0,1:NCCL_P2P_DISABLE=1"  # plain NCCL hung last time


def test_a_hang_cached_under_a_shorter_timeout_is_probed_again(tmp_path: Path) -> None:
    simulate(H200X2, {"nccl": "timeout"}, cache=True, cache_dir=tmp_path, timeout=5)
    prober = FakeProber()
    sel = simulate(H200X2, prober, cache=True, cache_dir=tmp_path, timeout=30)
    assert prober.probed == ["nccl"] and sel.backend == "nccl"


def test_a_decision_for_a_given_env_changes_nothing_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    consumer = machine(2, name="NVIDIA GeForce RTX 4090", cc=(8, 9), env={"WORLD_SIZE": "2"})
    sel = simulate(consumer, {"nccl+NCCL_P2P_DISABLE=1": "ok"})
    assert sel.env == {"NCCL_P2P_DISABLE": "1"} and not sel.env_applied
    assert "NCCL_P2P_DISABLE" not in os.environ
    assert sel.to_dict()["env"] == {"NCCL_P2P_DISABLE": "1"} and not sel.to_dict()["env_applied"]


def test_a_wrong_sum_from_nccl_tries_p2p_off_next() -> None:
    prober = FakeProber({"nccl": "error:wrong_result"})
    sel = simulate(H200X2, prober, gradient_bytes=1000, sample_seconds=1.0)
    assert prober.probed == ["nccl", "nccl+NCCL_P2P_DISABLE=1"]
    assert sel.candidate.env == (("NCCL_P2P_DISABLE", "1"),)


def test_process_group_timeout_is_its_own_option() -> None:
    assert opts_for(H200X2).process_group_timeout == 300.0
    assert opts_for(H200X2, {"RESILIENT_STRATEGY_PG_TIMEOUT": "90"}).process_group_timeout == 90.0
    assert opts_for(H200X2, {"RESILIENT_STRATEGY_PG_TIMEOUT": "90"},
                    process_group_timeout=45).process_group_timeout == 45.0
    sel = simulate(H200X2, timeout=5, process_group_timeout=120)
    assert sel.process_group_timeout == 120.0  # not the probe's 5 s
    with pytest.raises(InvalidOptionError):
        opts_for(H200X2, process_group_timeout=0)


def test_the_logical_cpu_test_mode_never_touches_the_cache(tmp_path: Path) -> None:
    tf = machine(0, torch=None, tensorflow="2.21.0")
    o = opts_for(tf, framework="tensorflow", logical_cpus=2, cache=True, cache_dir=tmp_path)
    assert o.cache_dir is None


def test_an_idle_rank_exits_cleanly_instead_of_training_a_duplicate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    launch = {"WORLD_SIZE": "2", "MASTER_PORT": "29511"}
    sels = [
        simulate(facts=machine(2), env={**launch, "RANK": r, "LOCAL_RANK": r},
                           cache_dir=tmp_path, outcomes=FakeProber({"*": "timeout"}),
                           global_batch_size=64, gradient_bytes=400_000_000, cache=True)
        for r in ("0", "1")  # local rank 0 decides first; rank 1 follows its decision
    ]
    assert [(s.backend, s.active) for s in sels] == [("single_device", True),
                                                      ("single_device", False)]
    with pytest.raises(SystemExit) as leave:
        sels[1].prepare(object())
    assert leave.value.code == 0 and "rank 1 has nothing to do" in caplog.text
    with pytest.raises(SystemExit), sels[1].scope():
        pass


def test_the_real_model_size_is_checked_against_the_assumed_one() -> None:
    # NCCL failed; gloo was ranked above one GPU for the assumed ResNet-50-sized model
    sel = simulate(H200X2, {"nccl": "error:nccl_invalid_usage", "gloo": "ok:2.2"},
                   global_batch_size=512)
    assert sel.backend == "gloo" and sel.advise is not None
    advice = sel.advise(400_000_000)
    assert advice is not None and "one GPU" in advice and "gradient_bytes=400000000" in advice
    healthy = simulate(H200X2, {"nccl": "ok:200"}, global_batch_size=512)
    assert healthy.backend == "nccl" and healthy.advise is not None
    assert healthy.advise(400_000_000) is None  # NCCL stays the best choice: nothing to say
    described = simulate(H200X2, {"nccl": "error:nccl_invalid_usage"}, gradient_bytes=4000)
    assert described.advise is None


def test_tensorflow_helpers_pass_through_and_refuse_on_torch() -> None:
    tf_only = machine(0, torch=None, tensorflow="2.21.0")
    sel = simulate(tf_only, framework="tensorflow", global_batch_size=64)
    # nothing to check (no accumulation): only the step's measurement (issue 41 item 6)
    assert sel.backend == "cpu"
    if importlib.util.find_spec("keras") is not None:  # the callback is Keras' own class
        assert [type(c).__name__ for c in sel.callbacks()] == ["MeasureStep"]
    assert sel.optimizer_kwargs(learning_rate=0.1) == {"learning_rate": 0.1}
    torch_sel = simulate(H200X2, {"nccl": "ok"})
    assert torch_sel.optimizer_kwargs(learning_rate=0.1) == {"learning_rate": 0.1}
    for name in ("callbacks", "wrap_optimizer", "check_optimizer"):
        with pytest.raises(AttributeError, match="TensorFlow's"):
            getattr(torch_sel, name)(*([] if name == "callbacks" else [object()]))


def test_from_cache_only_when_a_cached_result_shaped_the_plan(tmp_path: Path) -> None:
    simulate(H200X2, {"nccl": "ok"}, cache=True, cache_dir=tmp_path)
    assert simulate(H200X2, cache=True, cache_dir=tmp_path).from_cache
    # the same machine, but only GPU 0 asked for: no candidate has a cached result
    one = simulate(H200X2, cache=True, cache_dir=tmp_path, devices=[0])
    assert one.backend == "single_device" and not one.from_cache


def test_ranks_agree_privately_when_the_cache_directory_is_open_to_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    facts = machine(2, nvlink=18)
    launch = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "29500",
              "TORCHELASTIC_RUN_ID": "t2", "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    # another user plants a decision for CPU where the agreement used to go, and a cache entry
    name = Agreement.for_job(launch, facts.fingerprint(), tmp_path / "any").path.name
    (shared / name).write_text(json.dumps({"chosen": "torch:cpu", "results": {}, "from_cache": True,
                                           "proven": True, "published_at": 4e9}))
    bad = {"torch:nccl:0,1": {"at": 4e9, "seen": 9, "result": {
        "candidate": "torch:nccl:0,1", "status": "error", "cause": "worker_error"}}}
    DecisionCache(shared).path(facts.fingerprint()).write_text(json.dumps(
        {"version": 1, "fingerprint": facts.fingerprint(), "results": bad}))
    if os.geteuid() == 0:
        for f in shared.iterdir():
            os.chown(f, 65534, 65534)
    with caplog.at_level("WARNING", logger="resilient_strategy"):
        a = simulate(facts=facts, env={**launch, "RANK": "0", "LOCAL_RANK": "0"},
                               cache_dir=shared, outcomes=FakeProber(), global_batch_size=64, cache=True)
        b = simulate(facts=facts, env={**launch, "RANK": "1", "LOCAL_RANK": "1"},
                               cache_dir=shared, outcomes=FakeProber(), global_batch_size=64, cache=True)
    assert a.backend == b.backend == "nccl" and not a.from_cache
    assert "writable by others" in caplog.text
    assert sorted(f.name for f in shared.iterdir()) == sorted(
        [name, f"{facts.fingerprint()}.v1.json"])  # refused, untouched
    assert list((tmp_path / "run" / "resilient_strategy").iterdir()) == []  # read, then removed
