"""The relaunch policy of `resilient-strategy run` (pure): retry, step down, stop; the floor."""

from __future__ import annotations

import pytest

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
    return Verdict(kind, kind.value, step)


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
    # the retry got past the step where the first failed: a new fault, retried again
    assert judge(_v(kind, 500), GLOO, history, POLICY).action is Action.RETRY
    # another kind on the same strategy is not a repeat
    other = VerdictKind.STALL if kind is not VerdictKind.STALL else VerdictKind.EXIT
    assert judge(_v(other, 20), GLOO, history, POLICY).action is Action.RETRY


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
