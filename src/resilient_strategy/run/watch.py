"""Watching training ranks: the stall policy for training (`training_policy`, the default
allowance from observed step times) and `TrainingWatch`, the check the agent adds to its
monitoring loop.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from ..core.call.fields import CALL
from ..core.call.options import MIN_STALL_S
from ..machine.procs import ProcStat, read_stat, ticks_per_second, tree_ticks
from ..records.progress import (
    COLLECTIVE,
    COLLECTIVE_DONE,
    FINISHED,
    STEP_DONE,
    Stall,
    StallPolicy,
    StallWatcher,
)

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
PG_TIMEOUT_VAR = CALL["process_group_timeout"].env
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
#: A rank is idle while its process, with every process below it (DataLoader workers, a
#: compiler it started), uses less than this share of one CPU, plus `IDLE_SLACK_TICKS` for
#: the clock ticks' granularity (a Python loop uses ~1.0; a rank asleep in a lock, a
#: ``sleep`` or a read that never returns, 0; torch's own idle threads well under it).
IDLE_CPU_SHARE = 0.01
IDLE_SLACK_TICKS = 2
#: How often the CPU time of a quiet rank's whole process tree is read (one pass over /proc).
TREE_EVERY_S = 1.0


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


def stall_ceiling(stall_timeout_s: float | None) -> float:
    """The most the stall allowance can be: the fixed one, or the automatic one's cap."""
    return stall_timeout_s if stall_timeout_s is not None else AUTO_STALL_CAP_S


def torch_timeouts(stall_timeout_s: float | None, env: Mapping[str, str], default_pg_s: float,
                   busy_s: float = DEFAULT_BUSY_S, framework: str = "torch") -> dict[str, str]:
    """The variables that put the training's timeouts just above what the supervisor judges
    by: the process-group timeout (the larger of the stall allowance's ceiling and the busy
    ceiling, plus TORCH_MARGIN_S, at least ``default_pg_s``; ours, read by both frameworks)
    and, for a ``framework="torch"`` job only, NCCL's heartbeat (TORCH_MARGIN_S more). Never
    one the user set (in ``env``)."""
    pg = max(default_pg_s, max(stall_ceiling(stall_timeout_s), busy_s) + TORCH_MARGIN_S)
    wanted = {PG_TIMEOUT_VAR: f"{pg:g}"}
    if framework == "torch":
        wanted[HEARTBEAT_VAR] = f"{pg + TORCH_MARGIN_S:g}"
    return {k: v for k, v in wanted.items() if k not in env}


def training_policy(stall_timeout_s: float) -> StallPolicy:
    """The progress judge's policy for training ranks: one stall timeout for every wait
    (communicator setup, a collective every rank entered, ranks that never arrived), no
    transfer-size allowance (a training step's all-reduce is timed by the step), and no limit
    on time spent in the user's own code (evaluation, data loading: nobody waits on a peer)."""
    return StallPolicy(setup_grace_s=stall_timeout_s, arrive_grace_s=stall_timeout_s,
                       collective_base_s=stall_timeout_s, first_collective_extra_s=0.0, safety=0.0,
                       quiet_s=None)


#: Stall kinds `poll` adds to the progress judge's: a rank whose process is
#: stopped (SIGSTOP, a debugger) holds the others up, or, with nobody waiting on it, stays
#: stopped past the allowance; a rank busy in its own code past the busy ceiling; a rank
#: asleep (its process and those it started use no CPU) with no progress past the allowance.
STOPPED = "stopped"
BUSY = "busy"
ASLEEP = "asleep"


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


@dataclass
class _Quiet:
    """How long one rank's process has been idle: its own CPU time has not moved since
    ``since`` (``ticks`` then), and its whole tree's since ``tree_at`` (``tree`` then; None:
    not read yet), last read at ``looked``."""

    pid: int
    since: float
    ticks: int
    tree_at: float | None = None
    tree: int = 0
    looked: float = 0.0


