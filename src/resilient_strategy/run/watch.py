"""Watching training ranks: the stall policy for training (`training_policy`, the default
allowance from observed step times) and `TrainingWatch`, the check the agent adds to its
monitoring loop.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ..core.call.options import MIN_STALL_S
from ..machine.procs import ProcStat, read_stat, ticks_per_second
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


#: The default stall timeout: the larger of MIN_STALL_S and STALL_STEPS x the p99 step time,
#: at most AUTO_STALL_CAP_S (so that torch's own timeouts, set from it, never decide first).
#: A frozen rank is caught within it with no option (issue 30: max(15 s, 5 x p99 step)).
STALL_STEPS = 5
AUTO_STALL_CAP_S = 600.0
#: Optimizer steps not timed at the start of an attempt (compilation, autotuning, caches).
WARMUP_STEPS = 3
#: Torch's own timeouts under the supervisor: the process group's (a collective that waits
#: longer raises in the worker) and NCCL's heartbeat monitor (kills a rank whose watchdog is
#: stuck) are set just above what the supervisor judges by (the stall allowance and the busy
#: ceiling), so the supervisor judges first, with its evidence, and never later than it must.
PG_TIMEOUT_VAR = "RESILIENT_STRATEGY_PG_TIMEOUT"
HEARTBEAT_VAR = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
#: How far torch's timeouts sit above the supervisor's own ceiling (its poll, the evidence it
#: collects and the stop take seconds; the heartbeat one more margin above the group's).
TORCH_MARGIN_S = 60.0
#: How long a rank busy in its own code (CPU time advancing: validation, checkpointing, data)
#: may keep its peers waiting before it is stopped (``--busy-timeout``). Torch's default
#: process-group timeout: a plain torchrun job tolerates as much.
DEFAULT_BUSY_S = 600.0
#: A rank is busy when its process used at least this share of one CPU over the last
#: BUSY_WINDOW_S (a Python loop uses ~1.0; a rank blocked in a collective, asleep, or stopped ~0).
BUSY_CPU_SHARE = 0.1
BUSY_WINDOW_S = 5.0
#: The shortest span of readings that says anything about a rank's CPU time.
MIN_SPAN_S = 1.0


def default_stall_timeout(step_seconds: Sequence[float]) -> float:
    """max(MIN_STALL_S, STALL_STEPS x the p99 optimizer step time) once steps were seen, at
    most AUTO_STALL_CAP_S."""
    if not step_seconds:
        return MIN_STALL_S
    return min(AUTO_STALL_CAP_S, max(MIN_STALL_S, STALL_STEPS * p99(step_seconds)))


def p99(values: Sequence[float]) -> float:
    """The 99th percentile (nearest rank) of ``values`` (not empty)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def stall_ceiling(fixed_s: float | None) -> float:
    """The most the stall allowance can be: the fixed one, or the automatic one's cap."""
    return fixed_s if fixed_s is not None else AUTO_STALL_CAP_S


def torch_timeouts(fixed_s: float | None, env: Mapping[str, str], default_pg_s: float,
                   busy_s: float = DEFAULT_BUSY_S, framework: str = "torch") -> dict[str, str]:
    """The variables that put the training's timeouts just above what the supervisor judges
    by: the process-group timeout (the larger of the stall allowance's ceiling and the busy
    ceiling, plus TORCH_MARGIN_S, at least ``default_pg_s``; ours, read by both frameworks)
    and, for a ``framework="torch"`` job only, NCCL's heartbeat (TORCH_MARGIN_S more). Never
    one the user set (in ``env``)."""
    pg = max(default_pg_s, max(stall_ceiling(fixed_s), busy_s) + TORCH_MARGIN_S)
    wanted = {PG_TIMEOUT_VAR: f"{pg:g}"}
    if framework == "torch":
        wanted[HEARTBEAT_VAR] = f"{pg + TORCH_MARGIN_S:g}"
    return {k: v for k, v in wanted.items() if k not in env}


def training_policy(timeout_s: float) -> StallPolicy:
    """The progress judge's policy for training ranks: one stall timeout for every wait
    (communicator setup, a collective every rank entered, ranks that never arrived), no
    transfer-size allowance (a training step's all-reduce is timed by the step), and no limit
    on time spent in the user's own code (evaluation, data loading: nobody waits on a peer)."""
    return StallPolicy(setup_grace_s=timeout_s, arrive_grace_s=timeout_s,
                       collective_base_s=timeout_s, first_collective_extra_s=0.0, safety=0.0,
                       quiet_s=None)


#: Stall kinds `poll` adds to the progress judge's: a rank whose process is
#: stopped (SIGSTOP, a debugger) holds the others up; a rank busy in its own code past the busy
#: ceiling.
STOPPED = "stopped"
BUSY = "busy"


def stopped_reason(pids: Mapping[int, int],
                   read: Callable[[int], ProcStat | None] = read_stat) -> Callable[[int], str]:
    """``reason(local_rank)``: "" while that rank's process (in ``pids``) can run, else why it
    cannot answer a request now: it is stopped (state T or t: ``SIGSTOP``, a debugger) and
    stays so until continued. Read fresh from ``/proc`` on every call (``read``: a test passes
    a fake). A process that cannot be read is not said to be stopped."""

    def reason(local_rank: int) -> str:
        pid = pids.get(local_rank)
        got = read(pid) if pid is not None else None
        if got is None or not got.stopped:
            return ""
        return f"its process {pid} is stopped (state {got.state}): it cannot answer until continued"

    return reason


