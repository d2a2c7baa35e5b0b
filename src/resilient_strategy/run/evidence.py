"""Where a fault's evidence goes: one file per failed attempt under ``--evidence-dir``
(``<dir>/<session>/attempt<N>.txt``: the verdict, what torch's flight recorder said of a stalled
group (the collective it is stuck in, the ranks that never entered it, each rank's last entries;
`resilient_strategy.records.flightdump`), then each rank's traceback, the Python stacks dumped
before a stalled group was stopped, and the tail of its stderr) and ``attempts.json`` (every
attempt: candidate, verdict with the flight recorder's facts, what followed, exit code; or, when
the nodes never agreed on a first attempt, ``setup``: what failed). The raw
dumps are kept beside it (``attempt<N>.<api>.rank<R>``, for torch's own analyzer,
``python -m torch.distributed.flight_recorder.fr_trace``). The console gets one line per fault and
this file's path, not the tracebacks.

The workers leave ``rank<N>.traceback.txt`` and ``rank<N>.stacks.txt`` in the attempt's run
directory (`worker`); the run directory is removed at the end of the run, these files are
not. Never raises: evidence that cannot be written is said in the line, not fatal.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..machine.files import ensure_private_dir, write_json_atomic
from ..records.flightdump import FlightFacts
from ..records.rundir import RunDir
from .policy import Attempt

#: How much of each rank's stderr the evidence keeps (its end).
STDERR_TAIL_BYTES = 64 << 10
#: How much of a traceback or stack dump file is read.
DUMP_BYTES = 256 << 10


class Evidence:
    """The evidence files of one run (``root/session``), created on the first fault."""

    def __init__(self, root: Path, session: str) -> None:
        self.dir = root / session

    def path(self, number: int) -> Path:
        """Where attempt ``number``'s evidence goes (0 for the first attempt)."""
        return self.dir / f"attempt{number + 1}.txt"

    def record(self, attempt: Attempt, run_dir: Path, ranks: int) -> str | None:
        """Write one failed attempt's evidence; its path, or None when it could not be written."""
        parts = [f"attempt {attempt.number + 1} on {attempt.label} ({attempt.candidate})",
                 f"verdict: {attempt.verdict.line()}", f"step: {attempt.verdict.step}",
                 f"next: {attempt.judgement.action.value}: {attempt.judgement.reason}",
                 f"summary: {attempt.verdict.summary}", ""]
        fr = attempt.verdict.flight
        if fr is not None:
            parts += [*fr.describe(), *self._raw_dumps(attempt.number, fr), ""]
        where = RunDir.of(run_dir)
        for r in range(ranks):
            for title, path, limit in (
                    ("traceback", where.traceback(r), DUMP_BYTES),
                    ("Python stacks before the stop", where.stacks(r), DUMP_BYTES),
                    ("stderr (end)", next(iter(where.stderr_logs(r)), None),
                     STDERR_TAIL_BYTES)):
                text = _tail(path, limit) if path is not None else ""
                if text.strip():
                    parts += [f"===== rank {r}: {title} ({path}) =====", text.rstrip(), ""]
        parts += self._error_records(attempt.number, run_dir, ranks)
        path = self.path(attempt.number)
        try:
            ensure_private_dir(self.dir)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0),
                         0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write("\n".join(parts) + "\n")
        except Exception:
            return None
        return str(path)

    def error_record(self, number: int, local_rank: int) -> Path:
        """Where attempt ``number``'s copy of a rank's error record goes (a replay reads it:
        `resilient_strategy.testing.replay.MidRunFault.from_record`)."""
        return self.dir / f"attempt{number + 1}.rank{local_rank}.error.json"

    def _error_records(self, number: int, run_dir: Path, ranks: int) -> list[str]:
        """Each rank's error record (its class chain and frames) copied beside the evidence
        file; the lines that name them. Best effort."""
        out = []
        for r in range(ranks):
            src = RunDir.of(run_dir).error(r)
            if not src.is_file():
                continue
            copy = self.error_record(number, r)
            if self._keep(src, copy):
                out.append(f"rank {r}'s error record: {copy}")
        return out

    def _keep(self, src: Path, copy: Path) -> bool:
        """``src`` copied to ``copy`` in the evidence directory; False when it could not be."""
        try:
            ensure_private_dir(self.dir)
            shutil.copyfile(src, copy)
        except Exception:
            return False
        return True

    def _raw_dumps(self, number: int, fr: FlightFacts) -> list[str]:
        """Each rank's raw flight-recorder dumps copied beside the evidence file (the run
        directory goes at the end of the run); the lines that name them. Best effort."""
        out = []
        for r in fr.ranks:
            for raw in r.files:
                api = Path(raw).name.split(".flight", 1)[-1].removesuffix(".pkl")
                copy = self.dir / f"attempt{number + 1}.{api}.rank{r.rank}"
                if self._keep(Path(raw), copy):
                    out.append(f"  rank {r.rank}'s raw dump ({api}): {copy}")
        return out

    def summary(self, history: Sequence[Attempt],
                membership: Sequence[Mapping[str, Any]] = (),
                goodput: Mapping[str, Any] | None = None) -> str | None:
        """``attempts.json`` when there was a fault (the directory exists); its path or None.
        ``membership``: a multi-node run's membership round of each attempt (who was in, who
        left and how it was seen, who joined: `Change`); ``goodput``: the job's productive
        share and its badput by cause (`goodput.Goodput.to_dict`)."""
        if not self.dir.is_dir():
            return None
        path = self.dir / "attempts.json"
        data: dict[str, Any] = {"attempts": [a.to_dict() for a in history]}
        if membership:
            data["membership"] = list(membership)
        if goodput is not None:
            data["goodput"] = dict(goodput)
        with contextlib.suppress(Exception):
            write_json_atomic(path, data, indent=1)
            return str(path)
        return None

    def setup(self, failure: dict[str, object]) -> str | None:
        """``attempts.json`` for a run that failed before its first attempt (the nodes never
        agreed): no attempt, and ``setup``, what failed (typed: see the supervisor's
        ``_setup_failure``); its path or None."""
        path = self.dir / "attempts.json"
        with contextlib.suppress(Exception):
            ensure_private_dir(self.dir)
            write_json_atomic(path, {"attempts": [], "setup": failure}, indent=1)
            return str(path)
        return None


def _tail(path: Path, limit: int) -> str:
    with contextlib.suppress(OSError), open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        fh.seek(max(0, fh.tell() - limit))
        return fh.read().decode("utf-8", "replace")
    return ""
