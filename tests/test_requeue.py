"""Requeue and preemption of ``resilient-strategy run`` under a scheduler (issue 42 item 3),
from data: whether the SLURM job is requeued (`core/values/requeue`), the supervisor's stop at
the preemption checkpoint (`run/preempt.Preemption.watch`, a clock and notes handed in), and
the flag rank 0's checkpointer looks at (`records/preemption`). The real scheduler:
tests/test_slurm.py."""

from __future__ import annotations

import signal
import types
from dataclasses import replace
from pathlib import Path

import pytest

from resilient_strategy.core.values.requeue import (
    MAX_RESTARTS,
    parse_show_job,
    requeue_decision,
)
from resilient_strategy.records import preemption as flag
from resilient_strategy.records.handoff import WorkerState
from resilient_strategy.run.preempt import GRACE_S, Preemption, grace_from

BATCH = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0"}
SHOWN = ("JobId=42 JobName=train UserId=u(1) Requeue=1 Restarts=0 BatchFlag=1 "
         "JobState=RUNNING Command=/home/u/train.sbatch")


@pytest.mark.parametrize(("code", "env", "shown", "requeue"), [
    (75, BATCH, SHOWN, True),
    (75, BATCH, SHOWN.replace("Requeue=1", "Requeue=0"), False),  # --no-requeue
    (75, BATCH, None, False),  # could not be shown: never requeued
    (75, BATCH, SHOWN.replace("Restarts=0", f"Restarts={MAX_RESTARTS}"), False),
    (1, BATCH, SHOWN, False),
    (2, BATCH, SHOWN, False),
    (0, BATCH, SHOWN, False),
    (143, BATCH, SHOWN, False),  # stopped by SIGTERM: SLURM's own preemption requeues
    (75, {}, SHOWN, False),  # not a SLURM job
    (75, {**BATCH, "SLURM_STEP_ID": "0", "SLURM_PROCID": "1"}, SHOWN, False),  # task 1
    (75, {**BATCH, "SLURM_STEP_ID": "0"}, SHOWN, True),  # task 0 of a step speaks for it
])
def test_requeue_decision(code: int, env: dict[str, str], shown: str | None,
                          requeue: bool) -> None:
    decision = requeue_decision(code, env, None if shown is None else parse_show_job(shown))
    assert decision.requeue is requeue
    task_0 = bool(env) and env.get("SLURM_PROCID") == "0"
    assert decision.job_id == ("42" if task_0 else None)
    assert (decision.reason is not None) is (code == 75 and decision.job_id is not None)


def test_parse_show_job_keeps_the_first_word_of_each_key() -> None:
    assert parse_show_job(SHOWN)["Requeue"] == "1"
    assert parse_show_job(SHOWN)["Command"] == "/home/u/train.sbatch"
    assert parse_show_job("") == {}


def test_grace_from_the_environment() -> None:
    assert grace_from({"RESILIENT_STRATEGY_PREEMPT_GRACE_S": "20"}) == 20.0
    assert grace_from({}) == GRACE_S
    from resilient_strategy.errors import InvalidOptionError

    for bad in ("x", "0", "nan", "1e9"):  # refused, naming the variable: never a silent default
        with pytest.raises(InvalidOptionError) as exc:
            grace_from({"RESILIENT_STRATEGY_PREEMPT_GRACE_S": bad})
        assert exc.value.option == "RESILIENT_STRATEGY_PREEMPT_GRACE_S"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _watch(p: Preemption, run_dir: Path, notes: list[tuple[int, str] | None],
           inner: object = None) -> object:
    return p.watch(str(run_dir), inner,  # type: ignore[arg-type]
                   lambda _: notes[-1])


def test_preemption_stops_at_the_first_checkpoint_after_the_signal(tmp_path: Path) -> None:
    clock = Clock()
    p = Preemption(grace_s=30.0, clock=clock)
    notes: list[tuple[int, str] | None] = [(10, "ckpt")]
    due = _watch(p, tmp_path, notes, inner=lambda: None)
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert due() is None  # type: ignore[operator]
        assert not flag.flag(tmp_path).exists()
        p.on_signal(signal.SIGUSR1, None)
        assert due() is None  # type: ignore[operator]  # the request handed over, no new note
        assert flag.flag(tmp_path).is_file()  # the ranks' "checkpoint now"
        notes.append((13, "ckpt"))
        assert due() == 13  # type: ignore[operator]
        assert p.step == 13
    finally:
        p.attempt_over()
    assert signal.getsignal(signal.SIGTERM) == before  # torch's (or the default) handler back


