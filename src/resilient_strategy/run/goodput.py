"""Goodput of a supervised job: the share of its wall time spent on optimizer steps that count,
and where the rest went (pure: computed from the attempts' phase marks and verdicts).

The split follows the field's names (Google's ML goodput measurement: productive time and badput
by cause; NVIDIA's resiliency tooling: lost work and the interruption count):

- ``decide_s``: from the supervisor's start to the first attempt's agent (facts, plan, probes);
- per attempt, from its agent's start to its verdict:

  - ``startup_s``: until every rank finished its first optimizer step (rendezvous, interpreter
    and framework imports, device and communicator set-up, the checkpoint's restore, step 1);
  - ``detection_s``: from the fault to the supervisor seeing it (a stall's wait; an exit or an
    error record is seen within the monitor's interval and counts as none);
  - ``checkpoint_stall_s``: what the checkpoint saves stalled training between the first step
    and the fault (or the last step): the training thread's time in each save (the wait for
    the previous write, the host copy, a synchronous write), as the checkpointer measured it
    (``Checkpointer.stall_s``) and each rank noted it (`phases.CHECKPOINT_STALL`), the largest
    rank's (the others wait for it at the next collective); Google's goodput measurement calls
    it unproductive checkpoint save time;
  - ``wasted_progress_s``: the steps done after the checkpoint the next attempt resumed from
    (its ``resumed_from``: the step its script reported restoring; none reported, all of them;
    they are done again), at this attempt's measured step time (its saves' stall excluded:
    it is counted once, above);
  - ``productive_s``: the rest of the time between the first step and the fault (or the end);
  - ``stop_s``: from the fault seen to the verdict (the workers stopped, the evidence written);
    for an attempt that finished, from the last optimizer step (the slowest rank's, marked when
    its script ended) to the verdict: what the script did after training (a final save or
    evaluation, the process group's teardown, the exit), which is not training;

- ``restart_s``: between one attempt's verdict and the next one's agent (a new decision, the
  relaunch);
- ``other_s``: what is left of the wall time (the summary, the exit).

The parts add up to the wall time. A save outside the optimizer steps (a final one after the
loop) is not a stall: it is the attempt's ``stop_s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..records import phases
from .policy import Attempt

__all__ = ["AttemptGoodput", "Goodput", "account"]


@dataclass(frozen=True)
class AttemptGoodput:
    """Where one attempt's time went (seconds)."""

    number: int
    wall_s: float
    startup_s: float
    productive_s: float
    checkpoint_stall_s: float
    wasted_progress_s: float
    detection_s: float
    stop_s: float
    #: optimizer steps completed in this attempt, and those done again by the next one
    steps: int
    wasted_steps: int
    step_s: float | None


@dataclass(frozen=True)
class Goodput:
    """The job's goodput and its badput by cause (seconds)."""

    wall_s: float
    decide_s: float
    startup_s: float
    productive_s: float
    checkpoint_stall_s: float
    wasted_progress_s: float
    detection_s: float
    stop_s: float
    restart_s: float
    other_s: float
    interruptions: int
    attempts: tuple[AttemptGoodput, ...] = ()

    @property
    def goodput(self) -> float:
        """The productive share of the wall time (0 when no time was measured)."""
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def parts(self) -> dict[str, float]:
        """Every part of the wall time, by name (they add up to ``wall_s``)."""
        return {"decide_s": self.decide_s, "startup_s": self.startup_s,
                "productive_s": self.productive_s, "checkpoint_stall_s": self.checkpoint_stall_s,
                "wasted_progress_s": self.wasted_progress_s,
                "detection_s": self.detection_s, "stop_s": self.stop_s,
                "restart_s": self.restart_s, "other_s": self.other_s}

    def to_dict(self) -> dict[str, Any]:
        return {"goodput": round(self.goodput, 4), "wall_s": round(self.wall_s, 3),
                **{k: round(v, 3) for k, v in self.parts().items()},
                "interruptions": self.interruptions,
                "attempts": [asdict(a) for a in self.attempts]}

    def line(self) -> str:
        """One clause for the run's summary line."""
        badput = [(name, s) for name, s in (
            ("deciding", self.decide_s), ("start-up", self.startup_s),
            ("detection", self.detection_s), ("lost work", self.wasted_progress_s),
            ("checkpoint stalls", self.checkpoint_stall_s),
            ("stopping", self.stop_s), ("restart", self.restart_s)) if s >= 0.05]
        said = ", ".join(f"{name} {s:.1f} s" for name, s in badput)
        return (f"goodput {100 * self.goodput:.1f}% of {self.wall_s:.1f} s"
                + (f" ({said})" if said else ""))


