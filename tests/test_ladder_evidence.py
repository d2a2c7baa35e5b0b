"""A step-down needs evidence against the transport; the ladder on two GPUs (issue 45, items 2
and 6). Pure: the policy's tables, the classifier fed the records the supervisor reads, and the
replay (the supervisor's own ladder, `run.policy.relaunch`, with no process).

Before: a repeat of any kind within the fault window stepped down, whatever its evidence: a
rank busy or asleep in the script's own code, stopped, or an exit outside any collective went
on to a strategy where it is less watched (one CPU process: nobody waiting on it); a healthy
stop at a checkpoint for a measured switch counted as a fault (a backend error 200 healthy
steps later stepped down at once); a crash-loop stop named neither its attempts nor the loop;
a CUDA-graph capture error raised in c10d was a backend fault, stepped down."""

from __future__ import annotations

import errno

import pytest

from resilient_strategy.core.knowledge.causes import CAUSES, SCRIPT_CAUSES, what_and_fix
from resilient_strategy.core.knowledge.signatures import builtin_signatures
from resilient_strategy.errors import NoWorkingStrategyError
from resilient_strategy.records.progress import COLLECTIVE, STEP_DONE, Record
from resilient_strategy.run.exitcodes import ExitCode
from resilient_strategy.run.policy import (
    Action,
    Attempt,
    Judgement,
    RelaunchPolicy,
    Rung,
    against_transport,
    judge,
    relaunch,
)
from resilient_strategy.run.verdicts import (
    BLAME_STORAGE,
    RankExit,
    Verdict,
    VerdictKind,
    blame,
    classify_attempt,
)
from resilient_strategy.testing import MidRunFault, machine, replay

GLOO = "torch:gloo:0,1"
POLICY = RelaunchPolicy()
H100X2 = machine(2, name="NVIDIA H100 80GB HBM3", cc=(9, 0))


def _v(kind: VerdictKind, step: int, stall: str = "", phase: str = "",
       cause: str = "") -> Verdict:
    return Verdict(kind, kind.value, step, cause, stall=stall, phase=phase)


#: (verdict kind, stall kind, phase, cause) -> whether it is evidence against the transport,
#: and what a repeat within the fault window comes to (action, exit code).
CASES = [
    # the transport's: every rank inside one collective or communicator setup, a signature,
    # a rank that died without a word inside a collective
    ((VerdictKind.STALL, "collective", COLLECTIVE, "timeout"), True, (Action.STEP_DOWN, None)),
    ((VerdictKind.STALL, "setup", "comm_setup", "timeout"), True, (Action.STEP_DOWN, None)),
    ((VerdictKind.BACKEND, "", COLLECTIVE, "nccl_error"), True, (Action.STEP_DOWN, None)),
    ((VerdictKind.EXIT, "", COLLECTIVE, "crash"), True, (Action.STEP_DOWN, None)),
    ((VerdictKind.EXIT, "", "comm_setup", "crash"), True, (Action.STEP_DOWN, None)),
    ((VerdictKind.LOST, "", "", "crash"), True, (Action.STEP_DOWN, None)),
    # the script's: a rank busy in its own code past the busy ceiling
    ((VerdictKind.STALL, "busy", COLLECTIVE, "timeout"), False,
     (Action.STOP, ExitCode.USER_ERROR)),
    # the machine's, or nothing against the transport: asleep (a lock, storage), never arrived,
    # stopped, an exit outside any collective, the storage failing even inside one
    ((VerdictKind.STALL, "asleep", STEP_DONE, "timeout"), False,
     (Action.STOP, ExitCode.INFRASTRUCTURE)),
    ((VerdictKind.STALL, "straggler", COLLECTIVE, "timeout"), False,
     (Action.STOP, ExitCode.INFRASTRUCTURE)),
    ((VerdictKind.STALL, "stopped", COLLECTIVE, "timeout"), False,
     (Action.STOP, ExitCode.INFRASTRUCTURE)),
    ((VerdictKind.STALL, "", "", "timeout"), False, (Action.STOP, ExitCode.INFRASTRUCTURE)),
    ((VerdictKind.EXIT, "", STEP_DONE, "crash"), False, (Action.STOP, ExitCode.INFRASTRUCTURE)),
    ((VerdictKind.EXIT, "", "", "crash"), False, (Action.STOP, ExitCode.INFRASTRUCTURE)),
    ((VerdictKind.EXIT, "", COLLECTIVE, "storage_error"), False,
     (Action.STOP, ExitCode.INFRASTRUCTURE)),
]


