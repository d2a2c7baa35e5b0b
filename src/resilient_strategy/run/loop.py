"""The supervisor's attempt loop (pure: nothing here imports torch): start an attempt and watch
it, read what it came to, judge it, record it, then end the run or relaunch, over hooks that
`supervisor` implements for real and a test implements with scripted verdicts.

    ending = run_attempts(hooks, first_choice)

Each hook has typed inputs and outputs and can be driven alone:

- `Hooks.sits_out`: this node has nothing to run in this attempt (a `preempt.Ending`), or None;
- `Hooks.start_and_watch`: the attempt, run to its end: a `Watched`, or an `Ending` when it was
  stopped from outside (a signal, a preemption);
- `Hooks.observe`: what the attempt came to (`Observed`: the verdict as judged, the nodes gone,
  the step its script restored, its measured step);
- `Hooks.judge`: what follows and where (`Judged`: the `Judgement`, the next choice or None);
- `Hooks.record`: the attempt as recorded (`policy.Attempt`; its evidence written);
- `Hooks.finish`: the run's end (`Ending`, through `ending_of`);
- `Hooks.announce_relaunch`: the relaunch said and noted for the next attempt's script.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from ..core.knowledge.causes import node_cause
from ..errors import ResilientStrategyError
from .exitcodes import ExitCode
from .policy import Attempt, Judgement
from .preempt import Ending
from .verdicts import Verdict, VerdictKind

#: What an attempt is launched on (the supervisor's `Choice`; a test's own).
C = TypeVar("C")

#: The most attempts one run makes (never reached: the policy's bounds stop it first).
MAX_ATTEMPTS = 10_000


@dataclass(frozen=True)
class Watched:
    """An attempt run to its end: the verdict of this node's workers, and the watch on the other
    nodes it ran with (None: no other node)."""

    verdict: Verdict
    peer: Any = None


@dataclass(frozen=True)
class Observed:
    """What an attempt came to, as it is judged: the verdict (one-device, named, merged with
    the other nodes'), how each node known gone was seen, the checkpoint step the attempt's own
    script restored (None: none), and what rank 0 measured of the step (None: not measured)."""

    verdict: Verdict
    gone: Mapping[int, str] = field(default_factory=dict)
    resumed: int | None = None
    measured: Any = None

    @property
    def switched(self) -> bool:
        """Stopped healthy at a checkpoint for a measured switch (no fault)."""
        return self.verdict.kind is VerdictKind.SWITCH


@dataclass(frozen=True)
class Judged(Generic[C]):
    """What follows an attempt: the judgement, where the next attempt runs (None: the run ends),
    and what was done with its measured step (`policy.MEASURED_OUTCOMES`)."""

    judgement: Judgement
    next: C | None = None
    outcome: str = "measured"


class Hooks(Protocol[C]):
    """The steps of one attempt (`run_attempts` calls them in this order)."""

    def sits_out(self, choice: C, history: Sequence[Attempt]) -> Ending | None: ...

    def start_and_watch(self, attempt: int, choice: C) -> Watched | Ending: ...

    def observe(self, attempt: int, choice: C, watched: Watched) -> Observed: ...

    def judge(self, attempt: int, choice: C, seen: Observed,
              history: Sequence[Attempt]) -> Judged[C]: ...

    def record(self, attempt: int, choice: C, seen: Observed, judged: Judged[C]) -> Attempt: ...

    def finish(self, history: Sequence[Attempt], judgement: Judgement) -> Ending: ...

    def announce_relaunch(self, history: Sequence[Attempt], choice: C, seen: Observed,
                          judged: Judged[C]) -> None: ...


def run_attempts(hooks: Hooks[C], first: C) -> Ending:
    """Attempt after attempt from ``first`` until the run ends (`Hooks` says each step)."""
    choice, history = first, list[Attempt]()
    for attempt in range(MAX_ATTEMPTS):
        sat_out = hooks.sits_out(choice, history)
        if sat_out is not None:
            return sat_out
        watched = hooks.start_and_watch(attempt, choice)
        if isinstance(watched, Ending):
            return watched
        seen = hooks.observe(attempt, choice, watched)
        judged = hooks.judge(attempt, choice, seen, history)
        history.append(hooks.record(attempt, choice, seen, judged))
        if judged.next is None:
            return hooks.finish(history, judged.judgement)
        hooks.announce_relaunch(history, choice, seen, judged)
        choice = judged.next
    raise ResilientStrategyError("too many launch attempts")  # pragma: no cover


def exit_code(judgement: Judgement) -> ExitCode:
    """The run's exit code after its last judgement (none said: `INFRASTRUCTURE`)."""
    return judgement.exit_code if judgement.exit_code is not None else ExitCode.INFRASTRUCTURE


def ending_of(history: Sequence[Attempt], judgement: Judgement,
              node: int | None = None) -> Ending:
    """How the run ends after ``judgement`` on the last of ``history``: its exit code, and the
    node whose fault it was where an `INFRASTRUCTURE` end is a node's (a requeue then excludes
    it). ``node``: this node's number across nodes (None: one node). This node's own fault
    (`Verdict.node` None or ``node``) blames this node; a fault another node recorded, which this
    node stopped for, blames that node by the name it sent (`Verdict.host`), never this one:
    under SLURM the task that requeues the job is node 0's, and excluding it for node 1's lost
    GPU would requeue the job off a healthy node and onto the faulty one."""
    code = int(exit_code(judgement))
    if code != ExitCode.INFRASTRUCTURE:
        return Ending(code)
    failed = [a.verdict for a in history if not a.verdict.ok]
    own = node_cause(v.cause for v in failed if v.node in (None, node))
    if own is not None:
        return Ending(code, own)
    for v in reversed(failed):  # the latest fault of another node that is that node's
        if v.node not in (None, node) and v.host and node_cause((v.cause,)) is not None:
            return Ending(code, v.cause, v.host)
    return Ending(code)
