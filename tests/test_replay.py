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
    assert job.actions == ["step_down", "step_down", "finish"]
    assert job.attempts[0].verdict.kind is VerdictKind.BACKEND
    # the failure's cause is kept on the step-down, as the supervisor keeps it: the planner's
    # NCCL remedy (P2P off) is tried before gloo, as a real run would try it
    assert [c.key for c in job.candidates] == [
        "torch:nccl:0,1", "torch:nccl:0,1:NCCL_P2P_DISABLE=1", "torch:gloo:0,1"]
    assert job.failures["torch:nccl:0,1"].cause == "crash"
    assert job.exit_code is ExitCode.SUCCESS


def test_a_communication_error_after_a_healthy_stretch_is_retried_in_the_replay_too() -> None:
    job = replay(H200X2, [MidRunFault("error", "nccl", 3000, rank=1, launches=1)], steps=5000)
    assert (job.backends, job.actions) == (["nccl", "nccl"], ["retry", "finish"])


@pytest.mark.parametrize(("chain", "raised_in", "kind", "actions"), [
    # urllib's RemoteDisconnected from the script's metrics push: the script's, whatever its text
    ((("http.client.RemoteDisconnected", "builtins.ConnectionResetError", "builtins.OSError"),),
     "script", VerdictKind.USER, ["stop"]),
    # the same class raised inside torch.distributed: the backend's
    ((("builtins.ConnectionResetError", "builtins.OSError"),), "distributed",
     VerdictKind.BACKEND, ["step_down", "finish"]),
    # the script wrapped a failed collective: its cause carries the distributed frame
    ((("builtins.Exception",), ("builtins.RuntimeError",)), "distributed", VerdictKind.BACKEND,
     ["step_down", "finish"]),
])
def test_a_replayed_error_carries_its_class_chain_and_where_it_was_raised(
        chain: tuple[tuple[str, ...], ...], raised_in: str, kind: VerdictKind,
        actions: list[str]) -> None:
    job = replay(H200X2, [MidRunFault("error", "nccl", 30, rank=1, chain=chain,
                                      raised_in=raised_in, message="connection reset",
                                      launches=1)])
    assert job.attempts[0].verdict.kind is kind
    assert job.actions == actions


@pytest.mark.parametrize(("kind", "seconds", "verdict"), [
    # a rank held up (stopped, never arrived, slow past the allowance) is a stall naming it, as
    # the real supervisor judges it (tests/test_realfaults.py); diverged needs the ranks' own
    # collectives to differ, which only the flight recorders prove
    ("stopped", 0.0, VerdictKind.STALL), ("never_arrived", 0.0, VerdictKind.STALL),
    ("slow", 600.0, VerdictKind.STALL), ("lost_node", 0.0, VerdictKind.LOST)])
def test_a_replay_says_where_the_rank_was(kind: str, seconds: float,
                                          verdict: VerdictKind) -> None:
    """The verdict is the supervisor's classifier's, fed what the watcher would have judged."""
    job = replay(H200X2, [MidRunFault(kind, "nccl", 30, rank=1, seconds=seconds, launches=1)])
    assert job.attempts[0].verdict.kind is verdict
    # a slow rank within the allowance is no fault at all
    slow = replay(H200X2, [MidRunFault("slow", "nccl", 30, rank=1, seconds=10.0)],
                  stall_timeout_s=60.0)
    assert slow.actions == ["finish"]


def test_leaving_eight_gpus_for_one_is_refused_by_the_floor() -> None:
    """A communication-bound estimate (a 100M-parameter model on 8 A100s, gloo gone) rates one
    GPU at about half of eight; what computes is one replica in eight: at most 1/8, refused at
    a floor of 0.25, allowed below 1/8. Before one GPU, NCCL's P2P-off remedy on all eight is
    tried (issue 41: no estimate leaves GPUs idle that NCCL may still prove); it fails the
    same way mid-run here."""
    a100 = machine(8, name="NVIDIA A100-SXM4-80GB", cc=(8, 0), memory_gb=80, nvlink=12)
    fault = [MidRunFault("error", "nccl", 20)]
    kw = {"probes": {"gloo": "error:gloo_connection"}, "gradient_bytes": 400 << 20,
          "global_batch_size": 256}
    job = replay(a100, fault, policy=RelaunchPolicy(min_throughput=0.25), **kw)  # type: ignore[arg-type]
    assert (job.actions, job.exit_code) == (["step_down", "stop"], ExitCode.INFRASTRUCTURE)
    assert job.backends == ["nccl", "nccl"]  # the remedy on all eight GPUs, then the floor
    allowed = replay(a100, fault, policy=RelaunchPolicy(min_throughput=0.12), **kw)  # type: ignore[arg-type]
    assert allowed.backends[-1] == "single_device" and allowed.exit_code is ExitCode.SUCCESS


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
    with pytest.raises(InvalidOptionError):  # an exit status of 0 is no fault
        MidRunFault("exit", "nccl", 3, exitcode=0)


def test_a_signalled_exit_is_judged_by_what_it_printed() -> None:
    """An "exit" fault with the signal and the output end a rank left (NCCL's watchdog abort):
    the classifier reads them as the supervisor does."""
    said = "terminate called after throwing an instance of 'c10::DistBackendError'\n  what():  " \
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)\n"
    job = replay(H200X2, [MidRunFault("exit", "nccl", 3000, rank=1, launches=1, exitcode=-6,
                                      stderr=said)], steps=5000)
    assert (job.attempts[0].verdict.kind, job.attempts[0].verdict.cause) == (
        VerdictKind.BACKEND, "timeout")
    assert job.actions == ["retry", "finish"]  # after a healthy stretch