class Activity:
    """Each rank's process seen from outside (`procs`): its
    latest state and whether its CPU time advanced over the last BUSY_WINDOW_S. Fed one
    reading per poll; ``read`` is the reader (a test passes a fake)."""

    def __init__(self, read: Callable[[int], ProcStat | None] = read_stat,
                 ticks_per_s: float | None = None) -> None:
        self.read = read
        self.ticks_per_s = ticks_per_s or ticks_per_second()
        self.samples: dict[int, collections.deque[tuple[float, ProcStat]]] = {}

    def sample(self, pids: Mapping[int, int], now: float) -> None:
        for rank, pid in pids.items():
            got = self.read(pid)
            if got is None:
                continue
            seen = self.samples.setdefault(rank, collections.deque())
            if seen and seen[-1][1].pid != pid:
                seen.clear()  # another process (a new attempt's)
            seen.append((now, got))
            while len(seen) > 2 and seen[1][0] <= now - BUSY_WINDOW_S:
                seen.popleft()

    def state(self, rank: int) -> ProcStat | None:
        seen = self.samples.get(rank)
        return seen[-1][1] if seen else None

    def cpu_share(self, rank: int) -> float | None:
        """The share of one CPU the rank used over the readings kept (None: too few)."""
        seen = self.samples.get(rank)
        if not seen or seen[-1][0] - seen[0][0] < MIN_SPAN_S:
            return None
        (t0, a), (t1, b) = seen[0], seen[-1]
        return (b.cpu_ticks - a.cpu_ticks) / self.ticks_per_s / (t1 - t0)

    def busy(self, rank: int) -> bool:
        share = self.cpu_share(rank)
        state = self.state(rank)
        return (share is not None and share >= BUSY_CPU_SHARE and state is not None
                and not state.stopped and not state.gone)

    def words(self, rank: int) -> str:
        state = self.state(rank)
        if state is None:
            return ""
        share = self.cpu_share(rank)
        return f"process {state.state}" + ("" if share is None else f", cpu {share:.0%}")


class TrainingWatch:
    """The supervisor's judge: the shared `StallWatcher`
    with `training_policy`, its timeout fixed (``--stall-timeout``) or following the p99
    step time seen in rank 0's records, refined by what each rank's process is doing
    (`Activity`): a stopped rank is named as the one holding the others up; a rank whose
    CPU time advances in its own code (not waiting on its device) while the others wait is busy,
    not stalled, until ``busy_s`` (``--busy-timeout``). One place owns these deadlines."""

    def __init__(self, paths: Sequence[str], timeout_s: float | None,
                 clock: Callable[[], float] = time.monotonic, *,
                 busy_s: float | None = None, activity: Activity | None = None) -> None:
        self.fixed = timeout_s
        self.busy_s = DEFAULT_BUSY_S if busy_s is None else busy_s
        self.clock = clock
        self.activity = activity or Activity()
        self.step_seconds: list[float] = []
        self._last: tuple[int, float] | None = None  # rank 0's last step record: (k, t)
        self._first: int | None = None  # the first step this attempt reported (after a resume)
        self.watcher = StallWatcher(paths, training_policy(self.timeout_s()), clock)

    def timeout_s(self) -> float:
        if self.fixed is not None:
            return self.fixed
        return default_stall_timeout(self.step_seconds[-200:])

    def poll(self, pids: Mapping[int, int] | None = None) -> Stall | None:
        """A stall once one is judged, else None. ``pids``: each local rank's process, read
        from outside on every poll (none: judged by the records alone)."""
        now = self.clock()
        self.watcher.read(now)
        if pids:
            self.activity.sample(pids, now)
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
        stall = self.watcher.judge(now)
        return None if stall is None else self.refine(stall)

    def refine(self, stall: Stall) -> Stall | None:
        """The judged stall seen with each rank's process: a stopped rank is the one holding
        the others up (kind `STOPPED`, naming it); ranks busy in their own code are not
        stalled until ``busy_s`` (then kind `BUSY`); else the stall as judged."""
        n = len(self.watcher.paths)
        act = self.activity
        positions = tuple(f"{p} [{w}]" if (w := act.words(r)) else p
                          for r, p in enumerate(stall.positions))
        stopped = tuple(r for r in range(n) if (st := act.state(r)) is not None and st.stopped)
        if stopped:
            return Stall(STOPPED, stall.phase, stall.k, stopped, stall.waited_s, stall.limit_s,
                         positions)
        if stall.kind != "setup":
            busy = tuple(r for r in stall.ranks
                         if act.busy(r) and not self.watcher.device_behind(r))
            if busy:
                if stall.waited_s <= self.busy_s:
                    return None
                return Stall(BUSY, stall.phase, stall.k, busy, stall.waited_s, self.busy_s,
                             positions)
        return replace(stall, positions=positions)
