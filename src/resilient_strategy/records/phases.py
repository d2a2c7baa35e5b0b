"""When each phase of an attempt of ``resilient-strategy run`` began: wall-clock marks written by
the supervisor (its agent) and by every worker, read back into a typed `Timeline` that goes
into the attempt's record (``attempts.json``). What a relaunch costs, phase by phase, is then
data (``benchmarks/bench_supervisor.py`` prints it), not a guess.

Each writer owns one small JSON file in the attempt's run directory (``supervisor.phases.json``,
``rank<N>.phases.json``); a mark is written once (the first time a phase is reached) and the file
is replaced atomically. A worker's file also holds its running totals (`WORKER_TOTALS`: seconds,
not wall times), rewritten by `note` as they grow. Standard library only (a worker marks before
it imports a framework); never raises: a mark that cannot be written is lost, the run is not.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import NoSpaceError, ResilientStrategyError
from ..machine import files
from .rundir import RunDir

# The supervisor's phases of one attempt, in order.
AGENT_STARTED = "agent_started"  # the attempt's agent is being built (launch() entered)
WORKERS_STARTED = "workers_started"  # the rendezvous is done and every worker process started
FAULT_SEEN = "fault_seen"  # the monitor saw a worker exit with an error, a stall, a peer's fault
EVIDENCE_TAKEN = "evidence_taken"  # a stall's evidence (stacks, flight dumps) taken: the stop begins
WORKERS_STOPPED = "workers_stopped"  # the agent returned: every worker has exited
VERDICT = "verdict"  # the attempt classified and judged (retry, step down, stop)
NEXT_READY = "next_ready"  # the next attempt's decision is written (its agent starts next)
SUPERVISOR_PHASES = (AGENT_STARTED, WORKERS_STARTED, FAULT_SEEN, EVIDENCE_TAKEN, WORKERS_STOPPED,
                     VERDICT, NEXT_READY)

# A worker's phases, in order.
WORKER_STARTED = "worker_started"  # the worker module runs (the interpreter is up)
REPORTING = "reporting"  # resilient_strategy() took the handed decision (its reporter exists)
COMM_READY = "comm_ready"  # the process group is joined
RESTORED = "restored"  # a checkpoint was restored (prepare() returned with its step)
FIRST_STEP = "first_step"  # the first optimizer step of this attempt is done
LAST_STEP = "last_step"  # a script that finished: when its last optimizer step was done
WORKER_PHASES = (WORKER_STARTED, REPORTING, COMM_READY, RESTORED, FIRST_STEP, LAST_STEP)

# A worker's running totals (seconds, not wall times), in the same file, rewritten as they grow.
#: What the checkpoint saves stalled this rank's training thread between its first and last
#: optimizer step (`resilient_strategy.frameworks.checkpoint.Checkpointer.stall_s`, less what
#: the saves of the first step took, which is start-up).
CHECKPOINT_STALL = "checkpoint_stall_s"
WORKER_TOTALS = (CHECKPOINT_STALL,)

_MAX_BYTES = 64 << 10


def mark(path: str | Path, phase: str, at: float | None = None) -> None:
    """Record that ``phase`` began at ``at`` (wall time; now by default), unless it already
    was. Best effort."""
    marks = read_marks(path)  # the file is the state: one writer per file, no process memory
    if phase in marks:
        return
    marks[phase] = time.time() if at is None else at
    with contextlib.suppress(OSError, NoSpaceError):
        files.write_json_atomic(path, marks, durable=False, what="the phase marks")


def note(path: str | Path, total: str, seconds: float) -> None:
    """Record the running total ``total`` (one of `WORKER_TOTALS`) as ``seconds`` now, over
    what was noted before (the file's one writer only ever raises it). Best effort."""
    marks = read_marks(path)
    marks[total] = float(seconds)
    with contextlib.suppress(OSError, NoSpaceError):
        files.write_json_atomic(path, marks, durable=False, what="the phase marks")


def read_marks(path: str | Path) -> dict[str, float]:
    """The marks in ``path`` (an empty dict when absent or unreadable); numbers only."""
    try:  # this user's own file, never through a symlink, bounded
        data = json.loads(files.read_bytes(Path(path), max_bytes=_MAX_BYTES))
    except (OSError, ValueError, ResilientStrategyError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): float(v) for k, v in data.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


@dataclass(frozen=True)
class Timeline:
    """One attempt's phases (wall times, seconds since the epoch): the supervisor's and each
    local rank's (in local-rank order)."""

    supervisor: Mapping[str, float] = field(default_factory=dict)
    ranks: tuple[Mapping[str, float], ...] = ()

    @classmethod
    def read(cls, run_dir: str | Path, ranks: int) -> Timeline:
        where = RunDir.of(run_dir)
        return cls(read_marks(where.supervisor_phases),
                   tuple(read_marks(where.phases(r)) for r in range(ranks)))

    def last(self, phase: str) -> float | None:
        """When the last rank reached ``phase`` (None: a rank never did)."""
        got = [r.get(phase) for r in self.ranks]
        if not got or any(t is None for t in got):
            return None
        return max(t for t in got if t is not None)

    def most(self, total: str) -> float:
        """The largest running total ``total`` any rank noted (0 when none did): the rank the
        others waited for sets the job's pace."""
        return max((r.get(total, 0.0) for r in self.ranks), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"supervisor": dict(self.supervisor), "ranks": [dict(r) for r in self.ranks]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Timeline:
        return cls(dict(d.get("supervisor", {})), tuple(dict(r) for r in d.get("ranks", ())))
