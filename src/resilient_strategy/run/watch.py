"""Watching training ranks: the stall policy for training (:func:`training_policy`, the default
allowance from observed step times) and :class:`TrainingWatch`, the check the agent adds to its
monitoring loop.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
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


#: The default stall timeout: the larger of MIN_STALL_S and STALL_STEPS x the median step time.
STALL_STEPS = 20


def default_stall_timeout(step_seconds: Sequence[float]) -> float:
    """max(MIN_STALL_S, STALL_STEPS x the median optimizer step time) once steps were seen."""
    if not step_seconds:
        return MIN_STALL_S
    return max(MIN_STALL_S, STALL_STEPS * statistics.median(step_seconds))


def training_policy(timeout_s: float) -> StallPolicy:
    """The progress judge's policy for training ranks: one stall timeout for every wait
    (communicator setup, a collective every rank entered, ranks that never arrived), no
    transfer-size allowance (a training step's all-reduce is timed by the step), and no limit
    on time spent in the user's own code (evaluation, data loading: nobody waits on a peer)."""
    return StallPolicy(setup_grace_s=timeout_s, arrive_grace_s=timeout_s,
                       collective_base_s=timeout_s, first_collective_extra_s=0.0, safety=0.0,
                       quiet_s=None)


class TrainingWatch:
    """The supervisor's judge: the shared :class:`~resilient_strategy.records.progress.StallWatcher`
    with :func:`training_policy`, its timeout fixed (``--stall-timeout``) or following the median
    step time seen in rank 0's records. One place owns this deadline."""

    def __init__(self, paths: Sequence[str], timeout_s: float | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fixed = timeout_s
        self.clock = clock
        self.step_seconds: list[float] = []
        self._last: tuple[int, float] | None = None  # rank 0's last step record: (k, t)
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
            if self._last is not None and rec.k > self._last[0] and rec.t > self._last[1]:
                self.step_seconds.append((rec.t - self._last[1]) / (rec.k - self._last[0]))
            if self._last is None or rec.k != self._last[0]:
                self._last = (rec.k, rec.t)
        if self.fixed is None:
            self.watcher.policy = training_policy(self.timeout_s())
        return self.watcher.judge(now)
