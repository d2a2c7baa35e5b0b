"""The relaunch policy of `resilient-strategy run` (pure): retry, step down, stop; the floor."""

from __future__ import annotations

import pytest

from resilient_strategy.core.measures.estimate import throughput_fraction
from resilient_strategy.run.exitcodes import ExitCode, interrupted
from resilient_strategy.run.policy import (
    Action,
    Attempt,
    Judgement,
    RelaunchPolicy,
    effective,
    floor_refusal,
    judge,
    without_progress,
)
from resilient_strategy.run.verdicts import Verdict, VerdictKind

GLOO, CPU = "torch:gloo:cpu", "torch:cpu:cpu"
POLICY = RelaunchPolicy()


def _v(kind: VerdictKind, step: int) -> Verdict:
    """A verdict with evidence against the transport where its kind needs one to step down on
    a repeat (every rank inside a collective: tests/test_ladder_evidence.py has the others)."""
    inside = {VerdictKind.STALL: {"stall": "collective", "phase": "collective"},
              VerdictKind.EXIT: {"phase": "collective"}}.get(kind, {})
    return Verdict(kind, kind.value, step, **inside)


def _history(*runs: tuple[str, VerdictKind, int, Action]) -> list[Attempt]:
    return [Attempt(i, c, c, _v(k, s), Judgement(a, "")) for i, (c, k, s, a) in enumerate(runs)]


def test_exit_codes_are_the_documented_ones() -> None:
    assert [int(c) for c in ExitCode] == [0, 1, 2, 75, 130]
    assert interrupted(15) == 143 and interrupted(2) == ExitCode.INTERRUPTED


@pytest.mark.parametrize("kind", [VerdictKind.STALL, VerdictKind.EXIT, VerdictKind.LOST])
def test_a_first_transient_fault_is_retried_then_a_repeat_steps_down(kind: VerdictKind) -> None:
    first = judge(_v(kind, 20), GLOO, [], POLICY)
    assert first.action is Action.RETRY and first.exit_code is None
    history = _history((GLOO, kind, 20, Action.RETRY))
    assert judge(_v(kind, 20), GLOO, history, POLICY).action is Action.STEP_DOWN
    # far past the step where the first one failed (beyond the window): retried again
    assert judge(_v(kind, 500), GLOO, history, POLICY).action is Action.RETRY
    # a fault rate, not "one more step resets it": one step further is still a repeat, and so
    # is another kind of fault on the same strategy within the window
    assert judge(_v(kind, 21), GLOO, history, POLICY).action is Action.STEP_DOWN
    other = VerdictKind.STALL if kind is not VerdictKind.STALL else VerdictKind.EXIT
    assert judge(_v(other, 20 + POLICY.fault_window - 1), GLOO, history,
                 POLICY).action is Action.STEP_DOWN
    assert judge(_v(other, 20 + POLICY.fault_window), GLOO, history,
                 POLICY).action is Action.RETRY


def test_a_communication_error_after_a_healthy_stretch_is_retried_first() -> None:
    window = POLICY.fault_window
    healthy = judge(_v(VerdictKind.BACKEND, 5000), GLOO, [], POLICY)
    assert healthy.action is Action.RETRY
    # its repeat within the window steps down
    history = _history((GLOO, VerdictKind.BACKEND, 5000, Action.RETRY))
    assert judge(_v(VerdictKind.BACKEND, 5010), GLOO, history, POLICY).action is Action.STEP_DOWN
    # the stretch counts from the last fault of the run, on any strategy
    history = _history((CPU, VerdictKind.STALL, 4950, Action.STEP_DOWN))
    assert judge(_v(VerdictKind.BACKEND, 4950 + window - 1), GLOO, history,
                 POLICY).action is Action.STEP_DOWN
    assert judge(_v(VerdictKind.BACKEND, 4950 + window), GLOO, history,
                 POLICY).action is Action.RETRY
    # a short stretch: at once, as a signature always did
    assert judge(_v(VerdictKind.BACKEND, window - 1), GLOO, [], POLICY).action is Action.STEP_DOWN
    assert judge(_v(VerdictKind.BACKEND, 50), GLOO, [],
                 RelaunchPolicy(fault_window=10)).action is Action.RETRY


def test_a_failure_creeping_a_step_further_each_time_is_a_crash_loop() -> None:
    """Each attempt fails one step later than the one before, on a strategy of its own (so no
    repeat steps it down): the crash-loop bound stops it after three."""
    history: list[Attempt] = []
    for n, step in enumerate(range(40, 60)):
        candidate = f"torch:c{n}:cpu"
        j = judge(_v(VerdictKind.EXIT, step), candidate, history, POLICY)
        if j.action is Action.STOP:
            break
        history.append(Attempt(n, candidate, candidate, _v(VerdictKind.EXIT, step), j))
    assert (j.exit_code, len(history)) == (ExitCode.INFRASTRUCTURE,
                                           POLICY.max_attempts_without_progress)
    assert without_progress([_v(VerdictKind.EXIT, s) for s in (40, 41, 42)], 10) == 2
    assert without_progress([_v(VerdictKind.EXIT, s) for s in (40, 41, 42)]) == 0
    assert without_progress([_v(VerdictKind.EXIT, s) for s in (40, 41, 60)], 10) == 0


def test_a_backend_signature_steps_down_at_once_but_never_on_one_device() -> None:
    backend = _v(VerdictKind.BACKEND, 20)
    assert judge(effective(backend, 2), GLOO, [], POLICY).action is Action.STEP_DOWN
    one = effective(backend, 1)
    assert one.kind is VerdictKind.EXIT
    assert judge(one, CPU, [], POLICY).action is Action.RETRY