def test_preemption_without_a_checkpoint_stops_at_the_grace(tmp_path: Path) -> None:
    clock = Clock()
    p = Preemption(grace_s=30.0, clock=clock)
    notes: list[tuple[int, str] | None] = [None]
    due = _watch(p, tmp_path, notes)
    try:
        due()  # type: ignore[operator]
        p.on_signal(signal.SIGTERM, None)  # the first SIGTERM asks, as SIGUSR1 does
        assert due() is None  # type: ignore[operator]
        clock.now = 29.0
        assert due() is None  # type: ignore[operator]
        clock.now = 30.0
        assert due() == 0  # type: ignore[operator]
        assert p.step is None
    finally:
        p.attempt_over()


def test_a_second_sigterm_goes_to_the_handler_before(tmp_path: Path) -> None:
    seen: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        p = Preemption()
        due = _watch(p, tmp_path, [None])
        due()  # type: ignore[operator]  # takes SIGTERM over, keeping the one before
        p.on_signal(signal.SIGTERM, None)
        p.on_signal(signal.SIGTERM, None)
        assert (p.signum, seen) == (signal.SIGTERM, [signal.SIGTERM])
        p.attempt_over()
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_flag_is_seen_by_the_attempt_s_worker_only(tmp_path: Path) -> None:
    state = WorkerState()
    assert flag.asked_here(state) is False  # not under the supervisor
    state.loaded["d"] = types.SimpleNamespace(run_dir=str(tmp_path))  # type: ignore[assignment]
    assert flag.asked_here(state) is False
    assert flag.ask(tmp_path, signal.SIGUSR1)
    assert flag.asked_here(state) is True


def test_rank_0_checkpoints_once_at_the_step_after_the_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from resilient_strategy.frameworks.checkpoint import Checkpointer
    from resilient_strategy.records import handoff

    run_dir = tmp_path / "attempt0"
    run_dir.mkdir()
    monkeypatch.setattr(handoff.WORKER, "loaded",
                        {"d": types.SimpleNamespace(run_dir=str(run_dir))})
    model = torch.nn.Linear(1, 1)
    ckpt = Checkpointer(tmp_path / "ckpt", every_steps=1000, asynchronous=False)
    ckpt.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), None, None, 1)
    for _ in range(3):
        ckpt.micro_step(boundary=True, stepped=True)
    assert ckpt.saves == ()
    flag.ask(run_dir, signal.SIGUSR1)
    for _ in range(3):
        ckpt.micro_step(boundary=True, stepped=True)
    assert [s.step for s in ckpt.saves] == [4]  # the next step, once
    assert torch.load(ckpt.path, weights_only=True)["optimizer_steps"] == 4


# ----- the node that failed, excluded (issue 42 item 3: "with the node that failed excluded when
# the fault was the node's") --------------------------------------------------------------------

NODE = {**BATCH, "SLURMD_NODENAME": "gpu7"}


@pytest.mark.parametrize(("shown", "fault", "exclude"), [
    (SHOWN + " ExcNodeList=(null)", "gpu_fault", "gpu7"),
    (SHOWN + " ExcNodeList=gpu[1-2]", "gpu_fault", "gpu[1-2],gpu7"),  # the user's --exclude kept
    (SHOWN + " ExcNodeList=gpu[5-8]", "gpu_fault", None),  # excluded already: nothing to add
    (SHOWN + " ExcNodeList=gpu[1-2]", None, None),  # not the node's fault: never excluded
])
def test_the_failed_node_is_added_to_the_job_s_excluded_nodes(
        shown: str, fault: str | None, exclude: str | None) -> None:
    decision = requeue_decision(75, NODE, parse_show_job(shown), fault)
    assert (decision.requeue, decision.exclude) == (True, exclude)
    assert decision.node == (None if fault is None else "gpu7")


