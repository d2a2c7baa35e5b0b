"""``RESILIENT_STRATEGY_TRAIN_FAULT=<hang|exit|error>:<rank>:<backend>:<step>[:<launches>]``:
rehearse a mid-run failure on CPU, under ``resilient-strategy run`` only.

The named rank, when training on that backend, stalls in the collective of that optimizer step
("hang", as a hung NCCL all-reduce), exits there with status 1 ("exit", as a process that drops
out) or raises a communication error there ("error"). Step numbers count optimizer steps from 1
across relaunches; the fault fires while the step's gradients are being reduced (the backward of
its last micro-step). With ``<launches>`` it fires only in the first that many launch attempts
of the run (``exit:0:cpu:20:1``: a transient exit, gone after the retry); without, in every
one. Like probe faults, a rehearsed failure never reaches the decision cache.

The text is validated whole (kind, rank, a backend of `resilient_strategy.vocab.BACKENDS`,
step, launches): a typo is a one-line error, never a rehearsal that silently never fires.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import InvalidOptionError
from ..vocab import BACKENDS

FAULT_VAR = "RESILIENT_STRATEGY_TRAIN_FAULT"
KINDS = ("hang", "exit", "error")
_FORM = "<hang|exit|error>:<rank>:<backend>:<step>[:<launches>]"


class RehearsedCommunicationError(RuntimeError):
    """The "error" fault: what a backend's failed collective raises (a DistBackendError is a
    RuntimeError too); the supervisor classifies it as a communication error."""


@dataclass(frozen=True)
class TrainFault:
    kind: str
    rank: int
    backend: str
    step: int
    launches: int | None = None  # fires in the first N launch attempts only (None: every one)

    def applies(self, rank: int, backend: str, attempt: int = 0) -> bool:
        """On this rank and backend, in launch attempt ``attempt`` (0 for the first)."""
        return (rank == self.rank and backend == self.backend
                and (self.launches is None or attempt < self.launches))

    def act(self) -> None:
        """Do it (called on the named rank at the named step)."""
        where = f"{FAULT_VAR}: rank {self.rank} on {self.backend} at step {self.step}"
        if self.kind == "hang":
            print(f"{where}: hangs", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)
        if self.kind == "exit":
            print(f"{where}: exits with status 1", file=sys.stderr, flush=True)
            os._exit(1)
        raise RehearsedCommunicationError(
            f"{where}: rehearsed communication error (a collective failed)")


def parse_fault(text: str) -> TrainFault | None:
    """The fault ``text`` describes; None for an empty text. Raises InvalidOptionError."""
    text = text.strip()
    if not text:
        return None
    parts = text.split(":")
    if len(parts) not in (4, 5) or parts[0] not in KINDS:
        raise InvalidOptionError(f"{FAULT_VAR} must be {_FORM} (a kind of {', '.join(KINDS)}), "
                                 f"not {text!r}", FAULT_VAR)
    if parts[2] not in BACKENDS:
        raise InvalidOptionError(f"{FAULT_VAR}: {parts[2]!r} is not a backend (one of "
                                 f"{', '.join(BACKENDS)}): {text!r}", FAULT_VAR)
    try:
        rank, step = int(parts[1]), int(parts[3])
        launches = int(parts[4]) if len(parts) == 5 else None
    except ValueError:
        raise InvalidOptionError(f"{FAULT_VAR}: rank, step and launches must be integers: "
                                 f"{text!r}", FAULT_VAR) from None
    if rank < 0 or step < 1 or (launches is not None and launches < 1):
        raise InvalidOptionError(f"{FAULT_VAR}: rank >= 0, step >= 1 and launches >= 1, not "
                                 f"{text!r}", FAULT_VAR)
    return TrainFault(parts[0], rank, parts[2], step, launches)


def check_rank(fault: TrainFault | None, ranks: int) -> None:
    """Refuse a fault on a rank the job does not have (``ranks``: the ranks of its widest
    attempt, 0 to ``ranks - 1``): it would never fire, and the rehearsal would report a clean
    run. Raises InvalidOptionError (one line)."""
    if fault is not None and fault.rank >= ranks:
        have = "rank 0" if ranks == 1 else f"ranks 0-{ranks - 1}"
        raise InvalidOptionError(f"{FAULT_VAR}: rank {fault.rank} is not a rank of this job "
                                 f"(it has {have})", FAULT_VAR)


def fault_from(env: Mapping[str, str]) -> TrainFault | None:
    return parse_fault(env.get(FAULT_VAR, ""))