@pytest.mark.parametrize(("what", "transport", "repeat"), CASES)
def test_a_repeat_steps_down_only_on_evidence_against_the_transport(
        what: tuple[VerdictKind, str, str, str], transport: bool,
        repeat: tuple[Action, ExitCode | None]) -> None:
    kind, stall, phase, cause = what
    first = _v(kind, 20, stall, phase, cause)
    assert against_transport(first) is transport
    # a first fault is retried (a signature only after a healthy stretch: step 500)
    opening = judge(_v(kind, 500, stall, phase, cause), GLOO, [], POLICY)
    assert opening.action is Action.RETRY
    history = [Attempt(0, GLOO, "gloo", first, opening)]
    again = judge(_v(kind, 25, stall, phase, cause), GLOO, history, POLICY)
    assert (again.action, again.exit_code) == repeat
    assert again.rule == ("fault_rate" if transport else "not_the_transport")


@pytest.mark.parametrize(("what", "transport", "repeat"),
                         [c for c in CASES if not c[1]])
def test_relaunch_never_plans_a_step_down_on_a_repeat_that_clears_the_transport(
        what: tuple[VerdictKind, str, str, str], transport: bool,
        repeat: tuple[Action, ExitCode | None]) -> None:
    kind, stall, phase, cause = what

    def choose(key: str, failure: object) -> Rung:
        raise AssertionError("a step-down was planned")

    failed = Rung(GLOO, "gloo", True, False, 2, 0.1)
    history = [Attempt(0, GLOO, "gloo", _v(kind, 20, stall, phase, cause),
                       Judgement(Action.RETRY, ""))]
    judgement, nxt = relaunch(_v(kind, 30, stall, phase, cause), failed, history, POLICY,
                              choose)
    assert (judgement.action, judgement.exit_code, nxt) == (*repeat, None)


def test_a_step_down_with_evidence_against_the_transport_still_plans_the_next_rung() -> None:
    asked: list[str] = []

    def choose(key: str, failure: object) -> Rung:
        asked.append(key)
        raise NoWorkingStrategyError("torch", [])

    history = [Attempt(0, GLOO, "gloo", _v(VerdictKind.STALL, 20, "collective", COLLECTIVE),
                       Judgement(Action.RETRY, ""))]
    judgement, nxt = relaunch(_v(VerdictKind.STALL, 30, "collective", COLLECTIVE),
                              Rung(GLOO, "gloo", True, False, 2, 0.1), history, POLICY, choose)
    assert asked == [GLOO] and nxt is None
    assert (judgement.action, judgement.rule) == (Action.STOP, "no_candidate")


# ----- the replay: faults of the script or the machine on every launch, never a step-down ----
H200X2 = machine(2, name="NVIDIA H200", cc=(9, 0), nvlink=18)


@pytest.mark.parametrize(("kind", "code"), [
    ("busy", ExitCode.USER_ERROR), ("asleep", ExitCode.INFRASTRUCTURE),
    ("stopped", ExitCode.INFRASTRUCTURE), ("never_arrived", ExitCode.INFRASTRUCTURE),
    ("exit_outside", ExitCode.INFRASTRUCTURE)])
def test_a_replayed_hold_up_in_the_scripts_frames_is_retried_once_then_stopped(
        kind: str, code: ExitCode) -> None:
    job = replay(H200X2, [MidRunFault(kind, "nccl", 30, rank=1)])
    assert (job.actions, job.exit_code) == (["retry", "stop"], code)
    assert len(set(c.key for c in job.candidates)) == 1  # never left the strategy
    assert job.attempts[-1].judgement.rule == "not_the_transport"