def test_across_nodes_the_node_whose_own_fault_it_was_is_excluded_by_its_name() -> None:
    """Node 1 sends its name with its verdict; node 0, which requeues, stopped for it: node 1 is
    excluded, never node 0; a name that is no node name is refused with the record."""
    from resilient_strategy.run.loop import ending_of
    from resilient_strategy.run.policy import Action, Attempt, Judgement
    from resilient_strategy.run.supervisor import _node_name
    from resilient_strategy.run.verdicts import PeerFault, Verdict, VerdictKind, merge

    assert (_node_name({"SLURMD_NODENAME": "gpu9"}), _node_name({}),
            _node_name({"SLURMD_NODENAME": "gpu9;rm -rf"})) == ("gpu9", "", "")
    sent = PeerFault(1, "torch:nccl", Verdict(VerdictKind.EXIT, "ECC", 50, "gpu_fault",
                                              host="gpu9"))
    heard = PeerFault.from_dict(sent.to_dict())
    merged = merge([PeerFault(0, "torch:nccl", Verdict(VerdictKind.BACKEND, "peer gone", 50)),
                    heard])
    assert merged is not None and (merged.node, merged.host) == (1, "gpu9")
    assert heard.as_seen_here().host == "gpu9"
    with pytest.raises(ValueError):
        PeerFault.from_dict({**sent.to_dict(), "host": "gpu9 ExcNodeList=gpu[1-99]"})
    stop = Judgement(Action.STOP, "repeat", 75)  # type: ignore[arg-type]
    ending = ending_of([Attempt(0, "torch:nccl", "nccl", merged, stop)], stop, node=0)
    assert (ending.node_fault, ending.node_name) == ("gpu_fault", "gpu9")
    decision = requeue_decision(75, NODE, parse_show_job(SHOWN + " ExcNodeList=gpu[1-2]"),
                                ending.node_fault, ending.node_name)
    assert (decision.exclude, decision.node) == ("gpu[1-2],gpu9", "gpu9")
    # node 1's fault without its name: requeued, nobody excluded (before: node 0 itself)
    unnamed = ending_of([Attempt(0, "torch:nccl", "nccl", replace(merged, host=""), stop)], stop,
                        node=0)
    assert (unnamed.node_fault, unnamed.node_name) == (None, None)


def test_no_exclusion_without_a_requeue_or_a_node_name() -> None:
    shown = parse_show_job(SHOWN.replace("Requeue=1", "Requeue=0"))
    assert requeue_decision(75, NODE, shown, "gpu_fault").exclude is None  # not requeued
    assert requeue_decision(1, NODE, parse_show_job(SHOWN), "gpu_fault").exclude is None
    unnamed = requeue_decision(75, BATCH, parse_show_job(SHOWN), "gpu_fault")
    assert (unnamed.requeue, unnamed.exclude) == (True, None)
    hosted = requeue_decision(75, BATCH, parse_show_job(SHOWN + " BatchHost=n3"), "gpu_fault")
    assert (hosted.exclude, hosted.node) == ("n3", "n3")  # the batch host where no env names it


def test_exclusion_keeps_a_list_it_cannot_expand() -> None:
    from resilient_strategy.core.values.requeue import exclusion

    assert exclusion({"ExcNodeList": "n[1-"}, "n9") == "n[1-,n9"
    assert exclusion({}, "n9") == "n9"


def test_which_causes_blame_the_node() -> None:
    from resilient_strategy.core.knowledge.causes import CAUSES, NODE_CAUSES, node_cause

    assert set(CAUSES) >= NODE_CAUSES
    assert node_cause(["crash", "gpu_fault"]) == "gpu_fault"
    for cause in ("crash", "no_space", "nccl_error", "timeout", "port_in_use", ""):
        assert node_cause([cause]) is None  # a fault that may follow the job, or no node's


def test_a_gpu_failed_in_hardware_is_retried_once_then_stops_for_a_requeue_elsewhere() -> None:
    """An uncorrectable ECC error raised in the script's own frame (CUDA reports it at the
    next synchronising call) is the node's, not the script's: 75, not 1."""
    from resilient_strategy.run.exitcodes import ExitCode
    from resilient_strategy.run.policy import Action, RelaunchPolicy, judge
    from resilient_strategy.run.verdicts import BLAME_GPU, VerdictKind, blame

    record = {"types": ["torch.AcceleratorError", "RuntimeError"],
              "message": "CUDA error: uncorrectable ECC error encountered",
              "chain": [{"types": ["torch.AcceleratorError", "RuntimeError"],
                         "message": "CUDA error: uncorrectable ECC error encountered",
                         "frames": [{"file": "/home/u/train.py", "line": 12,
                                     "function": "main", "module": "__main__"}]}]}
    judged = blame(record)
    assert (judged.kind, judged.why) == ("gpu", BLAME_GPU)
    from resilient_strategy.run.policy import Attempt
    from resilient_strategy.run.verdicts import Verdict

    verdict = Verdict(VerdictKind.EXIT, "a GPU failed", 4, "gpu_fault", phase="collective")
    first = judge(verdict, "torch:nccl:0,1", (), RelaunchPolicy())
    assert first.action is Action.RETRY  # a new process often recovers; never a step-down
    again = judge(verdict, "torch:nccl:0,1",
                  [Attempt(0, "torch:nccl:0,1", "NCCL", verdict, first)], RelaunchPolicy())
    assert (again.action, again.exit_code) == (Action.STOP, ExitCode.INFRASTRUCTURE)
