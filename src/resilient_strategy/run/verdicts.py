"""What happened to one attempt, judged from its exits, error records and last progress (pure):
`classify_attempt` turns a stall and the ranks' exits into a `Verdict`, whose typed
`VerdictKind` the relaunch policy (`resilient_strategy.run.policy`) acts on.

Only a communication error pins a fault on the backend (`VerdictKind.BACKEND`): the
process group's own error type, a failure raised in a distributed frame, or a communication
signature raised inside the step's marked all-reduce, read from the class chain and frames a
rank's error record carries (`blame`); an exception raised in the script's own code is
the script's whatever its text, and so is a device-side assert anywhere. A stall, a rank that
exited without a word, or a node that vanished may be transient (`Verdict.transient`);
diverged ranks, an exception in the user's code and an out-of-memory are the script's
(`Verdict.users`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from ..core.knowledge.causes import CAUSES, LAUNCH_CAUSES, SCRIPT_CAUSES
from ..core.knowledge.signatures import Signatures, builtin_signatures
from ..core.measures.probe import names_the_error, telling_line
from ..core.values.human import compose, fit
from ..records.flightdump import FlightFacts
from ..records.progress import (
    COLLECTIVE,
    FINISHED,
    PHASES,
    STEP_DONE,
    Record,
    Stall,
)

log = logging.getLogger("resilient_strategy")


_COMM_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError",
               "RehearsedCommunicationError")
_OOM_TYPES = ("OutOfMemoryError", "ResourceExhaustedError", "MemoryError")
_COMM_TEXT = re.compile(
    r"NCCL|nccl|[Gg]loo|Connection (closed|reset) by peer|ProcessGroup|c10d|"
    r"Watchdog caught collective|collective operation timeout|CUDA error|illegal memory access|"
    r"Broken pipe|unhandled system error")
_OOM_TEXT = re.compile(r"out of memory|OOM when allocating", re.IGNORECASE)
#: A communication-error signature in what a dying rank printed last (stricter than
#: `_COMM_TEXT`: a rank's output names its backend in ordinary lines too, e.g. its explain()).
_TAIL_SIGNATURE = re.compile(
    r"NCCL (error|WARN)|nccl\w*Error|ProcessGroupNCCL|Watchdog caught collective|"
    r"collective operation timeout|Connection (closed|reset) by peer|gloo/transport|CUDA error|"
    r"illegal memory access|Dist(Backend|Network|Store)Error|unhandled system error")
#: How much of a dying rank's output end is searched for a signature.
TAIL_SIGNATURE_BYTES = 4096


#: Placed causes that are the GPU's memory running out: NCCL's own allocations too (mid-run they
#: compete with the training's tensors; before a run they are checked and retried once)
_OOM_CAUSES = frozenset({"oom", "nccl_oom", "host_memory"})


#: The most characters of a failing rank's own line quoted in a verdict (`RankExit.what`).
QUOTE_CHARS = 100


def _signal_name(number: int) -> str:
    """``SIGSEGV`` for 11 ("" for no signal of this platform)."""
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return ""


def _said_comm(tail: str) -> bool:
    return bool(_TAIL_SIGNATURE.search(tail[-TAIL_SIGNATURE_BYTES:]))


def classify_error(types: Sequence[str], message: str,
                   signatures: Signatures | None = None) -> str:
    """"oom", "comm", "exit" (SystemExit) or "user" for an exception's MRO names and message
    alone, for a record that says nothing of where it was raised (`blame` reads one that
    does). The message is placed through the signature table (``core/knowledge/signatures.toml``, the one
    the probe parser reads; the built-in table when ``signatures`` is None)."""
    names = {t.rsplit(".", 1)[-1] for t in types}
    placed = (signatures or builtin_signatures()).classify(message)
    # a placed cause first: an NVLS failure quotes "out of memory" and is not one
    if names & set(_OOM_TYPES) or placed in _OOM_CAUSES or (
            placed == "worker_error" and _OOM_TEXT.search(message)):
        return "oom"
    if placed in _MACHINE_STORAGE:
        return _MACHINE_STORAGE[placed]
    if placed in SCRIPT_CAUSES:
        return "user"
    if names & set(_COMM_TYPES):
        return "comm"
    if "SystemExit" in names:
        return "exit"
    if names & {"RuntimeError", "OSError", "ConnectionError"} and (
            placed != "worker_error" or _COMM_TEXT.search(message)):
        return "comm"
    return "user"


@dataclass(frozen=True)
class Frame:
    """One frame an exception was raised through, as the worker recorded it."""

    module: str
    function: str = ""
    file: str = ""
    line: int = 0
    distributed: bool = False  # the worker's reading of the built-in table
    library: bool = False  # installed code (stdlib, site-packages, this package), not the script

    def where(self) -> str:
        return f"{self.file.rsplit('/', 1)[-1]}:{self.line} in {self.function}"


@dataclass(frozen=True)
class Raised:
    """One exception of a chain: its class's MRO names, its message, its frames (outermost
    first: the last one is where it was raised)."""

    types: tuple[str, ...]
    message: str = ""
    frames: tuple[Frame, ...] = ()
    errno: int = 0  # an OSError's number (0: none recorded)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.rsplit(".", 1)[-1] for t in self.types)

    def script_frame(self) -> Frame | None:
        """The innermost frame of the script's own code (not installed code), if any."""
        return next((f for f in reversed(self.frames) if not f.library), None)

    def raised_in_distributed(self, signatures: Signatures) -> bool:
        """Whether the frame that raised it is the distributed runtime's (by the table)."""
        return bool(self.frames) and (self.frames[-1].distributed
                                      or signatures.blame.distributed(self.frames[-1].module))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Raised:
        frames = []
        for f in d.get("frames", ()) or ():
            if isinstance(f, Mapping):
                frames.append(Frame(str(f.get("module", "")), str(f.get("function", "")),
                                    str(f.get("file", "")), int(f.get("line", 0) or 0),
                                    bool(f.get("distributed", False)),
                                    bool(f.get("library", False))))
        number = d.get("errno")
        return cls(tuple(str(t) for t in d.get("types", ()) or ()), str(d.get("message", "")),
                   tuple(frames), number if isinstance(number, int) else 0)


