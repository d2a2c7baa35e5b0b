"""The supervisor's "checkpoint now" to the ranks of one attempt: a file in the attempt's run
directory (``preempt.json``: the signal that asked), written by `run/preempt` when a preemption
signal (SIGUSR1, SIGTERM) reaches ``resilient-strategy run``, looked at by rank 0's
checkpointer at each optimizer step (`frameworks/checkpoint.Checkpointer.micro_step`: one
``lstat``), which then saves once, at that step, and notes the checkpoint (`handoff
.note_checkpoint`) for the supervisor to stop the group at.

Outside ``resilient-strategy run`` (no decision handed to this process) nothing is looked at."""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..errors import NoSpaceError
from ..machine import files
from .handoff import WORKER, WorkerState
from .rundir import RunDir

FILE_NAME = "preempt.json"


def flag(run_dir: str | Path | RunDir) -> Path:
    """Where the supervisor asks the ranks of this attempt to checkpoint now."""
    return RunDir.of(run_dir).root / FILE_NAME


def ask(run_dir: str | Path | RunDir, signum: int) -> bool:
    """Ask the ranks of this attempt to checkpoint at their next optimizer step; False when the
    file could not be written (the stop then comes at the grace's end, without a checkpoint)."""
    try:
        files.write_json_atomic(flag(run_dir), {"signal": signum}, durable=False,
                                what="the preemption request")
    except (OSError, NoSpaceError, ValueError):
        return False
    return True


def asked_here(state: WorkerState | None = None) -> bool:
    """Whether this worker's attempt was asked to checkpoint now (False outside a supervised
    run)."""
    loaded = (state or WORKER).loaded
    if not loaded:
        return False
    decision = next(iter(loaded.values()))
    with contextlib.suppress(OSError, ValueError):
        return files.is_regular(flag(decision.run_dir))
    return False