def _span(a: float | None, b: float | None) -> float:
    return max(0.0, b - a) if a is not None and b is not None else 0.0


def _completed(attempt: Attempt) -> int:
    """Optimizer steps completed by the end of the attempt (one that failed in step k
    completed k - 1)."""
    v = attempt.verdict
    return v.step if v.ok else max(0, v.step - 1)


def _one(attempt: Attempt, resumed_next: int | None) -> AttemptGoodput | None:
    times = attempt.times
    sup = times.supervisor if times is not None else {}
    start = sup.get(phases.AGENT_STARTED)
    end = sup.get(phases.VERDICT, sup.get(phases.WORKERS_STOPPED))
    if times is None or start is None or end is None or end < start:
        return None
    if attempt.verdict.ok:  # a finished script: its steps end at its last one, not its exit
        fault = times.last(phases.LAST_STEP) or sup.get(phases.WORKERS_STOPPED, end)
    else:
        fault = sup.get(phases.FAULT_SEEN, sup.get(phases.WORKERS_STOPPED, end))
    fault = min(max(fault, start), end)
    first = times.last(phases.FIRST_STEP)
    first = None if first is None else min(max(first, start), fault)
    startup = _span(start, first if first is not None else fault)
    running = _span(first, fault)
    detection = min(running, max(0.0, attempt.verdict.detect_s or 0.0))
    stall = min(running - detection, max(0.0, times.most(phases.CHECKPOINT_STALL)))
    stepping = running - detection - stall  # the steps' own time
    done = _completed(attempt)
    steps = max(0, done - (attempt.resumed_from or 0))
    # the first-step mark falls after step 1: the running time holds the steps after it
    step_s = stepping / (steps - 1) if steps > 1 else None
    wasted_steps = 0 if resumed_next is None else max(0, min(steps, done - resumed_next))
    wasted = min(stepping, wasted_steps * step_s) if step_s is not None else 0.0
    return AttemptGoodput(
        number=attempt.number, wall_s=end - start, startup_s=startup,
        productive_s=stepping - wasted, checkpoint_stall_s=stall, wasted_progress_s=wasted,
        detection_s=detection, stop_s=_span(fault, end), steps=steps,
        wasted_steps=wasted_steps, step_s=step_s)


def account(history: Sequence[Attempt], job_start: float, job_end: float) -> Goodput:
    """The job's goodput from its attempts (in order) and its wall-clock start and end."""
    wall = max(0.0, job_end - job_start)
    parts: list[AttemptGoodput] = []
    restart = 0.0
    previous_end: float | None = None
    first_start: float | None = None
    for i, attempt in enumerate(history):
        resumed_next = (history[i + 1].resumed_from or 0) if i + 1 < len(history) else None
        one = _one(attempt, resumed_next)
        if one is None:
            continue
        sup = attempt.times.supervisor if attempt.times is not None else {}
        start = sup[phases.AGENT_STARTED]
        if first_start is None:
            first_start = start
        if previous_end is not None:
            restart += _span(previous_end, start)
        previous_end = start + one.wall_s
        parts.append(one)
    decide = _span(job_start, first_start) if first_start is not None else 0.0
    counted = decide + restart + sum(
        p.startup_s + p.productive_s + p.checkpoint_stall_s + p.wasted_progress_s
        + p.detection_s + p.stop_s for p in parts)
    if counted > wall:  # marks from another clock or a job end before the last verdict
        wall = counted
    return Goodput(
        wall_s=wall, decide_s=decide, startup_s=sum(p.startup_s for p in parts),
        productive_s=sum(p.productive_s for p in parts),
        checkpoint_stall_s=sum(p.checkpoint_stall_s for p in parts),
        wasted_progress_s=sum(p.wasted_progress_s for p in parts),
        detection_s=sum(p.detection_s for p in parts), stop_s=sum(p.stop_s for p in parts),
        restart_s=restart, other_s=wall - counted,
        interruptions=sum(1 for a in history if not a.verdict.ok), attempts=tuple(parts))
