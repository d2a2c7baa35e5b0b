"""What rank 0 measured of the user's step in one attempt of ``resilient-strategy run`` (issue 41
item 4), for the supervisor: the measured rate of the chosen candidate and, when a proven one
would be clearly faster (`core.trace.measuring.MeasuredFaster`), which. Written once by rank 0
when its measuring window closes (`RunDir.measured_note`, atomically); read by the supervisor,
bounded, no FIFO, no symlink (an unreadable note is none)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.values.bounded import parse_json
from ..errors import NoSpaceError, ResilientStrategyError
from ..machine import files
from .rundir import RunDir


@dataclass(frozen=True)
class MeasuredNote:
    """One attempt's measured step: ``candidate`` (its key) took ``step_s`` seconds an optimizer
    step (the global batch) over its window, which ended at optimizer step ``at_step`` of the
    job (counted across relaunches); ``faster``: the key of a proven candidate estimated
    ``faster_step_s`` a step with that compute (``faster_label`` in words), "" when none is
    clearly faster."""

    candidate: str
    step_s: float
    at_step: int
    faster: str = ""
    faster_label: str = ""
    faster_step_s: float | None = None

    @property
    def steps_per_s(self) -> float:
        """The measured rate, optimizer steps (each the global batch) a second."""
        return 1.0 / self.step_s if self.step_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate, "step_s": self.step_s,
                "steps_per_s": self.steps_per_s, "at_step": self.at_step,
                "faster": self.faster, "faster_label": self.faster_label,
                "faster_step_s": self.faster_step_s}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MeasuredNote:
        fs = d.get("faster_step_s")
        note = cls(str(d["candidate"]), float(d["step_s"]), int(d["at_step"]),
                   str(d.get("faster", "") or ""), str(d.get("faster_label", "") or ""),
                   None if fs is None else float(fs))
        if not note.step_s > 0 or note.at_step < 0:
            raise ValueError("not a measured step")
        return note


def note_measured(run_dir: str | Path | RunDir, note: MeasuredNote) -> None:
    """Rank 0, when its window closed: the note for the supervisor. Best effort; never raises
    (a full disk loses the note, never the training)."""
    with contextlib.suppress(OSError, NoSpaceError, ValueError, TypeError):
        files.write_json_atomic(RunDir.of(run_dir).measured_note, note.to_dict(), durable=False,
                                what="the measured step's note")


def read_measured(run_dir: str | Path | RunDir) -> MeasuredNote | None:
    """The attempt's measured note, None when there is none (yet) or it cannot be read."""
    path = RunDir.of(run_dir).measured_note
    try:
        data = parse_json(files.read_bytes(path, max_bytes=files.MAX_REPORT_BYTES), str(path))
        return MeasuredNote.from_dict(data)
    except (OSError, ValueError, KeyError, TypeError, ResilientStrategyError):
        return None


def note_measured_here(note: MeasuredNote) -> None:
    """In a worker of ``resilient-strategy run``: `note_measured` in its attempt's directory
    (nothing outside ``run``)."""
    from .handoff import WORKER

    loaded = WORKER.loaded
    if loaded:
        note_measured(next(iter(loaded.values())).run_dir, note)
