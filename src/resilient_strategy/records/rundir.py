"""One attempt's run directory as a value: `RunDir` owns the layout of every file an attempt
of ``resilient-strategy run`` leaves there (the handed decision, each rank's progress, phase
marks, error record, traceback and stacks, the flight recorder's FIFO, status and dumps, the
agent's logs, the checkpoint note). Writers and readers ask it for their paths; nothing else
spells a file name of the run directory. Paths only, nothing is read or written (the one look
at the disk: `stderr_logs` finds the logs torch's agent nested, regular files only)."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

#: How a supervised run's session directory (under TMPDIR) is named: ``rs-run-<pid>-<random>``,
#: with one ``attempt<N>`` directory per attempt inside it.
RUN_PREFIX = "rs-run-"


@dataclass(frozen=True)
class RunDir:
    """The run directory of one attempt (``<session>/attempt<N>``) and its files."""

    root: Path

    @classmethod
    def of(cls, run_dir: str | Path | RunDir) -> RunDir:
        """``run_dir`` as a `RunDir` (a path, or one already)."""
        return run_dir if isinstance(run_dir, RunDir) else cls(Path(run_dir))

    @property
    def decision(self) -> Path:
        """The decision the supervisor hands to this attempt's workers."""
        return self.root / "decision.json"

    @property
    def checkpoint_note(self) -> Path:
        """Where rank 0 notes its last checkpoint (for the relaunch line)."""
        return self.root / CHECKPOINT_NOTE

    @property
    def restore_note(self) -> Path:
        """Where a rank notes the checkpoint step it restored in this attempt (the one proof of
        a resume: the supervisor announces none without it)."""
        return self.root / RESTORE_NOTE

    @property
    def measured_note(self) -> Path:
        """Where rank 0 notes the step it measured and a clearly faster candidate, if any
        (`records.measured`)."""
        return self.root / "measured.json"

    @property
    def supervisor_phases(self) -> Path:
        """The supervisor's phase marks of this attempt."""
        return self.root / "supervisor.phases.json"

    @property
    def logs(self) -> Path:
        """torch's agent's log directory (``<run id>/attempt_0/<local rank>/stderr.log``)."""
        return self.root / "logs"

    def stderr_logs(self, local_rank: int) -> list[Path]:
        """A rank's stderr logs under `logs` (torch's agent nests them by its run id): regular
        files only, looked at without following or opening anything (a FIFO or a symlink
        at that name is not a log: a reader that opened it would block or read elsewhere)."""
        return sorted(p for p in self.logs.glob(f"**/{local_rank}/stderr.log")
                      if _regular(p))

    def solo_stderr_log(self) -> Path:
        """The stderr log of a one-process attempt started without torch's agent (`run/solo`),
        where `stderr_logs` finds it."""
        return self.logs / "0" / "stderr.log"

    def rank_file(self, local_rank: int, kind: str) -> Path:
        """A local rank's file of ``kind`` (a key of `RANK_FILES`)."""
        return self.root / f"rank{local_rank}.{RANK_FILES[kind]}"

    def progress(self, local_rank: int) -> Path:
        """A rank's progress records (`records/progress`)."""
        return self.rank_file(local_rank, "progress")

    def phases(self, local_rank: int) -> Path:
        """A rank's phase marks (`records/phases`)."""
        return self.rank_file(local_rank, "phases")

    def pid(self, local_rank: int) -> Path:
        """Which process a rank's worker is (`records.handoff.write_pid`; read by
        `run.warm.rank_pids`)."""
        return self.rank_file(local_rank, "pid")

    def error(self, local_rank: int) -> Path:
        """A rank's error record (its exception, typed), written as it raises."""
        return self.rank_file(local_rank, "error")

    def traceback(self, local_rank: int) -> Path:
        """A rank's full traceback, kept for the evidence."""
        return self.rank_file(local_rank, "traceback")

    def stacks(self, local_rank: int) -> Path:
        """A rank's Python stacks, written by faulthandler on SIGUSR1 before a stop."""
        return self.rank_file(local_rank, "stacks")

    def flight_fifo(self, local_rank: int) -> Path:
        """Where the supervisor knocks for a rank's flight-recorder dump (`records/flight`)."""
        return self.rank_file(local_rank, "flight_fifo")

    def flight_status(self, local_rank: int) -> Path:
        """A rank's answer to that knock (written last)."""
        return self.rank_file(local_rank, "flight_status")

    def flight_dump(self, local_rank: int, api: str) -> Path:
        """A rank's flight-recorder dump by torch's ``api`` (pickle bytes, never unpickled)."""
        return self.root / f"rank{local_rank}.flight{api}.pkl"


#: The name of each per-rank file of a run directory, after ``rank<N>.``.
RANK_FILES = {
    "progress": "progress", "phases": "phases.json", "error": "error.json", "pid": "pid",
    "traceback": "traceback.txt", "stacks": "stacks.txt", "flight_fifo": "flight.fifo",
    "flight_status": "flight.json",
}

#: The checkpoint note's name in a run directory (the supervisor finds the newest one).
CHECKPOINT_NOTE = "checkpoint.json"
#: The restore note's name in a run directory (`RunDir.restore_note`).
RESTORE_NOTE = "restored.json"


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