def error_chain(error: Mapping[str, Any]) -> tuple[Raised, ...] | None:
    """The class chain of an error record (the exception first, then its causes), or None for
    a record that does not say where it was raised."""
    chain = error.get("chain")
    if not isinstance(chain, list) or not chain:
        return None
    try:
        return tuple(Raised.from_dict(d) for d in chain if isinstance(d, Mapping)) or None
    except (TypeError, ValueError):
        return None


#: Why a rank's error was judged as it was (`blame`), the word written to records.
BLAME_OOM = "out_of_memory"
BLAME_EXIT = "exit_status"
BLAME_SCRIPT_TEXT = "script_fault_text"  # a device-side assert, a bad address in its kernels
BLAME_PROCESS_GROUP = "process_group_error"  # the process group's own error type
BLAME_DISTRIBUTED = "distributed_frame"  # raised in a frame of the distributed runtime
BLAME_COLLECTIVE = "collective_region"  # raised in the marked all-reduce of a step, said so
BLAME_SCRIPT = "script_code"  # raised in the script's own code, outside any collective
BLAME_TEXT = "text_only"  # a record that says nothing of where: its type and text decide
BLAME_NO_SPACE = "no_space"  # a full disk (ENOSPC, EDQUOT, a NoSpaceError): the machine's
#: the machine's storage failed (EIO, ESTALE, EROFS, the storage_error signature)
BLAME_STORAGE = "storage"
BLAME_GPU = "gpu_fault"  # the GPU itself failed (ECC, NVLink, fallen off the bus): the machine's
#: The numbers of an OSError that say the disk (or the quota) is full: ENOSPC, EDQUOT.
_FULL_DISK_ERRNOS = frozenset({28, 122})
#: The numbers of an OSError that say the storage itself failed: EIO, EROFS, ESTALE.
_STORAGE_ERRNOS = frozenset({5, 30, 116})
#: The placed causes of the machine's storage, and the kind of error `blame` gives each.
_MACHINE_STORAGE = {"no_space": "no_space", "storage_error": "storage"}
#: The types a distributed frame raises when a peer or a link fails (a process group's error is
#: a RuntimeError; a socket's an OSError; TensorFlow's an OpError). A ValueError or TypeError
#: from torch.distributed is a call the script got wrong.
_FAILURE_TYPES = frozenset({"RuntimeError", "OSError", "OpError"})
#: The process group's own error states (torch's ``ErrorType``, ``Backend.get_error()``) that
#: make an exception raised while it holds one a communication error.
_PG_ERRORS = frozenset({"COMM_ERROR", "REMOTE_ERROR", "TIMEOUT"})
#: The process group's own words for a failed or timed-out collective: an exception carrying
#: them is a communication error wherever it surfaced (torch raises the watchdog's abort as a
#: plain RuntimeError at the script's next CUDA sync, in the script's own frame).
_PG_WORDS = re.compile(r"NCCL communicator was aborted|Watchdog caught collective operation "
                       r"timeout|Process group watchdog thread terminated|ncclRemoteError|"
                       r"ncclSystemError|ncclInternalError")


@dataclass(frozen=True)
class Blame:
    """A rank's error judged: its kind ("oom", "comm", "exit", "user") and why (``BLAME_*``),
    with where it was raised (a frame in words, empty when unknown)."""

    kind: str
    why: str
    at: str = ""


def blame(error: Mapping[str, Any], signatures: Signatures | None = None) -> Blame:
    """Whose fault a rank's error record is (pure). Where it was raised decides before its
    text: a device-side assert is the script's anywhere, a bad address outside a distributed
    frame; the process group's own error type or error state (``pg_error``), or a failure type (`_FAILURE_TYPES`)
    raised in a distributed frame (``[[distributed_frame]]`` in ``signatures.toml``) of any
    exception of the chain, is a communication error; so is a failure type with a
    communication text raised while the rank was inside the marked all-reduce of a step (DDP's
    reducer raises through autograd, in no distributed frame); anything else raised in the
    script's code is the script's, whatever its text. A record without a chain is judged by its
    type and text alone (`classify_error`)."""
    table = signatures or builtin_signatures()
    chain = error_chain(error)
    types = [str(t) for t in error.get("types", ()) or ()]
    message = str(error.get("message", ""))
    if chain is None:
        return Blame(classify_error(types, message, table), BLAME_TEXT)
    top = chain[0]
    mine = top.script_frame() or (top.frames[-1] if top.frames else None)
    at = "" if mine is None else mine.where()
    names = frozenset().union(*(r.names for r in chain))
    text = "\n".join(r.message for r in chain) or message
    placed = table.classify(text)
    if names & set(_OOM_TYPES) or placed in _OOM_CAUSES or (
            placed == "worker_error" and _OOM_TEXT.search(text)):
        return Blame("oom", BLAME_OOM, at)
    if placed == "no_space" or any(r.errno in _FULL_DISK_ERRNOS or "NoSpaceError" in r.names
                                   for r in chain):
        return Blame("no_space", BLAME_NO_SPACE, at)  # the machine's disk, wherever raised
    if placed == "storage_error" or any(r.errno in _STORAGE_ERRNOS for r in chain):
        return Blame("storage", BLAME_STORAGE, at)  # the machine's storage, wherever raised
    # the machine's GPU, wherever raised; unless the process group was in an error state when
    # it was raised (an aborted communicator makes the next CUDA sync an "unspecified launch
    # failure")
    if placed == "gpu_fault" and str(error.get("pg_error") or "") not in _PG_ERRORS:
        return Blame("gpu", BLAME_GPU, at)
    in_distributed = [r for r in chain if r.raised_in_distributed(table)]
    if table.blame.script_fault(text, bool(in_distributed)) is not None:
        return Blame("user", BLAME_SCRIPT_TEXT, at)
    if names & set(_COMM_TYPES) or str(error.get("pg_error") or "") in _PG_ERRORS or (
            top.names & _FAILURE_TYPES and _PG_WORDS.search(text)):
        return Blame("comm", BLAME_PROCESS_GROUP, at)
    if "SystemExit" in top.names:
        return Blame("exit", BLAME_EXIT, at)
    failed = next((r for r in in_distributed if r.names & _FAILURE_TYPES), None)
    if failed is not None:
        return Blame("comm", BLAME_DISTRIBUTED, failed.frames[-1].where())
    if (error.get("in_collective") and top.names & _FAILURE_TYPES
            and _TAIL_SIGNATURE.search(text)):
        return Blame("comm", BLAME_COLLECTIVE, at)
    return Blame("user", BLAME_SCRIPT, at)


