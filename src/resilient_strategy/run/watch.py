"""Watching training ranks: the stall policy for training (`training_policy`, the default
allowance from observed step times) and `TrainingWatch`, the check the agent adds to its
monitoring loop.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..core.options import MIN_STALL_S
from ..records.progress import (
    COLLECTIVE_DONE,
    FINISHED,
    STEP_DONE,
    Stall,
    StallPolicy,
    StallWatcher,
)

if TYPE_CHECKING:
    pass

log = logging.getLogger("resilient_strategy")


#: The default stall timeout: the larger of MIN_STALL_S and STALL_STEPS x the median step time,
#: at most AUTO_STALL_CAP_S (so that torch's own timeouts, set from it, never decide first).
STALL_STEPS = 20
AUTO_STALL_CAP_S = 1800.0
#: Optimizer steps not timed at the start of an attempt (compilation, autotuning, caches).
WARMUP_STEPS = 3
#: Torch's own timeouts under the supervisor: the process group's (a collective that waits
#: longer raises in the worker) and NCCL's heartbeat monitor (kills a rank whose watchdog is
#: stuck) are set above the stall allowance, so the supervisor judges a stall first, with its
#: evidence, rather than torch's 10- and 8-minute defaults.
PG_TIMEOUT_VAR = "RESILIENT_STRATEGY_PG_TIMEOUT"
HEARTBEAT_VAR = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"


def default_stall_timeout(step_seconds: Sequence[float]) -> float:
    """max(MIN_STALL_S, STALL_STEPS x the median optimizer step time) once steps were seen, at
    most AUTO_STALL_CAP_S."""
    if not step_seconds:
        return MIN_STALL_S
    return min(AUTO_STALL_CAP_S, max(MIN_STALL_S, STALL_STEPS * statistics.median(step_seconds)))


def stall_ceiling(fixed_s: float | None) -> float:
    """The most the stall allowance can be: the fixed one, or the automatic one's cap."""
    return fixed_s if fixed_s is not None else AUTO_STALL_CAP_S


def torch_timeouts(fixed_s: float | None, env: Mapping[str, str],
                   default_pg_s: float, framework: str = "torch") -> dict[str, str]:
    """The variables that put the training's timeouts above the stall allowance: the
    process-group timeout (twice the allowance's ceiling, at least ``default_pg_s``; ours, read
    by both frameworks) and, for a ``framework="torch"`` job only, NCCL's heartbeat (a minute
    more). Never one the user set (in ``env``)."""
    pg = max(default_pg_s, 2 * stall_ceiling(fixed_s))
    wanted = {PG_TIMEOUT_VAR: f"{pg:g}"}
    if framework == "torch":
        wanted[HEARTBEAT_VAR] = f"{pg + 60:g}"
    return {k: v for k, v in wanted.items() if k not in env}


def training_policy(timeout_s: float) -> StallPolicy:
    """The progress judge's policy for training ranks: one stall timeout for every wait
    (communicator setup, a collective every rank entered, ranks that never arrived), no
    transfer-size allowance (a training step's all-reduce is timed by the step), and no limit
    on time spent in the user's own code (evaluation, data loading: nobody waits on a peer)."""
    return StallPolicy(setup_grace_s=timeout_s, arrive_grace_s=timeout_s,
                       collective_base_s=timeout_s, first_collective_extra_s=0.0, safety=0.0,
                       quiet_s=None)


class TrainingWatch:
    """The supervisor's judge: the shared `StallWatcher`
    with `training_policy`, its timeout fixed (``--stall-timeout``) or following the median
    step time seen in rank 0's records. One place owns this deadline."""

    def __init__(self, paths: Sequence[str], timeout_s: float | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fixed = timeout_s
        self.clock = clock
        self.step_seconds: list[float] = []
        self._last: tuple[int, float] | None = None  # rank 0's last step record: (k, t)
        self._first: int | None = None  # the first step this attempt reported (after a resume)
        self.watcher = StallWatcher(paths, training_policy(self.timeout_s()), clock)

    def timeout_s(self) -> float:
        if self.fixed is not None:
            return self.fixed
        return default_stall_timeout(self.step_seconds[-200:])

    def poll(self) -> Stall | None:
        now = self.clock()
        self.watcher.read(now)
        records = self.watcher.records
        if records and all(r is not None and r.phase == FINISHED for r in records):
            return None  # finished: the exits are the agent's to see. One rank's "finished"
            # ends the watch for that rank only (the watcher never blames it for silence)
        rec = records[0] if records else None
        if rec is not None and rec.phase in (STEP_DONE, COLLECTIVE_DONE) and rec.k > 0:
            if self._first is None:
                self._first = rec.k
            if (self._last is not None and rec.k > self._last[0] and rec.t > self._last[1]
                    and self._last[0] >= self._first + WARMUP_STEPS):
                self.step_seconds.append((rec.t - self._last[1]) / (rec.k - self._last[0]))
            if self._last is None or rec.k != self._last[0]:
                self._last = (rec.k, rec.t)
        if self.fixed is None:
            self.watcher.policy = training_policy(self.timeout_s())
        return self.watcher.judge(now)