def test_a_replayed_hang_inside_the_collective_still_steps_down_on_a_repeat() -> None:
    job = replay(H200X2, [MidRunFault("hang", "nccl", 30, rank=1)])
    assert job.actions[:2] == ["retry", "step_down"]
    assert job.attempts[1].verdict.stall == "collective"


# ----- an error from storage: the machine's -------------------------------------------------
def _save_error(message: str, number: int | None) -> dict[str, object]:
    """An OSError raised in torch.save's open(), called from the script's checkpoint."""
    frames = [{"module": "__main__", "function": "save", "file": "/job/train.py", "line": 40},
              {"module": "torch.serialization", "function": "_open_file",
               "file": "/venv/torch/serialization.py", "line": 300, "library": True}]
    entry: dict[str, object] = {"types": ["builtins.OSError", "builtins.Exception"],
                                "message": message, "frames": frames}
    if number is not None:
        entry["errno"] = number
    return {"types": entry["types"], "message": message, "chain": [entry]}


@pytest.mark.parametrize(("message", "number"), [
    ("[Errno 116] Stale file handle", errno.ESTALE),
    ("[Errno 5] Input/output error: '/nfs/ckpt/step_40.pt'", errno.EIO),
    ("[Errno 30] Read-only file system: '/ckpt'", errno.EROFS),
    ("[Errno 116] Stale file handle", None),  # the words alone, no number recorded
])
def test_a_storage_error_in_a_checkpoint_is_the_machines_retried_once_then_75(
        message: str, number: int | None) -> None:
    error = _save_error(message, number)
    assert blame(error).why == BLAME_STORAGE
    rec = Record(seq=9, phase=STEP_DONE, k=40, t=0.0)
    verdict = classify_attempt(None, [RankExit(0, 1, error, rec)])
    assert (verdict.kind, verdict.cause, verdict.ranks) == (VerdictKind.EXIT, "storage_error",
                                                            (0,))
    assert not against_transport(verdict)
    first = judge(verdict, GLOO, [], POLICY)
    assert first.action is Action.RETRY
    second = judge(verdict, GLOO, [Attempt(0, GLOO, "gloo", verdict, first)], POLICY)
    assert (second.action, second.exit_code) == (Action.STOP, ExitCode.INFRASTRUCTURE)


def test_other_os_errors_stay_the_scripts() -> None:
    error = _save_error("[Errno 2] No such file or directory: 'x'", errno.ENOENT)
    assert blame(error).kind == "user"


# ----- a CUDA-graph capture error: the script's, its workaround named -------------------------
CAPTURE = "CUDA error: operation not permitted when stream is capturing"


def test_the_graph_capture_cause_is_data_with_a_source_and_a_workaround() -> None:
    table = builtin_signatures()
    assert "graph_capture" in SCRIPT_CAUSES and CAUSES["graph_capture"]
    entry = table.match(CAPTURE)
    assert entry is not None and entry.cause == "graph_capture" and entry.source
    for text in ("cudaErrorStreamCaptureUnsupported", "cudaErrorStreamCaptureInvalidated: "
                 "operation failed due to a previous error during capture"):
        assert table.classify(text) == "graph_capture"
    assert table.blame.script_fault(CAPTURE, True) is not None  # raised in c10d too
    assert what_and_fix("graph_capture")[1]  # names what to do


@pytest.mark.parametrize("raised_in", ["distributed", "collective", "script"])
def test_a_graph_capture_error_is_the_scripts_wherever_raised_and_never_steps_down(
        raised_in: str) -> None:
    """DDP's all-reduce captured by torch.compile(mode="reduce-overhead") on 2 GPUs."""
    fault = MidRunFault("error", "nccl", 30, rank=1, raised_in=raised_in, message=CAPTURE,
                        chain=(("torch.AcceleratorError", "builtins.RuntimeError"),))
    job = replay(H100X2, [fault])
    verdict = job.attempts[0].verdict
    assert (verdict.kind, verdict.cause) == (VerdictKind.USER, "graph_capture")
    assert (job.actions, job.exit_code) == (["stop"], ExitCode.USER_ERROR)
    assert what_and_fix("graph_capture")[1] in job.attempts[0].judgement.reason


