"""``RESILIENT_STRATEGY_PROBE_FAULT``: a rehearsed probe failure, validated where it is read
(`parse_probe_fault`, pure) and injected by the probe workers (``probing/workers/common.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import InvalidOptionError
from ...vocab import BACKENDS

#: The variable that injects a fault into probe workers (``probing/workers/common.py``).
PROBE_FAULT_VAR = "RESILIENT_STRATEGY_PROBE_FAULT"
#: ``hang``: sleep before the first collective; ``hang_setup``: inside communicator setup;
#: ``hang_rendezvous``: inside the torch probe's store rendezvous; ``hang_collective``: inside
#: collective 1; ``hang_broadcast`` / ``hang_gather``: inside the torch probe's first broadcast /
#: all-gather; ``exit``: exit 1 without a report; ``wrong`` / ``nan`` / ``zero``: corrupt the
#: all-reduce; ``wrong_broadcast`` / ``wrong_gather``: a wrong value in what a torch probe's
#: broadcast / all-gather returned.
PROBE_FAULTS = ("hang", "hang_setup", "hang_rendezvous", "hang_collective", "hang_broadcast",
                "hang_gather", "exit", "wrong", "nan", "zero", "wrong_broadcast",
                "wrong_gather")
_PROBE_FAULT_FORM = "<kind>:<rank>[:<backend>[:plain|>=BYTES]]"


@dataclass(frozen=True)
class ProbeFault:
    """A parsed ``RESILIENT_STRATEGY_PROBE_FAULT``: ``kind`` (one of `PROBE_FAULTS`) on
    ``rank``, for probes of ``backend`` only (""; every probe), narrowed by ``where``: "plain"
    (only a worker that sets no remedy variable) or ``min_bytes`` (a data fault corrupts only
    all-reduces of at least that many bytes)."""

    kind: str
    rank: int
    backend: str = ""
    where: str = ""
    min_bytes: int | None = None


def parse_probe_fault(text: str) -> ProbeFault | None:
    """The fault ``text`` describes (None for an empty text). Pure.

    Raises InvalidOptionError, one line naming the variable, what is wrong and what is allowed:
    an unknown kind (``explode:1``), a rank that is not a number, a backend that is not one
    (``exit:1:glooo``), or a qualifier other than ``plain`` / ``>=BYTES``. A typo is refused
    rather than turned into a rehearsal that injects nothing and reports a passing probe."""
    text = text.strip()
    if not text:
        return None
    parts = text.split(":")

    def bad(why: str) -> InvalidOptionError:
        return InvalidOptionError(f"{PROBE_FAULT_VAR}={text!r}: {why}; expected "
                                  f"{_PROBE_FAULT_FORM}", PROBE_FAULT_VAR)

    if len(parts) < 2 or len(parts) > 4:
        raise bad(f"{len(parts)} field(s)")
    kind, rank_text = parts[0], parts[1]
    if kind not in PROBE_FAULTS:
        raise bad(f"{kind!r} is not a fault (one of {', '.join(PROBE_FAULTS)})")
    if not rank_text.isdigit():
        raise bad(f"rank {rank_text!r} is not a number >= 0")
    backend = parts[2] if len(parts) > 2 else ""
    if backend and backend not in BACKENDS:
        raise bad(f"{backend!r} is not a backend (one of {', '.join(BACKENDS)})")
    where = parts[3] if len(parts) > 3 else ""
    min_bytes = None
    if where.startswith(">=") and where[2:].isdigit():
        min_bytes = int(where[2:])
    elif where not in ("", "plain"):
        raise bad(f"{where!r} is neither 'plain' nor '>=BYTES'")
    return ProbeFault(kind, int(rank_text), backend, where, min_bytes)