def error_cause(exits: Sequence[RankExit], signatures: Signatures | None = None) -> str:
    """The cause the signature table places on the first failed rank's error or output ("" when
    it places none): what the planner's remedies key on after a mid-run fault."""
    table = signatures or builtin_signatures()
    for e in exits:
        for text in (str((e.error or {}).get("message", "")), e.stderr_tail):
            placed = table.classify(text)
            if placed != "worker_error":
                return placed
    return ""


class VerdictKind(Enum):
    """What an attempt came to. The value is the word written to records and reports."""

    OK = "ok"
    #: A communication-error signature (a rank raised one, or printed one as it died): the
    #: backend's fault. Steps down at once (except for a one-device job: no backend to blame).
    BACKEND = "backend"
    #: Every rank entered one collective (or communicator setup) and some never left: retried
    #: once on the same strategy, stepped down on a repeat.
    STALL = "stall"
    #: A rank exited, or was killed, without a communication-error signature: retried once.
    EXIT = "exit"
    #: Another node's supervisor vanished (multi-node): retried once.
    LOST = "lost"
    #: This node cannot reach the job's store (multi-node): it stops (exit 75) and the others
    #: go on without it; another node's cut-off is a lost node there.
    CUT_OFF = "cut_off"
    #: A node asked to join the running job (multi-node, ``--nnodes N`` or ``MIN:MAX`` with
    #: fewer nodes present): node 0 stopped the attempt to relaunch across the larger group
    #: from the last checkpoint. Not a fault.
    JOIN = "join"
    #: The ranks did not run the same collectives: the program's fault.
    DIVERGED = "diverged"
    #: Out of memory: the program's (its batch or model).
    OOM = "oom"
    #: An exception in the user's code.
    USER = "user"
    #: The launch's fault, not a strategy's: a rendezvous port already held, a store that cannot
    #: be reached, a name that does not resolve, a library that breaks ``import torch``, CUDA
    #: initialised too early (`core.knowledge.causes.LAUNCH_CAUSES`, placed by the signature
    #: table). Every strategy would meet it: never stepped down, never cached; the run stops
    #: with the configuration's exit code.
    LAUNCH = "launch"
    #: No fault: the supervisor stopped a healthy attempt at a checkpoint to try a candidate
    #: measured clearly faster, or to go back from a trial measured slower (issue 41;
    #: `run.policy.switch_due`). Never stepped down, never cached.
    SWITCH = "switch"

    @classmethod
    def parse(cls, word: str) -> VerdictKind:
        try:
            return cls(word)
        except ValueError:
            raise ValueError(f"not a verdict kind: {word!r} (one of "
                             f"{', '.join(k.value for k in cls)})") from None


#: What the supervisor saw first of a fault (`Verdict.seen`): a rank's error record (it
#: raised; written before any barrier or teardown), a worker's exit, the stall watch, another
#: node's fault record.
SEEN_ERROR_RECORD = "error_record"
SEEN_EXIT = "exit"
SEEN_STALL = "stall"
SEEN_PEER = "peer"

_RAISED_IN = {BLAME_SCRIPT: " in the script's own code", BLAME_DISTRIBUTED: " in a distributed "
              "frame", BLAME_COLLECTIVE: " inside the step's all-reduce"}

_TRANSIENT = frozenset({VerdictKind.STALL, VerdictKind.EXIT, VerdictKind.LOST})
_USERS = frozenset({VerdictKind.DIVERGED, VerdictKind.OOM, VerdictKind.USER})


@dataclass(frozen=True)
class RankExit:
    """What one failed worker left behind."""

    rank: int  # local rank
    exitcode: int  # negative: killed by that signal
    error: Mapping[str, Any] | None = None  # its error record (handoff.write_error)
    record: Record | None = None  # its last progress report
    stderr_tail: str = ""

    @property
    def blamed(self) -> Blame | None:
        return None if self.error is None else blame(self.error)

    @property
    def error_kind(self) -> str | None:
        judged = self.blamed
        return None if judged is None else judged.kind

    def what(self, first_line: bool = False) -> str:
        """The rank's error in words: its exception (``first_line``: only the message's first
        line and NCCL's "Last error:" line, what a short line quotes), or how it ended and the
        most telling line it printed."""
        if self.error is not None:
            types = list(self.error.get("types", ()))
            name = types[0].rsplit(".", 1)[-1] if types else "error"
            message = str(self.error.get("message", ""))
            return one_line(f"{name}: {_lead(message) if first_line else message}".strip())
        # no exception recorded: the most telling line it printed, quoted (`telling_line`:
        # NCCL's WARN, a traceback's last line; for a signal, only such a line), else the line
        # the signature table placed (a CUDA error in a C++ abort, a framework's log line)
        tail = self.stderr_tail[-TAIL_SIGNATURE_BYTES:]
        said = telling_line(tail, QUOTE_CHARS) if tail.strip() else ""
        telling = names_the_error(said)
        if not telling and (placed := placed_line(tail, QUOTE_CHARS)):
            said, telling = placed, True
        if self.exitcode < 0:
            name = _signal_name(-self.exitcode)
            return (f"killed by signal {-self.exitcode}{f' ({name})' if name else ''}"
                    + (f': "{said}"' if said and telling else ""))
        return (f"exited with status {self.exitcode} without a Python exception"
                + (f': "{said}"' if said else ""))

    def where(self) -> str:
        """Where the rank was (its progress), and where its error was raised."""
        parts = [] if self.record is None else [position(self.record)]
        judged = self.blamed
        if judged is not None and judged.at:
            parts.append(f"raised at {judged.at}" + _RAISED_IN.get(judged.why, ""))
        return ", ".join(parts)

    def describe(self) -> str:
        where = self.where()
        return f"rank {self.rank}{f' ({where})' if where else ''}: {self.what()}"