def test_a_rank_that_died_printing_a_graph_capture_error_is_the_scripts() -> None:
    tail = (f"[rank1]: torch.AcceleratorError: {CAPTURE}\n"
            "[rank1]: Search for `cudaErrorStreamCaptureUnsupported' in the CUDA docs\n")
    verdict = classify_attempt(None, [RankExit(1, -6, None, stderr_tail=tail)])
    assert (verdict.kind, verdict.cause) == (VerdictKind.USER, "graph_capture")


# ----- the ladder on two GPUs: the first backend error after a healthy stretch --------------
@pytest.mark.parametrize("gpus", [2, 4, 8])
@pytest.mark.parametrize("raised_in", ["collective", "distributed"])
def test_the_first_backend_error_after_a_healthy_stretch_is_retried_on_any_gpu_count(
        gpus: int, raised_in: str) -> None:
    """The issue's 2 x H100 replays: a backend error after 200 healthy steps, twice (the second
    200 steps after the first, each once): each retried on the same strategy."""
    facts = machine(gpus, name="NVIDIA H100 80GB HBM3", cc=(9, 0))
    faults = [MidRunFault("error", "nccl", at, rank=1, launches=n, raised_in=raised_in,
                          error_type="torch.distributed.DistBackendError",
                          message="NCCL error: unhandled system error")
              for at, n in ((201, 1), (401, 2))]
    job = replay(facts, faults, steps=600, checkpoint_every=50)
    assert job.actions == ["retry", "retry", "finish"]
    assert [a.judgement.rule for a in job.attempts[:2]] == ["healthy_retry", "healthy_retry"]
    assert len(set(c.key for c in job.candidates)) == 1


@pytest.mark.parametrize("healthy_stop", [VerdictKind.SWITCH, VerdictKind.JOIN])
def test_a_healthy_stop_at_a_checkpoint_is_no_fault_for_the_ladder(
        healthy_stop: VerdictKind) -> None:
    """A measured switch's trial went back to this strategy at step 150 (or a node joined): a
    backend error at step 200 follows 200 healthy steps, not 50 (before: "a second fault
    (backend after switch at step 150)", stepped down at once)."""
    history = [Attempt(0, GLOO, "gloo", _v(healthy_stop, 150), Judgement(Action.TRIAL, ""))]
    said = judge(_v(VerdictKind.BACKEND, 200, phase=COLLECTIVE), GLOO, history, POLICY)
    assert (said.action, said.rule) == (Action.RETRY, "healthy_retry")


# ----- a crash loop says it was one, and lists each attempt's cause ----------------------------
def test_a_crash_loop_stop_lists_each_attempt_and_says_it_was_a_loop() -> None:
    """An error at step 5 on every backend of 2 x H100, each in words of its own (so that no
    two recur identically): three attempts that got nowhere."""
    faults = [MidRunFault("error", "nccl", 5, rank=1, message="NCCL error: remote process exited"),
              MidRunFault("error", "gloo", 5, rank=1,
                          message="Gloo connectFullMesh failed with a peer gone")]
    job = replay(H100X2, faults, steps=100)
    last = job.attempts[-1].judgement
    assert (last.action, last.rule, job.exit_code) == (Action.STOP, "crash_loop",
                                                       ExitCode.INFRASTRUCTURE)
    assert [(a.number, a.candidate, a.kind, a.step) for a in last.loop] == [
        (a.number, a.candidate, a.verdict.kind.value, a.verdict.step) for a in job.attempts]
    assert all(a.cause for a in last.loop)
    record = job.attempts[-1].to_dict()
    assert record["rule"] == "crash_loop" and len(record["loop"]) == len(job.attempts)
    assert {"number", "candidate", "kind", "cause", "stall", "step"} <= set(record["loop"][0])