@pytest.mark.parametrize("kind", [VerdictKind.USER, VerdictKind.OOM, VerdictKind.DIVERGED])
def test_the_scripts_faults_stop_with_do_not_requeue(kind: VerdictKind) -> None:
    j = judge(_v(kind, 20), GLOO, [], POLICY)
    assert (j.action, j.exit_code) == (Action.STOP, ExitCode.USER_ERROR)


def test_ok_finishes() -> None:
    j = judge(Verdict(VerdictKind.OK, "finished", 90), CPU, _history(
        (GLOO, VerdictKind.EXIT, 20, Action.RETRY)), POLICY)
    assert (j.action, j.exit_code) == (Action.FINISH, ExitCode.SUCCESS)


def test_attempts_without_progress_stop_the_run_whatever_the_budget() -> None:
    assert without_progress([_v(VerdictKind.EXIT, s) for s in (5, 5, 3)]) == 2
    assert without_progress([_v(VerdictKind.EXIT, s) for s in (0, 0)]) == 2
    assert without_progress([_v(VerdictKind.EXIT, s) for s in (5, 9)]) == 0
    history = _history((GLOO, VerdictKind.STALL, 0, Action.RETRY),
                       (GLOO, VerdictKind.STALL, 0, Action.STEP_DOWN))
    j = judge(_v(VerdictKind.EXIT, 0), CPU, history, POLICY)
    assert (j.action, j.exit_code) == (Action.STOP, ExitCode.INFRASTRUCTURE)
    loose = RelaunchPolicy(max_attempts_without_progress=4)
    assert judge(_v(VerdictKind.EXIT, 0), CPU, history, loose).action is Action.RETRY


def test_the_relaunch_limit_counts_retries() -> None:
    j = judge(_v(VerdictKind.EXIT, 20), GLOO, [], RelaunchPolicy(max_relaunches=0))
    assert (j.action, j.exit_code) == (Action.STOP, ExitCode.INFRASTRUCTURE)
    history = _history((GLOO, VerdictKind.EXIT, 20, Action.RETRY))
    assert judge(_v(VerdictKind.EXIT, 40), GLOO, history,
                 RelaunchPolicy(max_relaunches=1)).exit_code is ExitCode.INFRASTRUCTURE


def test_the_floor() -> None:
    # one H100 (~0.016 s a step) to the CPU (~1.9 s): refused without --allow-cpu
    refused = floor_refusal("1 GPU", True, 0.016, "one CPU process", True, 1.9, POLICY)
    assert refused is not None and "--allow-cpu" in refused
    assert floor_refusal("1 GPU", True, 0.016, "one CPU process", True, 1.9,
                         RelaunchPolicy(allow_cpu=True)) is None
    # 2 GPUs to 1 GPU at half the throughput: above the default floor of 0.25
    assert floor_refusal("NCCL", True, 1.0, "1 GPU", False, 2.0, POLICY) is None
    # gloo at 1/19 of NCCL: below it; the message names the floor that would allow it
    low = floor_refusal("NCCL", True, 1.0, "gloo", False, 19.0, POLICY)
    assert low is not None and "--min-throughput 0.05" in low
    assert floor_refusal("NCCL", True, 1.0, "gloo", False, 19.0,
                         RelaunchPolicy(min_throughput=0.05)) is None
    assert floor_refusal("gloo", False, 1.0, "cpu", True, 2.0,
                         RelaunchPolicy(min_throughput=0.9)) is not None


def test_attempts_serialize() -> None:
    a = _history((GLOO, VerdictKind.EXIT, 20, Action.RETRY))[0]
    d = a.to_dict()
    assert (d["candidate"], d["verdict"]["kind"], d["action"], d["exit_code"]) == (
        GLOO, "exit", "retry", None)
    assert Verdict.from_dict(d["verdict"]).kind is VerdictKind.EXIT


def test_a_rendezvous_across_nodes_waits_a_bounded_time_unless_the_user_chose() -> None:
    from resilient_strategy.run.agent import RDZV_JOIN_S, bounded_join

    assert bounded_join({}, 2) == {"join_timeout": str(RDZV_JOIN_S)}
    assert bounded_join({"join_timeout": "900", "x": "1"}, 2) == {"join_timeout": "900", "x": "1"}
    assert bounded_join({}, 1) == {}  # one node: no one to wait for


def test_the_floor_sees_the_replicas_that_compute() -> None:
    """8 GPUs to 1 estimated at half the throughput (a communication-bound model): at most 1/8,
    refused at the default floor; 2 GPUs to 1 stays at its estimate, and gloo on the same 8
    GPUs is not capped (every replica still computes)."""
    assert throughput_fraction(1.0, 2.0, 8, 1) == 0.125
    assert throughput_fraction(1.0, 2.0, 2, 1) == 0.5
    assert throughput_fraction(1.0, 2.0, 8, 8) == 0.5
    assert throughput_fraction(1.0, 2.0) == 0.5
    assert floor_refusal("NCCL", True, 1.0, "1 GPU", False, 2.0, POLICY, 8, 1) is not None
    assert floor_refusal("NCCL", True, 1.0, "1 GPU", False, 2.0, POLICY, 2, 1) is None
    assert floor_refusal("NCCL", True, 1.0, "gloo", False, 2.0, POLICY, 8, 8) is None
    assert floor_refusal("NCCL", True, 1.0, "1 GPU", False, 2.0,
                         RelaunchPolicy(min_throughput=0.12), 8, 1) is None