@dataclass(frozen=True)
class Verdict:
    """What an attempt came to: its kind, the ranks it names, where they were, in words."""

    kind: VerdictKind
    summary: str
    step: int = 0
    cause: str = ""  # a probe cause key, for the cache record of a backend fault
    node: int | None = None  # another node's record this node stopped for (multi-node)
    ranks: tuple[int, ...] = ()
    where: str = ""
    #: What torch's flight recorder said before a stalled group was stopped (None: not asked).
    flight: FlightFacts | None = None
    #: The cause in a few words for the fault's one line (`fault_line`): the first
    #: failed rank's error without its type and noise, or how long a stall waited ("": the
    #: line falls back to the summary).
    detail: str = ""
    #: Why a rank's error was judged so (a ``BLAME_*`` word of `blame`; empty: no error).
    blame: str = ""
    #: What the supervisor saw first of the fault (a ``SEEN_*`` word; empty: not said).
    seen: str = ""
    #: Seconds from the fault to the verdict where the supervisor knows them (a stall: how long
    #: the others waited); None: seen within the monitor's interval (an exit, an error record).
    detect_s: float | None = None
    #: A launch fault's port holders where ``/proc`` shows them (`machine.ports`): their pids
    #: (0: a process of another user, not visible here).
    held_by: tuple[int, ...] = ()
    #: A stall's kind (`records.progress.Stall.kind`: ``collective``, ``straggler``,
    #: ``setup``, ``quiet``, ``stopped``, ``busy``, ``asleep``); empty for any other verdict.
    stall: str = ""
    #: Where the named ranks were (`records.progress.PHASES`: ``collective``, ``comm_setup``,
    #: ``step_done``, ...), from their last progress record; "" when none said.
    phase: str = ""
    #: The scheduler's name of the node whose verdict this is, as that node sent it (SLURM's
    #: ``SLURMD_NODENAME``; `NODE_NAME`); "" where unknown or one node. A requeue excludes it when
    #: the fault was that node's (`run/loop.ending_of`).
    host: str = ""

    @property
    def ok(self) -> bool:
        return self.kind is VerdictKind.OK

    @property
    def pinned(self) -> bool:
        """The backend's fault by its signature."""
        return self.kind is VerdictKind.BACKEND

    @property
    def transient(self) -> bool:
        """A fault that may not come back: retried once on the same strategy."""
        return self.kind in _TRANSIENT

    @property
    def users(self) -> bool:
        """The script's fault: never relaunched."""
        return self.kind in _USERS

    @property
    def relaunchable(self) -> bool:
        return self.pinned or self.transient

    def line(self, limit: int = 300) -> str:
        """One line of at most ``limit`` characters: the kind, the ranks, where, the cause.

        When torch's flight recorder names ranks that never entered the stuck collective, the
        line names the ranks as the recorder does ("entered by ... never by ...") instead of
        calling every rank of the stall stuck."""
        stuck = self.flight.stuck if self.flight is not None else None
        if self.kind is VerdictKind.STALL and stuck is not None and stuck.missing:
            head = f"{self.kind.value}{f' ({self.where})' if self.where else ''}: "
            return fit(head + f"{stuck.line()} (flight recorder)", limit)
        s = "s" if len(self.ranks) > 1 else ""
        ranks = f"rank{s} {', '.join(map(str, self.ranks))}" if self.ranks else ""
        context = ", ".join(p for p in (ranks, self.where) if p)
        head = f"{self.kind.value}{f' ({context})' if context else ''}: "
        flight = f"flight recorder: {self.flight.line()}" if self.flight else ""
        return compose([quiet(self.summary), flight], limit, head=head)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "summary": one_line(self.summary, 500),
                "step": self.step, "cause": self.cause, "node": self.node,
                "ranks": list(self.ranks), "where": self.where, "detail": self.detail,
                "blame": self.blame, "seen": self.seen, "detect_s": self.detect_s,
                "held_by": list(self.held_by),
                "stall": self.stall, "phase": self.phase,
                **({"host": self.host} if self.host else {}),
                **({"flight": self.flight.to_dict()} if self.flight is not None else {})}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Verdict:
        """Raises ValueError for a record that is not what `to_dict` writes."""
        try:
            node = d.get("node")
            return cls(kind=VerdictKind.parse(str(d["kind"])), summary=str(d.get("summary", "")),
                       step=int(d.get("step", 0) or 0), cause=str(d.get("cause", "") or ""),
                       node=None if node is None else int(node),
                       ranks=tuple(int(r) for r in d.get("ranks", ())),
                       where=str(d.get("where", "")), detail=str(d.get("detail", "") or ""),
                       flight=None if d.get("flight") is None
                       else FlightFacts.from_dict(d["flight"]),
                       blame=str(d.get("blame", "") or ""), seen=str(d.get("seen", "") or ""),
                       detect_s=None if d.get("detect_s") is None else float(d["detect_s"]),
                       held_by=tuple(int(p) for p in d.get("held_by", ()) or ()),
                       stall=str(d.get("stall", "") or ""),
                       phase=str(d.get("phase", "") or ""), host=str(d.get("host", "") or ""))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a verdict record: {exc}") from None

    def checked(self) -> Verdict:
        """This verdict as another process sent it (a peer's fault record in the job's store):
        ValueError unless its cause is a known cause and its words are known words, each
        text one bounded line; the same verdict when it is."""
        if self.cause not in CAUSES:
            raise ValueError(f"cause {fit(quiet(self.cause), 60)!r} is not a known cause")
        if (self.blame not in _BLAME_WORDS or self.seen not in _SEEN_WORDS
                or self.stall not in STALL_KINDS or self.phase not in _PHASE_WORDS):
            raise ValueError("a blame or a 'seen' word that is no word of a verdict")
        if self.step < 0 or any(r < 0 for r in self.ranks) or len(self.ranks) > 1 << 16:
            raise ValueError("a step or a rank that is none")
        if self.host and not NODE_NAME.fullmatch(self.host):
            raise ValueError("a node name that is no node name")
        return replace(self, summary=fit(quiet(self.summary), 500),
                       where=fit(quiet(self.where), 300), detail=fit(quiet(self.detail), 500))