class Activity:
    """Each rank's process seen from outside (`procs`): its
    latest state, whether its CPU time advanced over the last BUSY_WINDOW_S, since when it
    has been stopped, and since when it has been idle (its CPU time, and that of every
    process below it, not moving: `IDLE_CPU_SHARE`). Fed one reading per poll; ``read`` is
    the reader and ``read_tree`` the reader of a tree's CPU ticks (a test passes fakes; a
    fake ``read`` alone: a tree is its one process)."""

    def __init__(self, read: Callable[[int], ProcStat | None] = read_stat,
                 ticks_per_s: float | None = None,
                 read_tree: Callable[[Iterable[int]], Mapping[int, int]] | None = None) -> None:
        self.read = read
        self.ticks_per_s = ticks_per_s or ticks_per_second()
        if read_tree is None:
            read_tree = tree_ticks if read is read_stat else self._own_ticks
        self.read_tree = read_tree
        self.samples: dict[int, collections.deque[tuple[float, ProcStat]]] = {}
        self.stopped_at: dict[int, tuple[int, float]] = {}  # rank: (pid, first seen stopped)
        self.quiet: dict[int, _Quiet] = {}

    def _own_ticks(self, pids: Iterable[int]) -> dict[int, int]:
        return {pid: got.cpu_ticks for pid in pids if (got := self.read(pid)) is not None}

    def _moved(self, ticks: int, span_s: float) -> bool:
        return ticks > IDLE_CPU_SHARE * self.ticks_per_s * span_s + IDLE_SLACK_TICKS

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
            if not got.stopped:
                self.stopped_at.pop(rank, None)
            elif self.stopped_at.get(rank, (None, 0.0))[0] != pid:
                self.stopped_at[rank] = (pid, now)
            q = self.quiet.get(rank)
            if (q is None or q.pid != pid or got.stopped or got.gone
                    or self._moved(got.cpu_ticks - q.ticks, now - q.since)):
                self.quiet[rank] = _Quiet(pid, now, got.cpu_ticks)
        # the trees of the ranks whose own process has been idle a while, at most once a
        # TREE_EVERY_S: the one pass over /proc is paid only for a rank that may be asleep
        due = {rank: q for rank, q in self.quiet.items()
               if pids.get(rank) == q.pid and now - q.since >= TREE_EVERY_S
               and (q.tree_at is None or now - q.looked >= TREE_EVERY_S)}
        if not due:
            return
        trees = self.read_tree([q.pid for q in due.values()])
        for q in due.values():
            ticks = trees.get(q.pid)
            if ticks is None:
                continue
            if q.tree_at is None or self._moved(ticks - q.tree, now - q.tree_at):
                q.tree_at, q.tree = now, ticks  # a process below it works: idle from now
            q.looked = now

    def stopped_for(self, rank: int, now: float) -> float:
        """Seconds the rank's process has been seen stopped (0: it is not)."""
        got = self.stopped_at.get(rank)
        return 0.0 if got is None else now - got[1]

    def idle_for(self, rank: int, now: float) -> float:
        """Seconds the rank's process, and every process below it, has used no CPU time to
        speak of (`IDLE_CPU_SHARE`; 0: it works, or its tree was not read yet)."""
        q = self.quiet.get(rank)
        return 0.0 if q is None or q.tree_at is None else now - q.tree_at

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
    not stalled, until ``busy_s`` (``--busy-timeout``). Each rank is also judged by itself,
    with no peer waiting on it (one process, a Keras job, a job stepped down to one device,
    a rank in the teardown after its last step): `alone`. One place owns these deadlines."""

    def __init__(self, paths: Sequence[str], stall_timeout_s: float | None,
                 clock: Callable[[], float] = time.monotonic, *,
                 busy_s: float | None = None, activity: Activity | None = None) -> None:
        self.stall_timeout_s = stall_timeout_s  # None: it follows the step time
        self.busy_s = DEFAULT_BUSY_S if busy_s is None else busy_s
        self.clock = clock
        self.activity = activity or Activity()
        self.step_seconds: list[float] = []
        self._last: tuple[int, float] | None = None  # rank 0's last step record: (k, t)
        self._first: int | None = None  # the first step this attempt reported (after a resume)
        #: each rank's first step seen in this attempt (a resume's restored step): a rank is
        #: judged asleep only past it, in its training loop
        self._seen_first: dict[int, int] = {}
        self.watcher = StallWatcher(paths, training_policy(self.timeout_s()), clock)

    def timeout_s(self) -> float:
        if self.stall_timeout_s is not None:
            return self.stall_timeout_s
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
            # finished: the exits are the agent's to see, unless a process cannot exit (one
            # rank's "finished" ends the peers' watch for that rank only: never blamed for
            # silence)
            return self.stopped_alone(now) if pids else None
        for r, seen in enumerate(records):
            if seen is not None and seen.phase in (STEP_DONE, COLLECTIVE, COLLECTIVE_DONE):
                self._seen_first.setdefault(r, seen.k)
        rec = records[0] if records else None
        if rec is not None and rec.phase in (STEP_DONE, COLLECTIVE_DONE) and rec.k > 0:
            if self._first is None:
                self._first = rec.k
            if (self._last is not None and rec.k > self._last[0] and rec.t > self._last[1]
                    and self._last[0] >= self._first + WARMUP_STEPS):
                self.step_seconds.append((rec.t - self._last[1]) / (rec.k - self._last[0]))
            if self._last is None or rec.k != self._last[0]:
                self._last = (rec.k, rec.t)
        if self.stall_timeout_s is None:
            self.watcher.policy = training_policy(self.timeout_s())
        stall = self.watcher.judge(now)
        if stall is not None:
            return self.refine(stall)
        return self.alone(now) if pids else None

    def stopped_alone(self, now: float) -> Stall | None:
        """The ranks whose process has been stopped longer than the allowance, whoever waits
        on them (a stopped process never exits: one process, or the teardown after the last
        step, would wait for it forever), as a `STOPPED` stall; None while there is none."""
        limit = self.timeout_s()
        n = len(self.watcher.paths)
        held = {r: t for r in range(n) if (t := self.activity.stopped_for(r, now)) > limit}
        if not held:
            return None
        return self._own(STOPPED, tuple(sorted(held)), min(held.values()), limit)

    def alone(self, now: float) -> Stall | None:
        """Each rank judged by its own progress, with no peer waiting on it (the progress
        judge saw no wait): a rank stopped past the allowance (`stopped_alone`); else ranks
        asleep in their own code (`ASLEEP`: past their first step here, outside any
        collective a peer shares, their device not behind, no new record and their process
        tree's CPU time not moving for the allowance) when no rank of the group is working
        (a rank that waits on a busy one in a collective the records do not mark, a barrier,
        is not hung: busy is never a stall). None while every rank is fine."""
        stopped = self.stopped_alone(now)
        if stopped is not None:
            return stopped
        limit = self.timeout_s()
        w, act = self.watcher, self.activity
        n = len(w.paths)
        quiet: dict[int, float] = {}
        working = False
        for r, rec in enumerate(w.records):
            if rec is None or rec.phase == FINISHED:
                continue
            idle = min(act.idle_for(r, now), now - w.changed_at(r))
            if idle <= limit:
                working = working or act.stopped_for(r, now) == 0.0
                continue
            in_loop = rec.phase in (STEP_DONE, COLLECTIVE_DONE) or (
                rec.phase == COLLECTIVE and n == 1)
            if in_loop and rec.k > self._seen_first.get(r, rec.k) and not w.device_behind(r):
                quiet[r] = idle
        if working or not quiet:
            return None
        return self._own(ASLEEP, tuple(sorted(quiet)), min(quiet.values()), limit)

    def _own(self, kind: str, ranks: tuple[int, ...], waited: float, limit: float) -> Stall:
        """A stall of ``ranks`` judged by their own progress (`Stall.alone`), where the first
        of them was."""
        rec = self.watcher.records[ranks[0]]
        act = self.activity
        positions = tuple(f"{p} [{w}]" if (w := act.words(r)) else p
                          for r, p in enumerate(self.watcher.positions()))
        return Stall(kind, rec.phase if rec is not None else "started",
                     rec.k if rec is not None else 0, ranks, round(waited, 3), round(limit, 3),
                     positions, alone=True)

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
