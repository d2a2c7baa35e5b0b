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

Trust (as for checkpoints, `resilient_strategy.machine.files`): ``--evidence-dir`` must be a
directory of this user's own, not writable by group or others (created 0700 when absent; a
shared ``./resilient-strategy-evidence`` of another user's, or a sticky world-writable one, is
refused with one warning and no evidence is written there); the session's directory in it is
created by this run (0700) and never followed as a symlink. What is read from the run directory
(tracebacks, stacks, stderr logs, error records, flight dumps) is read as this user's regular
files only, never through a symlink, never blocking on a FIFO, and bounded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import FileFormatError, NoSpaceError, UnsafePathError
from ..machine import files
from ..records.flight import MAX_DUMP_BYTES
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
        if not self._ready(create=True):
            return None
        try:
            files.write_bytes_atomic(path, ("\n".join(parts) + "\n").encode("utf-8"),
                                     what="the evidence of a failed attempt")
        except Exception:
            return None
        return str(path)

    def _ready(self, *, create: bool) -> bool:
        """Whether the session's evidence directory is safely this user's: ``root`` a private
        directory of ours (created 0700 when absent and ``create``), ``root/session`` a real
        directory of ours (made by this run, never a symlink). A directory that is not is said
        once (a warning naming it and the fix) and nothing is written there."""
        root = self.dir.parent
        try:
            if create:
                files.ensure_private_dir(root, fix=_fix(root))
                with contextlib.suppress(FileExistsError):
                    os.mkdir(self.dir, 0o700)
            elif not os.path.lexists(self.dir):
                return False
            else:
                files.check_private_dir(root, fix=_fix(root))
            files.check_private_dir(self.dir, fix=_fix(self.dir), follow_links=False)
        except UnsafePathError as exc:
            files.warn_once(f"evidence-dir:{exc.path}", f"{exc} No evidence is written there.")
            return False
        except OSError:
            return False
        return True

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
            if not files.is_regular(src):
                continue
            copy = self.error_record(number, r)
            if self._keep(src, copy, files.MAX_REPORT_BYTES):
                out.append(f"rank {r}'s error record: {copy}")
        return out

    def _keep(self, src: Path, copy: Path, max_bytes: int) -> bool:
        """``src`` (a regular file of this user's in the run directory, at most ``max_bytes``)
        copied to ``copy`` in the evidence directory; False when it could not be."""
        try:
            data = files.read_bytes(src, max_bytes=max_bytes)
            if not self._ready(create=True):
                return False
            files.write_bytes_atomic(copy, data, what="the evidence of a failed attempt")
        except (OSError, UnsafePathError, FileFormatError, NoSpaceError):
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
                if self._keep(Path(raw), copy, MAX_DUMP_BYTES):
                    out.append(f"  rank {r.rank}'s raw dump ({api}): {copy}")
        return out

    def summary(self, history: Sequence[Attempt],
                membership: Sequence[Mapping[str, Any]] = (),
                goodput: Mapping[str, Any] | None = None, *, create: bool = False) -> str | None:
        """``attempts.json`` when there was a fault (the directory exists) or ``create`` (a
        measured step to keep: issue 41); its path or None.
        ``membership``: a multi-node run's membership round of each attempt (who was in, who
        left and how it was seen, who joined: `Change`); ``goodput``: the job's productive
        share and its badput by cause (`goodput.Goodput.to_dict`)."""
        if not self._ready(create=create):  # no fault wrote here (or it is not ours)
            return None
        path = self.dir / "attempts.json"
        data: dict[str, Any] = {"attempts": [a.to_dict() for a in history]}
        if membership:
            data["membership"] = list(membership)
        if goodput is not None:
            data["goodput"] = dict(goodput)
        with contextlib.suppress(Exception):
            files.write_json_atomic(path, data, indent=1)
            return str(path)
        return None

    def setup(self, failure: dict[str, object]) -> str | None:
        """``attempts.json`` for a run that failed before its first attempt (the nodes never
        agreed): no attempt, and ``setup``, what failed (typed: see the supervisor's
        ``_setup_failure``); its path or None."""
        path = self.dir / "attempts.json"
        if not self._ready(create=True):
            return None
        with contextlib.suppress(Exception):
            files.write_json_atomic(path, {"attempts": [], "setup": failure}, indent=1)
            return str(path)
        return None


def _fix(where: Path) -> str:
    return (f"Remove or rename {where}, or point --evidence-dir at a directory of your own "
            "(not writable by group or others).")


def _tail(path: Path, limit: int) -> str:
    """The end of a rank's file (`files.read_tail`: a regular file, never through a symlink
    nor blocking on a FIFO); "" when it is absent or not such a file. Its mode is the umask's
    (the worker's traceback and stacks, torch's stderr log: 0664 under umask 002), harmless in
    the run's 0700 directory, so it is not held to the owned files' mode rule."""
    with contextlib.suppress(OSError, UnsafePathError):
        return files.read_tail(path, max_bytes=limit, owned=False).decode("utf-8", "replace")
    return ""