#: What a node's name may be, as a scheduler writes it (it goes into ``ExcNodeList``): a host
#: name's letters, digits, dots, dashes and underscores, at most 255.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_BLAME_WORDS = frozenset({"", BLAME_OOM, BLAME_EXIT, BLAME_SCRIPT_TEXT, BLAME_PROCESS_GROUP,
                          BLAME_DISTRIBUTED, BLAME_COLLECTIVE, BLAME_SCRIPT, BLAME_TEXT,
                          BLAME_NO_SPACE, BLAME_STORAGE, BLAME_GPU})
_PHASE_WORDS = frozenset({"", *PHASES})
_SEEN_WORDS = frozenset({"", SEEN_ERROR_RECORD, SEEN_EXIT, SEEN_STALL, SEEN_PEER})
#: Every word `Verdict.stall` may hold ("": not a stall).
STALL_KINDS = frozenset({"", "setup", "collective", "straggler", "quiet", "stopped", "busy",
                         "asleep"})


@dataclass(frozen=True)
class PeerFault:
    """A node's verdict on an attempt, as the nodes' supervisors exchange it through the store
    (`resilient_strategy.nodes.store.record_fault`)."""

    node: int
    candidate: str
    verdict: Verdict = field(default_factory=lambda: Verdict(VerdictKind.LOST, ""))

    def to_dict(self) -> dict[str, Any]:
        return {**self.verdict.to_dict(), "candidate": self.candidate, "node": self.node}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PeerFault:
        """Raises ValueError for a record that is not what `to_dict` writes."""
        verdict = Verdict.from_dict(d).checked()
        if verdict.node is None:
            raise ValueError("a peer's fault record names no node")
        return cls(node=verdict.node, candidate=str(d.get("candidate", "")), verdict=verdict)

    def as_seen_here(self) -> Verdict:
        """This node's verdict when it stopped for this record: the peer's kind, its node named."""
        v = self.verdict
        return Verdict(v.kind, f"node {self.node}: {v.summary}", v.step,
                       v.cause or ("crash" if v.relaunchable else ""), node=self.node,
                       ranks=v.ranks, where=f"node {self.node}" + (f", {v.where}" if v.where
                                                                    else ""), detail=v.detail,
                       stall=v.stall, phase=v.phase, host=v.host)


def position(record: Record) -> str:
    if record.phase in (COLLECTIVE, "collective_done"):
        return f"{record.phase.replace('_', ' ')} of step {record.k}"
    if record.phase == STEP_DONE:
        return f"after step {record.k}"
    return record.phase.replace("_", " ")


def step_in_progress(records: Sequence[Record | None]) -> int:
    """The optimizer step the ranks had reached (a collective's number is its step's)."""
    return max((r.k for r in records if r is not None), default=0)


def unfinished(records: Sequence[Record | None]) -> tuple[int, ...]:
    """The local ranks whose progress record does not say "finished" (a rank without a record
    reported nothing to judge by: its exit status is all there is). Pure."""
    return tuple(r for r, rec in enumerate(records) if rec is not None and rec.phase != FINISHED)


def classify_attempt(stall: Stall | None, exits: Sequence[RankExit],
                     records: Sequence[Record | None] = ()) -> Verdict:
    """The verdict on one attempt from its stall (if the watcher declared one), the exits of
    its failed workers (none: every worker exited 0) and every rank's last progress record.
    Pure.

    Every stall is a `STALL` naming the ranks that hold the others up
    (inside communicator setup or one collective every rank entered, never arrived where the
    others wait, stopped, or busy past the ceiling); diverged is only proven from the ranks'
    own collectives (`diverged`). The attempt finished
    (`OK`) only when every rank exited 0 and every rank that reported
    progress wrote "finished" after its last step; a rank that exited 0 without it stopped
    early (an `EXIT`, never a success)."""
    if stall is not None:
        # A rank that never arrived where the others wait is held up (stopped, hung, asleep,
        # busy past the ceiling), not proven in another collective: a stall naming it.
        # Diverged needs the ranks' own collectives to differ (`diverged`).
        waited = (f"{stall.kind} {stall.waited_s:.0f} s, nobody waiting on it (allowed "
                  f"{stall.limit_s:.0f} s)" if stall.alone
                  else f"waited {stall.waited_s:.0f} s (allowed {stall.limit_s:.0f} s)")
        return Verdict(VerdictKind.STALL, f"stalled: {stall.describe()}", stall.k, "timeout",
                       ranks=stall.ranks, where=stall.where(), detail=waited,
                       detect_s=stall.waited_s, stall=stall.kind, phase=stall.phase)
    if not exits:
        early = unfinished(records)
        if not early:
            return Verdict(VerdictKind.OK, "finished")
        said = [f"rank {r} ({position(rec)})" for r in early
                 if (rec := records[r]) is not None]
        return Verdict(VerdictKind.EXIT, "the workers exited 0 before finishing: "
                       + ", ".join(said) + " never wrote \"finished\"",
                       step_in_progress([records[r] for r in early]), "crash", ranks=early,
                       where=next((position(rec) for r in early
                                   if (rec := records[r]) is not None), ""))
    verdict = _classify_exits(exits)
    named = [e for e in exits if e.rank in verdict.ranks] or list(exits)
    return replace(verdict, detail=error_words(named[0].what(first_line=True)),
                   phase=next((e.record.phase for e in named if e.record is not None), ""))


