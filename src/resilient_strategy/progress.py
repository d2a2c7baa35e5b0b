"""Progress as data: what each rank is doing, written cheaply by the rank, judged by one watcher.

A rank owns one small file (``rank<N>.progress``, 32 bytes, memory-mapped) and overwrites it in
place at every phase change: a sequence number, the optimizer step count, the phase and the time
of the last completed step. Writing is two ``struct.pack_into`` calls into the mapping (a
seqlock: an odd sequence number means "being written"), no system call, so the training loop
pays well under a microsecond per report.

The watcher (:class:`StallWatch`) reads every rank's file, notes when anything last changed (by
its own clock, so no clock is shared), and declares a stall when nothing changed for the stall
timeout while some rank waits in a collective (ranks that are all in their own code, loading
data or evaluating, wait on nobody: that is never a stall). :func:`classify_stall` is pure: all ranks waiting in one collective at the same step is
a backend fault; ranks doing different things (one in user code while the others wait in a
collective) diverged, which is the application's problem.

Used by the training supervisor (:mod:`resilient_strategy.supervisor`); the phases are generic
so probe workers can report through the same protocol.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import statistics
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: Phases a rank reports. "outside": in the user's code, between library calls.
PHASES = ("starting", "outside", "compute", "collective", "checkpoint", "done")
STARTING, OUTSIDE, COMPUTE, COLLECTIVE, CHECKPOINT, DONE = range(len(PHASES))

_FORMAT = struct.Struct("<qqid")  # seq, step, phase, last step time (time.monotonic)
_SEQ = struct.Struct("<q")
SIZE = 32  # _FORMAT.size rounded up

#: The default stall timeout: the larger of this and STALL_STEPS x the median step time.
MIN_STALL_S = 60.0
STALL_STEPS = 20


def progress_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.progress"


@dataclass(frozen=True)
class Record:
    """One rank's last report."""

    seq: int
    step: int
    phase: int
    step_time: float  # time.monotonic() of the last completed step (0.0: none yet)

    @property
    def phase_name(self) -> str:
        return PHASES[self.phase] if 0 <= self.phase < len(PHASES) else f"phase {self.phase}"


class ProgressWriter:
    """The rank's side: ``report(phase, step)``. Cheap enough to call several times a step."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._seq = 0
        self.step = 0
        self.phase = -1
        self._step_time = 0.0
        self.report(STARTING, 0)

    def report(self, phase: int, step: int) -> None:
        if step == self.step:
            if phase == self.phase:
                return
        else:
            self._step_time = time.monotonic()
        self.step, self.phase = step, phase
        seq = self._seq + 1  # odd while being written; the seq field is written first
        _FORMAT.pack_into(self._map, 0, seq, step, phase, self._step_time)
        _SEQ.pack_into(self._map, 0, seq + 1)
        self._seq = seq + 1

    def close(self) -> None:
        with contextlib.suppress(ValueError, BufferError):
            self._map.close()


def read_record(path: str | Path) -> Record | None:
    """The rank's last report; None when it has not written one (or it was mid-write twice)."""
    try:
        with open(path, "rb") as fh:
            for _ in range(3):
                raw = fh.read(_FORMAT.size)
                if len(raw) < _FORMAT.size:
                    return None
                seq, step, phase, at = _FORMAT.unpack(raw)
                if seq % 2 == 0 and _SEQ.unpack(raw[:8])[0] == seq:
                    return Record(seq, step, phase, at)
                fh.seek(0)
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class Stall:
    """Nothing changed on any rank for ``seconds`` (>= ``timeout_s``)."""

    records: Mapping[int, Record | None]  # by rank; None: never reported
    seconds: float
    timeout_s: float
    kind: str  # "backend" or "diverged" (see classify_stall)
    summary: str

    @property
    def step(self) -> int:
        return max((r.step for r in self.records.values() if r is not None), default=0)


def classify_stall(records: Mapping[int, Record | None]) -> tuple[str, str]:
    """("backend" | "diverged", what each rank was doing). Pure.

    Backend fault: every rank waits in a collective at the same step (the collective itself
    hangs). Anything else (a rank in its own code, in a checkpoint, at another step, or never
    reported) means the ranks diverged: the program did not call the same collectives on every
    rank, which no other backend fixes.
    """
    doing = "; ".join(
        f"rank {rank}: {'never reported' if r is None else f'{r.phase_name} at step {r.step}'}"
        for rank, r in sorted(records.items())
    )
    present = [r for r in records.values() if r is not None]
    if (
        records
        and len(present) == len(records)
        and all(r.phase == COLLECTIVE for r in present)
        and len({r.step for r in present}) == 1
    ):
        return "backend", doing
    return "diverged", doing


def default_stall_timeout(step_seconds: Sequence[float]) -> float:
    """max(MIN_STALL_S, STALL_STEPS x the median step time) once steps were seen."""
    if not step_seconds:
        return MIN_STALL_S
    return max(MIN_STALL_S, STALL_STEPS * statistics.median(step_seconds))


@dataclass
class StallWatch:
    """Watches the ranks' files; :meth:`poll` returns a :class:`Stall` once nothing has changed
    for the stall timeout (``timeout_s``, or the default from observed step times when None).
    One place owns this deadline; it only starts once some rank has reported."""

    directory: Path
    ranks: int
    timeout_s: float | None = None
    clock: Callable[[], float] = time.monotonic
    _last: dict[int, Record | None] = field(default_factory=dict)
    _changed_at: float | None = None
    _step_seconds: list[float] = field(default_factory=list)

    def current_timeout(self) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        return default_stall_timeout(self._step_seconds[-200:])

    def records(self) -> dict[int, Record | None]:
        return {r: read_record(progress_path(self.directory, r)) for r in range(self.ranks)}

    def poll(self) -> Stall | None:
        now = self.clock()
        records = self.records()
        if records != self._last:
            for rank, rec in records.items():
                old = self._last.get(rank)
                if rec is not None and old is not None and rec.step > old.step and (
                    old.step_time > 0 and rec.step_time > old.step_time
                ):
                    self._step_seconds.append(
                        (rec.step_time - old.step_time) / (rec.step - old.step))
            self._last = records
            if any(r is not None for r in records.values()):
                self._changed_at = now
            return None
        if self._changed_at is None:
            return None
        if any(r is not None and r.phase == DONE for r in records.values()):
            return None  # finishing: the exit is the agent's to see
        if not any(r is not None and r.phase == COLLECTIVE for r in records.values()):
            return None  # nobody waits on a peer: slow user code (loading, evaluation) is fine
        waited = now - self._changed_at
        timeout = self.current_timeout()
        if waited < timeout:
            return None
        kind, summary = classify_stall(records)
        return Stall(records=records, seconds=waited, timeout_s=timeout, kind=kind,
                     summary=summary)

    @property
    def last_step(self) -> int:
        return max((r.step for r in self._last.values() if r is not None), default=0)

    def median_step_s(self) -> float | None:
        return statistics.median(self._step_seconds) if self._step_seconds else None
