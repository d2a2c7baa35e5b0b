"""The kit's clock is the prober's clock (issue 21): what a simulated probe costs, by how it ends,
comes from the prober's own stall policy and the typical figures of its class of machine."""

from __future__ import annotations

from dataclasses import replace

import pytest

from resilient_strategy.core.measures.probe import TIMEOUT, ProbeSpec
from resilient_strategy.probing import cost
from resilient_strategy.probing.cost import (
    ENDINGS,
    Figures,
    first_collective,
    health_check_seconds,
    probe_seconds,
    stall_policy,
)
from resilient_strategy.testing import FakeProber, machine, simulate

NCCL2 = ProbeSpec("torch:nccl:0,1", "torch", "nccl", (0, 1), world_size=2, timeout_s=30.0)
GLOO2_CPU = ProbeSpec("torch:gloo:cpu", "torch", "gloo", (), world_size=2, timeout_s=30.0)
TF4 = ProbeSpec("tensorflow:nccl:0,1,2,3", "tensorflow", "nccl", (0, 1, 2, 3), timeout_s=30.0)
TF_ACROSS = replace(TF4, backend="mw_ring", workers=2)
ZERO = Figures(import_s=0.0, fork_s=0.0, device_s=0.0, setup_s=0.0, bus_bytes_per_s=1e12,
               latency_s=0.0, step_s=0.0)


@pytest.mark.parametrize("spec", [NCCL2, GLOO2_CPU, TF4])
def test_each_hang_kind_costs_the_probers_own_allowance(spec: ProbeSpec) -> None:
    # with no start-up, a hang costs exactly the allowance the runner's watcher is given
    policy = stall_policy(spec)
    nbytes, allow = first_collective(spec)
    want = {
        "setup": policy.setup_grace_s,
        "straggler": policy.arrive_grace_s,
        "collective": policy.collective_grace(1, nbytes, allow),
        "quiet": policy.quiet_s,
    }
    got = {kind: probe_seconds(spec, kind, figures=ZERO) for kind in cost.HANG_KINDS}
    assert got == {k: round(v or 0.0, 3) for k, v in want.items()}


def test_the_field_figures_of_a_hung_nccl_probe() -> None:
    # benchmarks/results/h100x2-2026-11-25.md: collective 1 allowed 8.0 s, cut 9.1 s after fork
    nbytes, allow = first_collective(NCCL2)
    assert round(stall_policy(NCCL2).collective_grace(1, nbytes, allow), 1) == 8.0
    assert probe_seconds(NCCL2, "collective", forked=True, warm=True) == pytest.approx(9.1, abs=0.05)
    # the first probe of a decision pays the fork server's import of torch
    assert (probe_seconds(NCCL2, "collective", forked=True)
            - probe_seconds(NCCL2, "collective", forked=True, warm=True)) == pytest.approx(
                cost.figures_for(NCCL2).import_s)


def test_a_hang_progress_cannot_judge_runs_to_the_deadline() -> None:
    assert not cost.judged_by_progress(TF_ACROSS) and cost.judged_by_progress(TF4)
    assert {probe_seconds(TF_ACROSS, e) for e in ENDINGS if e != "ok"} == {TF_ACROSS.timeout_s}
    assert probe_seconds(TF4, "collective") < TF4.timeout_s


def test_costs_are_bounded_by_the_timeout_and_ordered() -> None:
    short = replace(NCCL2, timeout_s=5.0)
    assert all(probe_seconds(short, e) <= 5.0 for e in ENDINGS)
    assert probe_seconds(NCCL2, "straggler") < probe_seconds(NCCL2, "collective") < 30.0
    with pytest.raises(ValueError):
        probe_seconds(NCCL2, "slow")


def test_the_health_check_costs_a_start_up_and_each_gpu() -> None:
    f = cost.figures_for(NCCL2)
    assert health_check_seconds("torch", 0) == 0.0
    # forked from the warm fork server: no second import of torch
    assert health_check_seconds("torch", 4, forked=True, warm=True) == pytest.approx(
        f.fork_s + 4 * f.device_s)
    assert health_check_seconds("torch", 2) == pytest.approx(f.import_s + 2 * f.device_s)