def launch_cause(exits: Sequence[RankExit], signatures: Signatures | None = None) -> str:
    """The launch cause (`LAUNCH_CAUSES`) the signature table places on a failed rank's error
    (its chain's messages) or on the end of its output ("": none). Pure."""
    table = signatures or builtin_signatures()
    for e in exits:
        error = e.error or {}
        chain = error_chain(error) or ()
        texts = ("\n".join([str(error.get("message", "")), *(r.message for r in chain)]),
                 e.stderr_tail[-TAIL_SIGNATURE_BYTES:])
        for text in texts:
            placed = table.classify(text) if text.strip() else ""
            if placed in LAUNCH_CAUSES:
                return placed
    return ""


def _classify_exits(exits: Sequence[RankExit]) -> Verdict:
    step = step_in_progress([e.record for e in exits])
    text = describe_exits(exits)
    # a rank that left no error record but printed a memory signature (torch's "DataLoader
    # worker (pid N) is killed by signal: Killed", the OOM killer's SIGKILL) ran out of memory
    kinds = [e.error_kind or {**dict.fromkeys(_OOM_CAUSES, "oom"), "gpu_fault": "gpu"}.get(
        _tail_cause(e)) for e in exits]
    # the launch's fault first: a port held, a store unreachable, a library that breaks the
    # import follow the job to every strategy, whoever raised them
    launch = launch_cause(exits)
    if launch:
        table = builtin_signatures()
        hit = [e for e in exits if launch_cause([e], table) == launch]
        return Verdict(VerdictKind.LAUNCH, f"a launch fault: {text}", step, launch,
                       ranks=tuple(e.rank for e in hit),
                       where=next((e.where() for e in hit if e.where()), ""),
                       blame=next((b.why for e in hit if (b := e.blamed) is not None), ""))

    def blamed(*which: str | None) -> tuple[tuple[int, ...], str]:
        named = [e for e, k in zip(exits, kinds, strict=True) if k in which] or list(exits)
        return tuple(e.rank for e in named), next((e.where() for e in named if e.where()), "")

    def why(*which: str) -> str:
        return next((b.why for e in exits if (b := e.blamed) is not None and b.kind in which),
                    "")

    if "no_space" in kinds:  # the machine's disk: no step-down, no blame on the script
        ranks, where = blamed("no_space")
        return Verdict(VerdictKind.EXIT, f"a disk is full: {text}", step, "no_space",
                       ranks=ranks, where=where, blame=BLAME_NO_SPACE)
    if "storage" in kinds:  # the machine's storage: retried once, never a step-down
        ranks, where = blamed("storage")
        return Verdict(VerdictKind.EXIT, f"the storage failed: {text}", step, "storage_error",
                       ranks=ranks, where=where, blame=BLAME_STORAGE)
    if "gpu" in kinds:  # the machine's GPU: retried once, never a backend's nor the script's
        ranks, where = blamed("gpu")
        return Verdict(VerdictKind.EXIT, f"a GPU failed: {text}", step, "gpu_fault",
                       ranks=ranks, where=where, blame=BLAME_GPU)
    if "oom" in kinds:
        ranks, where = blamed("oom")
        placed = error_cause([e for e in exits if e.rank in ranks])
        return Verdict(VerdictKind.OOM, f"out of memory: {text}", step,
                       placed if placed in _OOM_CAUSES else "", ranks=ranks, where=where,
                       blame=why("oom") or BLAME_OOM)
    if "user" in kinds or "exit" in kinds:
        ranks, where = blamed("user", "exit")
        return Verdict(VerdictKind.USER, f"the script failed: {text}", step,
                       _script_cause([e for e in exits if e.rank in ranks]), ranks=ranks,
                       where=where, blame=why("user", "exit"))
    # a rank that died printing a device-side assert (NCCL's watchdog may abort it before
    # Python records the exception): the script's kernel, whatever else it printed
    asserted = [e for e in exits if e.error is None and builtin_signatures().blame.script_fault(
        e.stderr_tail[-TAIL_SIGNATURE_BYTES:], True) is not None]
    if asserted:
        return Verdict(VerdictKind.USER, f"the script failed: {text}", step,
                       _script_cause(asserted), ranks=tuple(e.rank for e in asserted),
                       where=next((e.where() for e in asserted if e.where()), ""),
                       blame=BLAME_SCRIPT_TEXT)
    # a rank that vanished (no exception, no signature in its output) is the root cause: the
    # others' "connection closed by peer" is what its leaving did to them
    vanished = [e for e, k in zip(exits, kinds, strict=True)
                if k is None and not _said_comm(e.stderr_tail)]
    if vanished:
        in_collective = any(e.record is not None and e.record.phase == COLLECTIVE
                            for e in vanished)
        return Verdict(VerdictKind.EXIT, (f"a rank left in the middle of a collective: {text}"
                                          if in_collective
                                          else f"a worker ended outside any collective: {text}"),
                       step, "crash", ranks=tuple(e.rank for e in vanished),
                       where=next((e.where() for e in vanished if e.where()), ""))
    if "comm" in kinds:
        ranks, where = blamed("comm")
        cause = error_cause(exits) or ("nccl_error" if any(
            "nccl" in str((e.error or {}).get("message", "")).lower() for e in exits) else "crash")
        return Verdict(VerdictKind.BACKEND, f"a communication error: {text}", step, cause,
                       ranks=ranks, where=where, blame=why("comm"))
    ranks, where = blamed(None)
    return Verdict(VerdictKind.BACKEND, f"a rank died with a communication error in its "
                   f"output: {text}", step, error_cause(exits) or "crash", ranks=ranks,
                   where=where)


def _script_cause(exits: Sequence[RankExit]) -> str:
    """The script's own cause (`SCRIPT_CAUSES`: a CUDA graph capture) the signature table
    places on these ranks' errors or output, "" for none: the verdict names its workaround."""
    table = builtin_signatures()
    for e in exits:
        error = e.error or {}
        for text in (str(error.get("message", "")), *(r.message for r in error_chain(error) or ()),
                     e.stderr_tail[-TAIL_SIGNATURE_BYTES:]):
            placed = table.classify(text) if text.strip() else ""
            if placed in SCRIPT_CAUSES:
                return placed
    return ""


