"""``RESILIENT_STRATEGY_TRAIN_FAULT=<hang|exit|error>:<rank>:<backend>:<step>``: rehearse a mid-run
failure on CPU.

The named rank, when training on that backend, stalls in the collective of that optimizer step
("hang", as a hung NCCL all-reduce), exits there with status 1 ("exit", as a process that drops
out) or raises a communication error there ("error"). Step numbers count optimizer steps from 1
across relaunches; the fault fires while the step's gradients are being reduced (the backward of
its last micro-step). Like probe faults, a rehearsed failure never reaches the decision cache.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import InvalidOptionError

FAULT_VAR = "RESILIENT_STRATEGY_TRAIN_FAULT"
KINDS = ("hang", "exit", "error")


class RehearsedCommunicationError(RuntimeError):
    """The "error" fault: what a backend's failed collective raises (a DistBackendError is a
    RuntimeError too); the supervisor classifies it as a communication error."""


@dataclass(frozen=True)
class TrainFault:
    kind: str
    rank: int
    backend: str
    step: int

    def applies(self, rank: int, backend: str) -> bool:
        return rank == self.rank and backend == self.backend

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
    if len(parts) != 4 or parts[0] not in KINDS or not parts[2]:
        raise InvalidOptionError(
            f"{FAULT_VAR} must be <hang|exit|error>:<rank>:<backend>:<step>, not {text!r}")
    try:
        rank, step = int(parts[1]), int(parts[3])
    except ValueError:
        raise InvalidOptionError(f"{FAULT_VAR}: rank and step must be integers: {text!r}") from None
    if rank < 0 or step < 1:
        raise InvalidOptionError(f"{FAULT_VAR}: rank >= 0 and step >= 1, not {text!r}")
    return TrainFault(parts[0], rank, parts[2], step)


def fault_from(env: Mapping[str, str]) -> TrainFault | None:
    return parse_fault(env.get(FAULT_VAR, ""))