def test_gloo_connects_in_setup_so_collective_1_has_no_connection_allowance() -> None:
    gloo = replace(NCCL2, backend="gloo")
    assert cost.connects_lazily(NCCL2) and cost.connects_lazily(TF4)
    assert not cost.connects_lazily(gloo)
    assert cost.connects_lazily(gloo, {cost.GLOO_LAZY_VAR: "1"})  # the user's switch is seen
    assert stall_policy(gloo).first_collective_extra_s == 0.0
    assert stall_policy(gloo, {cost.GLOO_LAZY_VAR: "1"}).first_collective_extra_s == \
        stall_policy(NCCL2).first_collective_extra_s > 0


def test_the_simulated_prober_charges_the_probers_clock() -> None:
    prober = FakeProber({"nccl": "timeout", "gloo": "hang:setup", "nccl+*": "ok"})
    plain = prober(NCCL2, {})
    judged = dict(plain.extra)
    # a plain "timeout" is the commonest real hang: cut inside collective 1, from progress
    assert plain.status == TIMEOUT and judged == {"hang": "collective"}
    assert plain.elapsed_s == probe_seconds(NCCL2, "collective", forked=True)
    setup = prober(replace(NCCL2, backend="gloo"), {})
    assert setup.elapsed_s == probe_seconds(replace(NCCL2, backend="gloo"), "setup", forked=True,
                                            warm=True)
    ok = prober(replace(NCCL2, env=(("NCCL_P2P_DISABLE", "1"),)), {"RESILIENT_STRATEGY_FORKSERVER": "0"})
    assert ok.elapsed_s == probe_seconds(NCCL2, "ok")  # fresh interpreters: the import again
    # the probes alone: the health check is the decision's to call (deferred), not the probe's
    assert prober.clock() == pytest.approx(plain.elapsed_s + setup.elapsed_s + ok.elapsed_s)
    assert prober.check_gpus("torch", (0, 1), {}) == [] and prober.health_checks == [(0, 1)]
    assert prober.clock() == pytest.approx(plain.elapsed_s + setup.elapsed_s + ok.elapsed_s
                                           + health_check_seconds("torch", 2, forked=True,
                                                                  warm=True))
    across = FakeProber({"*": "timeout"})(TF_ACROSS, {})
    assert across.elapsed_s == TF_ACROSS.timeout_s and not across.extra


def test_four_gpus_with_every_multi_replica_candidate_hanging() -> None:
    # torch under torchrun on 4 GPUs: nccl, its remedy, gloo all hang; one GPU is chosen
    launch = {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}
    prober = FakeProber({"single_device": "ok"}, default="timeout")
    sel = simulate(machine(4, env=launch), prober, framework="torch", global_batch_size=256,
                   timeout=30.0)
    assert sel.backend == "single_device"
    hung = [r for r in sel.results.values() if r.status == TIMEOUT]
    assert len(hung) == 3 and all(dict(r.extra).get("hang") == "collective" for r in hung)
    # each hang is cut at the prober's allowance for its transport plus its start-up, never at
    # the timeout
    for key, r in sel.results.items():
        spec = ProbeSpec(key, "torch", key.split(":")[1], (0, 1, 2, 3), world_size=4,
                         timeout_s=30.0)
        grace = stall_policy(spec).collective_grace(1, *first_collective(spec))
        assert grace < r.elapsed_s < grace + 4.0
    # the whole ladder: its probes plus TWO GPU health checks of the 4 GPUs: one right after the
    # first hang (issue 31: a wedged GPU is found before a hung variant runs on it), one deferred
    # for the hangs after it (before issue 21 item 4: one after each killed probe, 3 x 4.0 s)
    assert prober.health_checks == [(0, 1, 2, 3), (0, 1, 2, 3)]
    total = sum(r.elapsed_s for r in sel.results.values())
    assert prober.clock() == pytest.approx(total + 2 * health_check_seconds(
        "torch", 4, forked=True, warm=True))
    assert prober.clock() < 2 * 30.0  # before: 3 x the whole timeout


def test_a_described_machines_figures_replace_the_typical_ones() -> None:
    prober = FakeProber({"*": "hang:quiet"}, figures=ZERO)
    res = prober(NCCL2, {})
    assert res.elapsed_s == stall_policy(NCCL2).quiet_s and prober.clock() == res.elapsed_s