_LAST_ERROR = re.compile(r"^\s*Last error:\s*\n\s*(\S.*)$", re.M)


def _lead(message: str) -> str:
    """An exception's message as a short line quotes it: its first line, and NCCL's "Last
    error:" line (the one naming the culprit) where it has one. Pure."""
    first = next((ln.strip() for ln in message.splitlines() if ln.strip()), "")
    last = _LAST_ERROR.search(message)
    return f"{first} (last error: {last.group(1).strip()})" if last else first


#: A log line's bracketed prefixes ("[rank5]:[E207 19:37:09.98 ProcessGroupNCCL.cpp:681] [Rank 5]
#: "), and a C++ source location in parentheses ("(insert_events at .../Allocator.cpp:764)").
_LOG_PREFIX = re.compile(r"^(?:\[[^\]]*\]:?\s*)+")
_SOURCE_PAREN = re.compile(r"\s*\([^()]*\.(?:cc|cpp|h|hpp|cu):\d+\)")


def placed_line(text: str, limit: int = QUOTE_CHARS) -> str:
    """The clause of ``text`` where the signature table placed its cause (its line from the
    last ": " before the match to the first "; " after it, without log prefixes and C++ source
    locations), at most ``limit`` characters at a word; "" where the table places nothing.
    Pure."""
    found = builtin_signatures().match(text)
    m = found.pattern.search(text) if found is not None and found.pattern is not None else None
    if m is None:
        return ""
    start = text.rfind("\n", 0, m.start()) + 1
    end = text.find("\n", m.start())
    line = text[start:end if end >= 0 else len(text)]
    at = m.start() - start
    clause = line.rfind(": ", 0, at)
    stop = line.find("; ", m.end() - start)
    quoted = line[clause + 2 if clause >= 0 else 0:stop if stop >= 0 else len(line)]
    quoted = " ".join(_SOURCE_PAREN.sub("", _LOG_PREFIX.sub("", quoted.strip())).split())
    if len(quoted) <= limit:
        return quoted
    cut = quoted[: limit - 3]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut) + "..."


def _tail_cause(e: RankExit) -> str:
    """The cause the signature table places on the end of a rank's output when it left no
    error record ("": it left one, or said nothing placed)."""
    tail = e.stderr_tail[-TAIL_SIGNATURE_BYTES:]
    if e.error is not None or not tail.strip():
        return ""
    placed = builtin_signatures().classify(tail)
    return "" if placed == "worker_error" else placed


#: What torch says of a DataLoader worker killed by SIGKILL, and of one that vanished (the
#: OOM killer's victim seen by the loader's queue before its SIGCHLD handler).
_KILLED = re.compile(r"killed by signal: Killed|DataLoader worker \(pid\(s\) [\d, ]+\) exited "
                     "unexpectedly")


def memory_killed(verdict: Verdict, exits: Sequence[RankExit], oom_kills: int) -> Verdict:
    """``verdict`` when the kernel's OOM killer killed ``oom_kills`` processes of the job's
    memory cgroup during the attempt (its ``oom_kill`` counter rose: `machine.procs.oom_kills`):
    a rank killed by SIGKILL, or one whose DataLoader worker was (torch says "killed by signal:
    Killed"), ran out of the host's memory, whatever else the ranks printed (an OOM verdict,
    cause ``host_memory``). Unchanged without a kill, for any other verdict, or when no rank was
    so killed. Pure."""
    if oom_kills <= 0 or verdict.kind not in (VerdictKind.EXIT, VerdictKind.USER,
                                              VerdictKind.BACKEND, VerdictKind.OOM):
        return verdict
    killed = [e for e in exits if e.exitcode == -9 or _KILLED.search(" ".join(
        [str((e.error or {}).get("message", "")),
         *(r.message for r in error_chain(e.error or {}) or ()),
         e.stderr_tail[-TAIL_SIGNATURE_BYTES:]]))]
    if not killed:
        return verdict
    s = "es" if oom_kills > 1 else ""
    return Verdict(VerdictKind.OOM, f"out of memory: the kernel's OOM killer killed {oom_kills} "
                   f"process{s} of this job's memory cgroup: {describe_exits(killed)}",
                   verdict.step, "host_memory", ranks=tuple(e.rank for e in killed),
                   where=next((e.where() for e in killed if e.where()), verdict.where),
                   detail=f"the kernel's OOM killer killed {oom_kills} process{s}",
                   blame=BLAME_OOM, seen=verdict.seen)


def diverged(stalled: Verdict, proof: str) -> Verdict:
    """The verdict on a stalled attempt whose ranks are proven to be in different collectives
    (``proof``: the flight recorder's words, `records.flightdump.divergence`): the program's
    fault, never relaunched."""
    return Verdict(VerdictKind.DIVERGED, f"the ranks diverged: {proof}. The program did not "
                   "run the same collectives on every rank (another backend would not help)",
                   stalled.step, ranks=stalled.ranks, where=stalled.where, flight=stalled.flight)


def merge(faults: Sequence[PeerFault]) -> Verdict | None:
    """One verdict for an attempt from every node's (pure, the same on every node given the
    same records): the script's fault first, then a rank or node that vanished (the root cause
    of its peers' connection errors), then a node asking to join (the nodes stop their workers
    for it: a connection error or a wait that follows on another node is its consequence), then
    a stall, then a backend's signature; the lowest node among equals. None for no record."""
    order = {VerdictKind.USER: 0, VerdictKind.OOM: 0, VerdictKind.DIVERGED: 0,
             VerdictKind.LAUNCH: 0,
             VerdictKind.EXIT: 1, VerdictKind.LOST: 1, VerdictKind.CUT_OFF: 1,
             VerdictKind.JOIN: 2, VerdictKind.SWITCH: 2, VerdictKind.STALL: 3,
             VerdictKind.BACKEND: 4, VerdictKind.OK: 5}
    ranked = sorted(faults, key=lambda f: (order[f.verdict.kind], f.node))
    if not ranked:
        return None
    first = ranked[0]
    v = first.verdict
    return Verdict(v.kind, v.summary if v.node is not None else f"node {first.node}: {v.summary}",
                   v.step, v.cause, node=first.node, ranks=v.ranks, where=v.where,
                   detail=v.detail, blame=v.blame, seen=v.seen, detect_s=v.detect_s,
                   stall=v.stall, phase=v.phase, host=v.host)


