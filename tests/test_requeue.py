"""Requeue and preemption of ``resilient-strategy run`` under a scheduler (issue 42 item 3),
from data: whether the SLURM job is requeued (`core/values/requeue`), the supervisor's stop at
the preemption checkpoint (`run/preempt.Preemption.watch`, a clock and notes handed in), and
the flag rank 0's checkpointer looks at (`records/preemption`). The real scheduler:
tests/test_slurm.py."""

from __future__ import annotations

import signal
import types
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
