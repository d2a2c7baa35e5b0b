"""What the process runner saw of one worker: the plain record between the runner (``probing.proc``)
and the probe parser (``probe``), so that neither depends on the other's types."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerOutcome:
    """What the process runner saw of one worker."""

    rank: int
    returncode: int | None  # None: killed by the runner (deadline or a peer failed)
    signal: int | None = None  # the signal that ended it, when one did
    report: str = ""  # the JSON text the worker wrote ("" when none)
    stderr: str = ""
    #: what the runner kept of its stdout: the lines of NCCL's diagnostics reports (``nccldiag``)
    stdout: str = ""
    killed_by_runner: bool = False
    failed_first: bool = False  # its failure made the runner stop the others
    #: its exit status was taken by another reaper (a SIGCHLD handler of the script's that
    #: waits for every child): how it ended is unknown, which is no verdict on the candidate
    status_lost: bool = False