def one_line(text: str, limit: int = 300) -> str:
    return fit(text, limit)


#: What the frameworks print that says nothing about the cause: gloo's sign-off ("GLHF!" and
#: its emoji), C++ source locations ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534]"),
#: and any other character outside printable ASCII. Removed from a fault's line (the evidence
#: file keeps every rank's words as they were).
_NOISE = re.compile(r"GLHF!?|\[[^\]\s]*\.(?:cc|cpp|h|hpp|cu):\d+\]|[^\x20-\x7e]")


def quiet(text: str) -> str:
    """``text`` without `_NOISE`, on one line, with a clause said again right after
    itself (each rank repeating the same error) said once. Pure."""
    clauses = [" ".join(c.split()) for c in _NOISE.sub(" ", text).split(";")]
    out: list[str] = []
    for c in clauses:
        if c and (not out or c != out[-1]):
            out.append(c)
    return "; ".join(out)


def describe_exits(exits: Sequence[RankExit]) -> str:
    """The failed ranks in words, ranks that failed the same way at the same place named
    together ("ranks 0, 1 (collective of step 3): DistBackendError: ...") so that one error
    every rank raised is said once. Pure."""
    groups: dict[tuple[str, str], tuple[str, list[int]]] = {}
    for e in exits:  # alike but for numbers (each rank's peer port): the first one's words
        what = quiet(e.what())
        groups.setdefault((e.where(), re.sub(r"\d+", "#", what)), (what, []))[1].append(e.rank)
    parts = []
    for (where, _), (what, ranks) in groups.items():
        who = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
        parts.append(f"{who}{f' ({where})' if where else ''}: {what}")
    return "; ".join(parts)


#: The most characters of a fault's line (`fault_line`), its prefix included.
FAULT_CHARS = 200
#: Each verdict kind in the words of a fault's line.
KIND_WORDS = {
    VerdictKind.OK: "finished", VerdictKind.BACKEND: "communication error",
    VerdictKind.STALL: "stall", VerdictKind.EXIT: "a rank exited", VerdictKind.LOST: "node lost",
    VerdictKind.CUT_OFF: "cut off from the job's store", VerdictKind.DIVERGED: "ranks diverged",
    VerdictKind.OOM: "out of memory", VerdictKind.USER: "the script's error",
    VerdictKind.JOIN: "a node asked to join", VerdictKind.LAUNCH: "launch fault",
    VerdictKind.SWITCH: "stopped at a checkpoint for a measured switch",
}
_ERROR_TYPE = re.compile(r"^(?:[\w.]*(?:Error|Exception)|Traceback[^:]*): ")
#: A peer's address in an error ("[127.0.0.1]:34978"): the evidence keeps it.
_PEER_ADDRESS = re.compile(r"\s*\[[0-9a-fA-F.:]+\]:\d+")
#: Where in torch's sources an error was raised ("NCCL error in: .../NCCLUtils.hpp:268, "): the
#: evidence keeps it.
_SOURCE_AT = re.compile(r" in: \S+\.(?:cc|cpp|h|hpp|cu):\d+,")


def error_words(what: str) -> str:
    """A rank's error in a few words: `quiet`, without the exception's type (unless that
    is all there is) or the peer's address, up to the end of its first sentence. Pure."""
    text = _SOURCE_AT.sub(":", _PEER_ADDRESS.sub("", quiet(what)))
    bare = _ERROR_TYPE.sub("", text, count=1)
    text = bare or text
    end = re.search(r"[.!?](?:\s|$)", text)
    return text[: end.start()] if end and end.start() >= 12 else text


def _ranks_words(ranks: Sequence[int]) -> str:
    if not ranks:
        return ""
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def fault_line(attempt: int, backend: str, verdict: Verdict, evidence: str,
               prefix: str = "", limit: int = FAULT_CHARS) -> str:
    """The one line a failed attempt prints, at most ``limit`` characters with ``prefix``
    (what the caller prints before it): the attempt, its backend and step, what happened on
    which ranks, the cause in a few words ([Verdict.detail][resilient_strategy.run.verdicts.Verdict.detail],
    cut to fit) and the path of its evidence (never cut). A stall that torch's flight recorder
    saw names the ranks as the recorder does: those that entered the collective, and those that
    never did. Pure."""
    ended = "stopped to take a node back" if verdict.kind is VerdictKind.JOIN else "failed"
    head = f"{prefix}attempt {attempt + 1} on {backend} {ended} at step {verdict.step}: "
    tail = f"; evidence: {evidence}"
    stuck = verdict.flight.stuck if verdict.flight is not None else None
    if verdict.kind is VerdictKind.STALL and stuck is not None and stuck.missing:
        what = [f"stall in {stuck.op} #{stuck.seq} of group {stuck.group}: entered by "
                f"{_ranks_words(stuck.entered)}, never by {_ranks_words(stuck.missing)} "
                "(flight recorder)", verdict.detail]
        sep = "; "
    else:
        on = _ranks_words(verdict.ranks)
        what = [f"{KIND_WORDS[verdict.kind]}{f' on {on}' if on else ''}",
                verdict.detail or quiet(verdict.summary)]
        sep = ": "
    if limit - len(head) - len(tail) < 40:  # a long backend name: it gives way (the decision
        head = f"{prefix}attempt {attempt + 1} {ended} at step {verdict.step}: "  # names it)
    # whole parts of what happened, never a cut word; never without the evidence (the rest)
    return compose(what, limit, head=head, sep=sep, tail=tail)
