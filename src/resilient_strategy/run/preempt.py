"""Preemption and requeue for ``resilient-strategy run`` under a scheduler.

Preemption: SIGUSR1 (SLURM's ``--signal=B:USR1@90``), or a first SIGTERM while workers run,
asks the ranks to checkpoint at their next optimizer step (`records/preemption`: a file in the
attempt's run directory, which rank 0's checkpointer looks at each step), then the supervisor
stops the group once that checkpoint is noted, or at the grace's end (`GRACE_S`,
``RESILIENT_STRATEGY_PREEMPT_GRACE_S`` in the run's environment) without one, and ends with 75
("requeue elsewhere"). A second SIGTERM goes to torch's agent's own handler: the workers are
stopped at once (143), as before. A group that finishes before the checkpoint ends the run as
usual (0).

Requeue (`settle`): at the end of the run, the exit code, the environment and ``scontrol show
job`` decide (`core/values/requeue.requeue_decision`, pure) whether ``scontrol requeue`` runs
(`machine/scontrol`, under a deadline), and, when the run ended on a fault of this node's
(`Ending.node_fault`), ``scontrol update JobId=J ExcNodeList=<the job's + this node>`` after it;
one line says what was done.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from ..core.values.requeue import parse_show_job, requeue_decision
from ..process import PROCESS
from ..records import preemption as flag

#: Seconds from the signal to the stop when no checkpoint is noted (SLURM's KillWait is 30 s
#: after the SIGTERM; ``--signal=B:USR1@90`` gives 90 s before it).
GRACE_S = 60.0
GRACE_VAR = "RESILIENT_STRATEGY_PREEMPT_GRACE_S"

Handler = Callable[[int, FrameType | None], Any] | int | None


def grace_from(env: Mapping[str, str]) -> float:
    """The preemption grace of this run (`GRACE_VAR`, else `GRACE_S`). A value that is not a
    number of seconds in (0, 86400) is an `InvalidOptionError` naming the variable, never the
    default in silence."""
    from ..errors import InvalidOptionError

    raw = env.get(GRACE_VAR, "").strip()
    if not raw:
        return GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < 86_400:  # nan fails too
        raise InvalidOptionError(
            f"{GRACE_VAR}={raw!r} is not a number of seconds between 0 and 86400 (the time "
            "a preempted run gives its ranks to checkpoint); unset it for 60 s", GRACE_VAR)
    return value


@dataclass
class Preemption:
    """This supervisor's preemption state: the signal that asked (None: not preempted), the
    attempt it was handed to, and where that attempt stopped."""

    grace_s: float = GRACE_S
    clock: Callable[[], float] = time.monotonic
    signum: int | None = None
    run_dir: str | None = None
    before: int | None = None  # the checkpoint step noted when the request was handed over
    deadline: float = 0.0
    step: int | None = None  # the checkpoint step the group stopped at (None: none noted)
    _saved: dict[int, Handler] = field(default_factory=dict)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGTERM:
            previous = self._saved.get(signal.SIGTERM)  # a second SIGTERM: stop now
            if callable(previous):
                previous(signum, frame)
                return
            raise SystemExit(128 + signum)
        if self.signum is None:
            self.signum = signum

    def install(self) -> Callable[[], None]:
        """SIGUSR1 handled for the whole run; returns what restores the handlers before."""
        sig = getattr(signal, "SIGUSR1", None)
        if sig is None:  # pragma: no cover - not on POSIX
            return lambda: None
        before = signal.signal(sig, self.on_signal)

        def restore() -> None:
            signal.signal(sig, before)

        return restore

    def watch(self, run_dir: str, inner: Callable[[], int | None] | None,
              checkpoint_in: Callable[[Path], tuple[int, str] | None]
              ) -> Callable[[], int | None]:
        """The agent's per-poll question (`agent.launch`'s ``switch``): the checkpoint step to
        stop this attempt at for a preemption (or ``inner``'s measured switch). Its first call
        takes SIGTERM over from torch's handler for this attempt (the monitor loop runs in the
        main thread)."""

        def due() -> int | None:
            if signal.SIGTERM not in self._saved:
                self._saved[signal.SIGTERM] = signal.signal(signal.SIGTERM, self.on_signal)
            if self.signum is None:
                return inner() if inner is not None else None
            if self.run_dir != run_dir:  # hand the request to this attempt's ranks
                self.run_dir = run_dir
                noted = checkpoint_in(Path(run_dir))
                self.before = None if noted is None else noted[0]
                self.deadline = self.clock() + self.grace_s
                flag.ask(run_dir, self.signum)
            noted = checkpoint_in(Path(run_dir))
            if noted is not None and (self.before is None or noted[0] > self.before):
                self.step = noted[0]
                return noted[0]
            if self.clock() >= self.deadline:
                self.step = None
                return self.before or 0
            return None

        return due

    def attempt_over(self) -> None:
        """Torch's SIGTERM handler back once the attempt's workers are stopped."""
        previous = self._saved.pop(signal.SIGTERM, None)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

    def line(self) -> str:
        """What happened, in one line."""
        name = signal.Signals(self.signum).name if self.signum is not None else "a signal"
        if self.step is not None:
            return (f"preempted ({name}): the ranks checkpointed at step {self.step} and are "
                    "stopped; exit 75 (requeue: resume from that checkpoint)")
        return (f"preempted ({name}): no checkpoint noted within {self.grace_s:.0f} s "
                "(the script keeps none through sel.checkpoint?); the ranks are stopped; "
                "exit 75 (requeue)")


#: The supervisor's one preemption state (signal handlers are the process's).
CURRENT = PROCESS.hold("run.preempt.current", Preemption,
                       "the supervisor's preemption state (its signal handlers)")


@dataclass(frozen=True)
class Ending:
    """How the run ended: its exit code, and the cause that blames this node for it (one of
    `core/knowledge/causes.NODE_CAUSES`: a GPU lost, CUDA that cannot start, a driver too old;
    None: the fault, if any, is not the node's)."""

    code: int
    node_fault: str | None = None
    #: The scheduler's name of the node blamed when it is another node (its own report,
    #: `Verdict.host`); None: this node.
    node_name: str | None = None


def settle(ending: Ending | int, env: Mapping[str, str]) -> int:
    """At the end of the run: requeue the SLURM job when the code and the job ask for it, with
    this node excluded when the fault was the node's (`requeue_decision`); the exit code
    unchanged."""
    from ..machine import scontrol

    if isinstance(ending, int):
        ending = Ending(ending)
    exit_code = ending.code
    decision = requeue_decision(exit_code, env, None)
    if decision.job_id is None or decision.reason is None:
        return exit_code  # not a SLURM job, or a code that asks for no requeue
    shown = scontrol.show_job(decision.job_id, env)
    decision = requeue_decision(exit_code, env, None if shown is None else parse_show_job(shown),
                                ending.node_fault, ending.node_name)
    _say(decision.reason or "")
    if decision.requeue and decision.job_id is not None:  # SLURM then stops this batch script (SIGTERM): it ends here anyway
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        failed = scontrol.requeue(decision.job_id, env)
        if failed is not None:
            _say(f"not requeued after all: {failed}")
        elif decision.exclude is not None:  # SLURM takes ExcNodeList only once it is pending
            unexcluded = scontrol.exclude_nodes(decision.job_id, decision.exclude, env)
            if unexcluded is not None:
                _say(f"requeued, but node {decision.node} is not excluded: {unexcluded}")
    return exit_code


def _say(text: str) -> None:
    print(f"resilient-strategy run: {text}", file=sys.stderr, flush=True)
