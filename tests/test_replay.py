"""The testing kit replays a supervised job's mid-run ladder with no process (issue 20.8)."""

from __future__ import annotations

import pytest

from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.run.exitcodes import ExitCode
from resilient_strategy.run.policy import RelaunchPolicy
from resilient_strategy.run.verdicts import VerdictKind
from resilient_strategy.testing import MidRunFault, machine, replay

H100 = machine(1, name="NVIDIA H100 80GB HBM3", cc=(9, 0))
H200X2 = machine(2, name="NVIDIA H200", cc=(9, 0), nvlink=18)


def test_a_transient_exit_on_one_gpu_resumes_on_the_gpu() -> None:
    """The H100 report of issue 20: an exit at step 60, once; it was relaunched on the CPU."""
    job = replay(H100, [MidRunFault("exit", "single_device", 60, launches=1)], steps=200)
    assert (job.backends, job.actions, job.exit_code) == (
        ["single_device", "single_device"], ["retry", "finish"], ExitCode.SUCCESS)
    assert job.attempts[1].resumed_from == 50  # the checkpoint before step 60


@pytest.mark.parametrize("kind", ["exit", "hang"])
def test_a_repeat_on_one_gpu_stops_at_the_floor_unless_the_cpu_is_allowed(kind: str) -> None:
    fault = MidRunFault(kind, "single_device", 60)
    job = replay(H100, [fault], steps=200)
    assert (job.backends, job.actions, job.exit_code) == (
        ["single_device", "single_device"], ["retry", "stop"], ExitCode.INFRASTRUCTURE)
    allowed = replay(H100, [fault], steps=200, policy=RelaunchPolicy(allow_cpu=True))
    assert (allowed.backends, allowed.actions, allowed.exit_code) == (
        ["single_device", "single_device", "cpu"], ["retry", "step_down", "finish"],
        ExitCode.SUCCESS)


def test_a_backend_signature_steps_down_at_once_on_several_devices() -> None:
    job = replay(H200X2, [MidRunFault("error", "nccl", 30, rank=1)])
    assert job.actions[0] == "step_down" and job.backends[0] == "nccl"
    assert job.attempts[0].verdict.kind is VerdictKind.BACKEND
    assert job.backends[1] != "nccl" and job.exit_code is ExitCode.SUCCESS


def test_a_vanished_rank_is_retried_then_steps_down_on_its_repeat() -> None:
    job = replay(H200X2, [MidRunFault("exit", "nccl", 30, rank=1)])
    assert job.actions == ["retry", "step_down", "finish"]
    assert job.backends[:2] == ["nccl", "nccl"]
    # a floor above what the next candidate is estimated at: stop, requeue elsewhere
    strict = replay(H200X2, [MidRunFault("exit", "nccl", 30, rank=1)],
                    policy=RelaunchPolicy(min_throughput=1.0))
    assert (strict.actions, strict.exit_code) == (["retry", "stop"], ExitCode.INFRASTRUCTURE)


def test_an_error_in_the_users_code_is_not_requeued() -> None:
    job = replay(H200X2, [MidRunFault("error", "nccl", 30, error_type="builtins.ValueError",
                                      message="bad label 12")])
    assert (job.actions, job.exit_code) == (["stop"], ExitCode.USER_ERROR)


def test_a_crash_loop_stops_whatever_the_budget() -> None:
    faults = [MidRunFault("exit", b, 1) for b in ("nccl", "gloo", "single_device")]
    job = replay(H200X2, faults, policy=RelaunchPolicy(max_attempts_without_progress=2))
    assert job.exit_code is ExitCode.INFRASTRUCTURE and len(job.attempts) == 2


def test_a_described_fault_is_checked() -> None:
    for bad in (("boom", "nccl", 3), ("exit", "NCCL", 3), ("exit", "nccl", 0)):
        with pytest.raises(InvalidOptionError):
            MidRunFault(*bad)  # type: ignore[arg-type]
