"""What the supervisor does after an attempt (pure): finish, retry the same strategy, step down
to the next candidate, or stop with an exit code for the scheduler.

- A first failure not pinned on the backend (a stall, a rank that exited without a
  communication-error signature, a node that vanished) is retried once on the same strategy,
  from the last checkpoint.
- A repeat of that kind on that strategy (the retry failed the same way before getting past the
  step where the first one failed), or a communication-error signature, steps down.
- A one-device job never blames a backend: a signature there counts as an exit.
- The script's own faults (an exception, out of memory, diverged ranks) stop with
  `USER_ERROR`: do not requeue.
- A node cut off from the job's store (multi-node) stops with
  `INFRASTRUCTURE`: the others go on without it.
- A node lost at a relaunch's agreement is dropped: node 0 goes on alone
  (`Action.FEWER_NODES`, decided by the supervisor at the agreement).
- ``max_attempts_without_progress`` attempts in a row that get no further than the furthest
  step reached before stop the run (a crash loop), whatever the relaunch budget.
- A step-down never lands on a candidate estimated below ``min_throughput`` x the throughput of
  the one that failed, nor moves a GPU job to the CPU unless ``allow_cpu``
  (`floor_refusal`).

`judge` takes the attempts so far and the new verdict; the supervisor and the testing
kit's replay (`resilient_strategy.testing.replay`) share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..records.phases import Timeline

from .exitcodes import ExitCode
from .verdicts import Verdict, VerdictKind

#: The default throughput floor of a step-down, relative to what failed.
DEFAULT_MIN_THROUGHPUT = 0.25
#: The default crash-loop bound: attempts in a row without progress.
DEFAULT_MAX_ATTEMPTS_WITHOUT_PROGRESS = 3


@dataclass(frozen=True)
class RelaunchPolicy:
    min_throughput: float = DEFAULT_MIN_THROUGHPUT
    allow_cpu: bool = False
    max_attempts_without_progress: int = DEFAULT_MAX_ATTEMPTS_WITHOUT_PROGRESS
    max_relaunches: int | None = None  # None: no count limit (the bounds above still hold)


class Action(Enum):
    FINISH = "finish"
    RETRY = "retry"
    STEP_DOWN = "step_down"
    #: a node did not join the relaunch: the job goes on without it (node 0 alone, with
    #: accumulation keeping the global batch)
    FEWER_NODES = "fewer_nodes"
    #: a node asked to join: the job relaunches across the larger group from the last checkpoint
    MORE_NODES = "more_nodes"
    STOP = "stop"


@dataclass(frozen=True)
class Judgement:
    action: Action
    reason: str  # words: why
    exit_code: ExitCode | None = None  # FINISH and STOP only

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action.value, "reason": self.reason,
                "exit_code": None if self.exit_code is None else int(self.exit_code)}


@dataclass(frozen=True)
class Attempt:
    """One launch attempt: where it ran, what it came to, and what was done next."""

    number: int  # 0 for the first launch
    candidate: str  # the candidate key
    label: str
    verdict: Verdict
    judgement: Judgement
    resumed_from: int | None = None  # the checkpoint step it resumed from (None: the start)
    #: When each phase began, the supervisor's and each rank's (`phases`).
    times: Timeline | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"number": self.number, "candidate": self.candidate, "label": self.label,
                "verdict": self.verdict.to_dict(), **self.judgement.to_dict(),
                "resumed_from": self.resumed_from,
                "times": None if self.times is None else self.times.to_dict()}


def effective(verdict: Verdict, world_size: int) -> Verdict:
    """A one-device job has no backend to blame: a communication signature there is an exit."""
    if verdict.kind is VerdictKind.BACKEND and world_size <= 1:
        return replace(verdict, kind=VerdictKind.EXIT)
    return verdict


def without_progress(history: Sequence[Verdict]) -> int:
    """How many of the last attempts in a row completed no optimizer step beyond the furthest
    completed before each of them (an attempt that failed in step k completed k - 1)."""
    best, idle = 0, 0
    for v in history:
        done = v.step if v.ok else max(0, v.step - 1)
        if done > best:
            best, idle = done, 0
        else:
            idle += 1
    return idle


def judge(verdict: Verdict, candidate: str, history: Sequence[Attempt],
          policy: RelaunchPolicy) -> Judgement:
    """What to do after an attempt on ``candidate`` came to ``verdict`` (already
    `effective`), the attempts before it being ``history``."""
    if verdict.ok:
        return Judgement(Action.FINISH, "the training finished", ExitCode.SUCCESS)
    if verdict.users:
        return Judgement(Action.STOP, "the script's own fault: another attempt or strategy "
                         "would fail the same way", ExitCode.USER_ERROR)
    if verdict.kind is VerdictKind.CUT_OFF:
        return Judgement(Action.STOP, "this node is cut off from the job's store: the other "
                         "nodes go on without it (requeue it elsewhere)", ExitCode.INFRASTRUCTURE)
    if verdict.kind is VerdictKind.JOIN:
        return Judgement(Action.MORE_NODES, "a node asked to join: relaunched across the larger "
                         "group from the last checkpoint")
    idle = without_progress([*(a.verdict for a in history), verdict])
    if idle >= policy.max_attempts_without_progress:
        return Judgement(Action.STOP, f"{idle} attempts in a row made no progress (the bound "
                         "is --max-attempts-without-progress "
                         f"{policy.max_attempts_without_progress})", ExitCode.INFRASTRUCTURE)
    if policy.max_relaunches is not None and len(history) >= policy.max_relaunches:
        return Judgement(Action.STOP, f"the relaunch limit ({policy.max_relaunches}) is reached",
                         ExitCode.INFRASTRUCTURE)
    if verdict.pinned:
        return Judgement(Action.STEP_DOWN, "a communication-error signature pins it on the "
                         "backend")
    before = next((a for a in reversed(history) if a.candidate == candidate), None)
    if (before is not None and before.verdict.kind is verdict.kind
            and verdict.step <= before.verdict.step):
        return Judgement(Action.STEP_DOWN, f"the same fault ({verdict.kind.value}) again on this "
                         f"strategy, before getting past step {before.verdict.step}")
    return Judgement(Action.RETRY, f"a first {verdict.kind.value} on this strategy is not pinned "
                     "on the backend: retried once from the last checkpoint")


def floor_refusal(failed_label: str, failed_gpu: bool, failed_step_s: float, next_label: str,
                  next_cpu: bool, next_step_s: float, policy: RelaunchPolicy) -> str | None:
    """Why a step-down from what failed to the next candidate is refused (None: allowed): a GPU
    job onto the CPU without ``allow_cpu``, or an estimated throughput below the floor. The
    reason names the option that allows it."""
    fraction = failed_step_s / next_step_s if next_step_s > 0 else 1.0
    would = (f"it would have relaunched on {next_label}, estimated at "
             f"{max(fraction, 0.001):.1%} of the throughput of {failed_label}")
    if failed_gpu and next_cpu:
        if policy.allow_cpu:
            return None
        return f"{would}: a GPU job moves to the CPU only with --allow-cpu"
    if fraction < policy.min_throughput:
        return (f"{would}, below the floor of --min-throughput {policy.min_throughput:g} (pass "
                f"--min-throughput {_allowing(fraction)} to allow it)")
    return None


def _allowing(fraction: float) -> str:
    """A floor (two decimals, rounded down) that lets ``fraction`` through."""
    return f"{max(0.0, int(fraction * 100) / 100):g}"
