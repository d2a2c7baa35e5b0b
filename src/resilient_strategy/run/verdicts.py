"""What happened to one attempt, judged from its exits, error records and last progress (pure):
:func:`classify_attempt` turns a stall and the ranks' exits into a :class:`Verdict`.
"""

from __future__ import annotations

import logging
import re
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..records.progress import (
    COLLECTIVE,
    STEP_DONE,
    Record,
    Stall,
)

if TYPE_CHECKING:
    pass

log = logging.getLogger("resilient_strategy")


_COMM_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError",
               "RehearsedCommunicationError")
_OOM_TYPES = ("OutOfMemoryError", "ResourceExhaustedError", "MemoryError")
_COMM_TEXT = re.compile(
    r"NCCL|nccl|[Gg]loo|Connection (closed|reset) by peer|ProcessGroup|c10d|"
    r"Watchdog caught collective|collective operation timeout|CUDA error|illegal memory access|"
    r"Broken pipe|unhandled system error")
_OOM_TEXT = re.compile(r"out of memory|OOM when allocating", re.IGNORECASE)


def classify_error(types: Sequence[str], message: str) -> str:
    """"oom", "comm", "exit" (SystemExit) or "user" for an exception's MRO names and message."""
    names = {t.rsplit(".", 1)[-1] for t in types}
    if names & set(_OOM_TYPES) or _OOM_TEXT.search(message):
        return "oom"
    if names & set(_COMM_TYPES):
        return "comm"
    if "SystemExit" in names:
        return "exit"
    if names & {"RuntimeError", "OSError", "ConnectionError"} and _COMM_TEXT.search(message):
        return "comm"
    return "user"


@dataclass(frozen=True)
class RankExit:
    """What one failed worker left behind."""

    rank: int  # local rank
    exitcode: int  # negative: killed by that signal
    error: Mapping[str, Any] | None = None  # its error record (handoff.write_error)
    record: Record | None = None  # its last progress report
    stderr_tail: str = ""

    @property
    def error_kind(self) -> str | None:
        if self.error is None:
            return None
        return classify_error(list(self.error.get("types", ())), str(self.error.get("message", "")))

    def describe(self) -> str:
        if self.error is not None:
            types = list(self.error.get("types", ()))
            name = types[0].rsplit(".", 1)[-1] if types else "error"
            what = f"{name}: {self.error.get('message', '')}".strip()
        elif self.exitcode < 0:
            what = f"killed by signal {-self.exitcode}"
        else:
            what = f"exited with status {self.exitcode} without a Python exception"
        where = "" if self.record is None else f" ({_position(self.record)})"
        return f"rank {self.rank}{where}: {one_line(what)}"


@dataclass(frozen=True)
class Verdict:
    """What an attempt came to."""

    kind: str  # "ok", "backend", "diverged", "oom", "user", "crash"
    summary: str
    step: int = 0
    cause: str = ""  # a probe cause key, for the cache record of a backend fault
    node: int | None = None  # another node's record this node stopped for (multi-node)

    @property
    def retry(self) -> bool:
        return self.kind == "backend"


def _position(record: Record) -> str:
    if record.phase in (COLLECTIVE, "collective_done"):
        return f"{record.phase.replace('_', ' ')} of step {record.k}"
    if record.phase == STEP_DONE:
        return f"after step {record.k}"
    return record.phase.replace("_", " ")


def step_in_progress(records: Sequence[Record | None]) -> int:
    """The optimizer step the ranks had reached (a collective's number is its step's)."""
    return max((r.k for r in records if r is not None), default=0)


def classify_attempt(stall: Stall | None, exits: Sequence[RankExit]) -> Verdict:
    """The verdict on one attempt from its stall (if the watcher declared one) and the exits of
    its failed workers (none: it succeeded). Pure.

    A stall inside communicator setup or one collective (every rank entered it, some never
    left) is a backend fault; ranks that never arrived where the others wait ("straggler")
    diverged: the application's problem."""
    if stall is not None:
        if stall.kind in ("collective", "setup"):
            return Verdict("backend", f"stalled: {stall.describe()}", stall.k, "timeout")
        return Verdict("diverged", f"the ranks diverged: {stall.describe()}. The program did not "
                       "run the same collectives on every rank (another backend would not help)",
                       stall.k)
    if not exits:
        return Verdict("ok", "finished")
    step = step_in_progress([e.record for e in exits])
    text = "; ".join(e.describe() for e in exits)
    kinds = [e.error_kind for e in exits]
    if "oom" in kinds:
        return Verdict("oom", f"out of memory: {text}", step)
    if "user" in kinds or "exit" in kinds:
        return Verdict("user", f"the script failed: {text}", step)
    if "comm" in kinds:
        cause = "nccl_error" if any("nccl" in str((e.error or {}).get("message", "")).lower()
                                    for e in exits) else "crash"
        return Verdict("backend", f"a communication error: {text}", step, cause)
    # a rank killed from outside (SIGKILL without a word: the OOM killer, a preemption, an
    # operator) leaves its peers waiting at their next collective wherever it was itself; on
    # another node they see a communication error, and the verdicts must agree
    in_collective = [e for e in exits if (e.record is not None and e.record.phase == COLLECTIVE)
                     or (e.error is None and e.exitcode == -signal.SIGKILL)]
    comm_tail = [e for e in exits if _COMM_TEXT.search(e.stderr_tail)]
    if in_collective or comm_tail:
        return Verdict("backend", f"a rank left in the middle of a collective: {text}", step,
                       "crash")
    return Verdict("crash", f"a worker crashed outside any collective: {text}", step)


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
