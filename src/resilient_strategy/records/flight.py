"""torch's flight recorder, asked for before a stalled group is stopped: each worker's dump
crosses to the supervisor as a file, and :func:`analyse` (pure) turns the dumps into typed facts:
the collective that never completed, its operation, the ranks that entered it and the ranks that
never did.

The recorder keeps a ring buffer of every collective a process group issued (operation, process
group, ``collective_seq_id``, state, sizes, the Python stack that issued it); sources:

- pytorch/pytorch#110960 (torch 2.2): ``torch._C._distributed_c10d._dump_nccl_trace()``
  returns the buffer as a pickle; each entry's state is "scheduled", "started" or "completed"
  (queried from its CUDA events when the dump is taken, which works while the streams are
  stuck). Enabled by ``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0 (docs:
  https://pytorch.org/docs/2.4/torch_nccl_environment_variables.html).
- pytorch/pytorch#117883 and #120262: the pickle was first a list of entries, then a dict with
  ``version``, ``pg_config`` (each group's ranks) and ``entries``; ``pg_status`` (each group's
  ``last_completed_collective``) follows (torch/csrc/distributed/c10d/FlightRecorder.hpp).
- pytorch/pytorch#129505 (torch 2.5): the keyword arguments ``includeCollectives``,
  ``includeStackTraces``, ``onlyActive``; the defaults return everything.
- pytorch/pytorch#152563 (torch 2.8): the recorder made vendor neutral
  (``TORCH_FR_BUFFER_SIZE``, read before the NCCL name); ``_dump_fr_trace()`` dumps the generic
  recorder (gloo's entries, on by default with 2,000 entries in torch 2.13), while NCCL keeps its
  own recorder behind ``_dump_nccl_trace()`` (both are asked here; a CPU build has only the
  first).
- https://docs.pytorch.org/tutorials/prototype/flight_recorder_tutorial.html: retrieving the
  buffer on demand through that API.

How it is asked for: the main thread of a stalled rank is blocked inside a collective, so no
Python signal handler would run there. :func:`serve` starts a daemon thread in the worker that
waits (blocked in ``open``, no polling) on a FIFO in the attempt's run directory; the supervisor
(:func:`request`) writes one byte to each rank's FIFO, and the thread calls every dump API the
build has, writes the bytes next to it and a status file last. The supervisor waits for the
status files up to a deadline; a rank without a listener, without an answer, or whose torch has
no dump API is a typed :class:`DumpStatus`, never a hang. Every private API is feature-checked
and its failure is logged and said in the status.

The dumps are read with an unpickler that refuses every global (torch's pickler writes plain
dicts, lists, tuples, strings and numbers), at most :data:`MAX_DUMP_BYTES` each.

Imports nothing but the standard library (torch only in the worker, only when it is already
imported there).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

log = logging.getLogger("resilient_strategy")

#: The buffer's size variable for NCCL (torch 2.2+), set for the workers of an NCCL decision
#: unless the user set it or :data:`FR_BUFFER_VAR`.
BUFFER_VAR = "TORCH_NCCL_TRACE_BUFFER_SIZE"
#: torch 2.8+'s vendor-neutral name (read first by torch): a user's value is kept.
FR_BUFFER_VAR = "TORCH_FR_BUFFER_SIZE"
#: Entries kept per process (torch 2.13's default for its generic recorder).
DEFAULT_ENTRIES = 2000
#: The dump APIs asked, in order (each its own recorder; absent ones are skipped).
DUMP_APIS = ("_dump_nccl_trace", "_dump_fr_trace")
#: How long the supervisor waits for every rank's answer.
WAIT_S = 5.0
#: The largest dump read (2,000 entries with their stacks are a few MB).
MAX_DUMP_BYTES = 64 << 20
#: How many entries of each rank around the stuck collective the evidence file shows.
SHOWN = 6
#: Frames of these places are the tools', not the user's: ``where`` names the first other one.
_TOOL_PATHS = ("/torch/", "/site-packages/", "/dist-packages/", "/resilient_strategy/",
               "<frozen", "/lightning/", "/accelerate/")


def buffer_env(backend: str, env: Mapping[str, str]) -> dict[str, str]:
    """The variable that turns NCCL's recorder on for the workers of a decision on ``backend``:
    only for NCCL, never over the user's (either name)."""
    if backend != "nccl" or BUFFER_VAR in env or FR_BUFFER_VAR in env:
        return {}
    return {BUFFER_VAR: str(DEFAULT_ENTRIES)}


def fifo_path(run_dir: str | Path, local_rank: int) -> Path:
    return Path(run_dir) / f"rank{local_rank}.flight.fifo"


def status_path(run_dir: str | Path, local_rank: int) -> Path:
    return Path(run_dir) / f"rank{local_rank}.flight.json"


def dump_path(run_dir: str | Path, local_rank: int, api: str) -> Path:
    return Path(run_dir) / f"rank{local_rank}.flight{api}.pkl"


# ----- the worker's side ----------------------------------------------------------------------


def serve(run_dir: str | Path, local_rank: int, rank: int, c10d: Any = None) -> bool:
    """Start the daemon thread that answers the supervisor's request (:func:`request`) with
    :func:`respond` (``c10d`` as there). False where no FIFO can be made (then the supervisor
    reads "no listener")."""
    path = fifo_path(run_dir, local_rank)
    mkfifo = getattr(os, "mkfifo", None)
    if mkfifo is None:
        return False
    try:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a relaunch's run directory is new; this is for a rerun by hand
        mkfifo(path, 0o600)
        # read and write: the open never blocks, and the FIFO has a reader for as long as this
        # process lives (the supervisor's knock fails at once only when the worker is gone)
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        log.debug("flight recorder: no FIFO at %s: %s", path, exc)
        return False
    threading.Thread(target=_listen, args=(fd, Path(run_dir), local_rank, rank, c10d),
                     name="rs-flight-recorder", daemon=True).start()
    return True


def _listen(fd: int, run_dir: Path, local_rank: int, rank: int, c10d: Any) -> None:
    while True:
        try:
            if not os.read(fd, 64):  # blocks (without the GIL) until the supervisor knocks
                return
        except OSError:
            return
        respond(run_dir, local_rank, rank, c10d)


def respond(run_dir: str | Path, local_rank: int, rank: int, c10d: Any = None) -> dict[str, Any]:
    """Dump this process's flight recorder through every API the build has, each to
    :func:`dump_path`, then write :func:`status_path` (last: the supervisor waits for it).
    ``c10d``: the module holding the APIs (``torch._C._distributed_c10d``; a test passes its
    own). Never raises; returns the status written."""
    status: dict[str, Any] = {"rank": rank, "local_rank": local_rank, "apis": [],
                              "reasons": []}
    if c10d is None:
        if "torch" not in sys.modules:  # a TensorFlow worker, or torch not imported yet
            status["reasons"].append("torch is not imported in this worker")
        else:
            try:
                from torch._C import _distributed_c10d as c10d
            except Exception as exc:  # a build without distributed
                status["reasons"].append(f"no torch._C._distributed_c10d ({exc})")
    if c10d is not None:
        for api in DUMP_APIS:
            fn = getattr(c10d, api, None)
            if not callable(fn):
                continue
            try:
                data = fn()  # everything: collectives, their stacks, completed ones too
                if not isinstance(data, (bytes, bytearray)):
                    raise TypeError(f"returned {type(data).__name__}, not bytes")
                _write_atomic(dump_path(run_dir, local_rank, api), bytes(data))
                status["apis"].append(api)
            except Exception as exc:
                log.warning("flight recorder: %s failed: %s", api, exc)
                status["reasons"].append(f"{api} failed: {type(exc).__name__}: {exc}"[:300])
        if not status["apis"] and not status["reasons"]:
            status["reasons"].append(f"this torch has none of {', '.join(DUMP_APIS)}")
    with contextlib.suppress(OSError, TypeError, ValueError):
        _write_atomic(status_path(run_dir, local_rank), json.dumps(status).encode())
    return status


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


# ----- the supervisor's side ------------------------------------------------------------------


class DumpStatus(Enum):
    """What became of one rank's dump. The value is the word written to records."""

    DUMPED = "dumped"
    #: The worker answered: its torch has no dump API, or the API failed, or torch was absent.
    NOT_AVAILABLE = "not_available"
    #: No worker was listening (it never started one, or it is gone).
    NO_LISTENER = "no_listener"
    #: Asked, but no answer before the deadline.
    NO_ANSWER = "no_answer"
    #: An answer that could not be read as a dump.
    UNREADABLE = "unreadable"


@dataclass(frozen=True)
class Entry:
    """One collective in a rank's recorder."""

    group: str  # the process group's name ("0" for the default group)
    seq: int  # collective_seq_id: the same number for the same collective on every rank
    op: str  # profiling_name, e.g. "nccl:all_reduce"
    state: str  # "scheduled", "started" or "completed"
    p2p: bool = False
    sizes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    frames: tuple[str, ...] = ()  # "file:line in name", innermost first
    created_ns: int = 0


@dataclass(frozen=True)
class Dump:
    """One rank's recorder, parsed."""

    entries: tuple[Entry, ...] = ()
    completed: Mapping[str, int] = field(default_factory=dict)  # group -> last completed seq
    members: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # group -> its ranks
    version: str = ""


@dataclass(frozen=True)
class RankDump:
    """One rank's answer."""

    local_rank: int
    rank: int
    status: DumpStatus
    reason: str = ""
    dump: Dump | None = None
    files: tuple[str, ...] = ()  # the raw dumps, for torch's own analyzer
    recorded: int = 0  # entries, as a record read back says (the dump itself is not kept)

    @property
    def entries(self) -> int:
        return self.recorded if self.dump is None else len(self.dump.entries)

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "local_rank": self.local_rank, "status": self.status.value,
                "reason": self.reason, "entries": self.entries}


@dataclass(frozen=True)
class StuckCollective:
    """The collective that never completed: the first one some rank still waits in."""

    group: str
    seq: int
    op: str
    entered: tuple[int, ...]  # ranks (dumped here) that issued it
    missing: tuple[int, ...]  # ranks (dumped here) that never issued it
    not_dumped: tuple[int, ...] = ()  # members of the group with no dump here (another node)
    sizes: tuple[tuple[int, ...], ...] = ()
    where: str = ""  # the user's frame that issued it, on the first rank that entered it

    def line(self) -> str:
        what = f"{self.op} #{self.seq} of group {self.group}"
        if self.missing:
            text = (f"{what}: entered by {_ranks(self.entered)}, never by "
                    f"{_ranks(self.missing)}")
        else:
            text = f"{what}: entered by {_ranks(self.entered)}, never completed"
        if self.not_dumped:
            text += f" ({_ranks(self.not_dumped)} not dumped here)"
        return text + (f", issued at {self.where}" if self.where else "")

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "seq": self.seq, "op": self.op,
                "entered": list(self.entered), "missing": list(self.missing),
                "not_dumped": list(self.not_dumped), "sizes": [list(s) for s in self.sizes],
                "where": self.where}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StuckCollective:
        return cls(group=str(d["group"]), seq=int(d["seq"]), op=str(d["op"]),
                   entered=tuple(int(r) for r in d.get("entered", ())),
                   missing=tuple(int(r) for r in d.get("missing", ())),
                   not_dumped=tuple(int(r) for r in d.get("not_dumped", ())),
                   sizes=tuple(tuple(int(x) for x in s) for s in d.get("sizes", ())),
                   where=str(d.get("where", "")))


@dataclass(frozen=True)
class LastCollective:
    """With nothing in flight: the last collective every dumped rank completed."""

    group: str
    seq: int
    op: str

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "seq": self.seq, "op": self.op}


@dataclass(frozen=True)
class FlightFacts:
    """What the recorders of one stalled attempt say (:func:`analyse`)."""

    ranks: tuple[RankDump, ...]
    stuck: StuckCollective | None = None
    last: LastCollective | None = None  # when nothing was in flight

    @property
    def dumped(self) -> tuple[int, ...]:
        return tuple(r.rank for r in self.ranks if r.status is DumpStatus.DUMPED)

    def line(self) -> str:
        """The flight recorder in one phrase, for the fault's line."""
        if self.stuck is not None:
            return self.stuck.line()
        if self.last is not None:
            return (f"no collective in flight; the last one, {self.last.op} "
                    f"#{self.last.seq} of group {self.last.group}, completed on "
                    f"{_ranks(self.dumped)}")
        if self.dumped:
            return f"no collective recorded on {_ranks(self.dumped)}"
        counts: dict[str, int] = {}
        for r in self.ranks:
            counts[r.status.value] = counts.get(r.status.value, 0) + 1
        first = next((r.reason for r in self.ranks if r.reason), "")
        return ("no dump (" + ", ".join(f"{k.replace('_', ' ')}: {v} rank(s)"
                                        for k, v in sorted(counts.items()))
                + (f"; {first}" if first else "") + ")")

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": [r.to_dict() for r in self.ranks],
                "stuck": None if self.stuck is None else self.stuck.to_dict(),
                "last": None if self.last is None else self.last.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FlightFacts:
        """Raises ValueError for a record that is not what :meth:`to_dict` writes."""
        try:
            ranks = tuple(RankDump(int(r["local_rank"]), int(r["rank"]),
                                   DumpStatus(str(r["status"])), str(r.get("reason", "")),
                                   recorded=int(r.get("entries", 0)))
                          for r in d.get("ranks", ()))
            stuck = d.get("stuck")
            last = d.get("last")
            return cls(ranks, None if stuck is None else StuckCollective.from_dict(stuck),
                       None if last is None else LastCollective(
                           str(last["group"]), int(last["seq"]), str(last["op"])))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"not a flight-recorder record: {exc}") from None

    def describe(self) -> list[str]:
        """The evidence file's section: the finding, each rank's status, and each dumped rank's
        entries around the collective that matters."""
        out = [f"flight recorder: {self.line()}"]
        for r in self.ranks:
            out.append(f"  rank {r.rank} (local {r.local_rank}): {r.status.value}"
                       + (f", {r.entries} entries" if r.status is DumpStatus.DUMPED else "")
                       + (f": {r.reason}" if r.reason else ""))
        focus = self.stuck or self.last
        for r in self.ranks:
            if r.dump is None or not r.dump.entries:
                continue
            mine = [e for e in r.dump.entries if not e.p2p and (
                focus is None or e.group == focus.group)]
            if focus is not None:
                mine = [e for e in mine if e.seq <= focus.seq + SHOWN // 2] or mine
            out.append(f"  rank {r.rank}'s last entries (seq, operation, state, sizes, where):")
            for e in mine[-SHOWN:]:
                out.append(f"    #{e.seq} {e.op} {e.state} {list(map(list, e.sizes))} "
                           f"{_user_frame(e.frames) or '-'}")
        return out


def request(run_dir: str | Path, local_ranks: Iterable[tuple[int, int]],
            wait_s: float = WAIT_S, clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep) -> list[RankDump]:
    """Ask each worker (``(local_rank, rank)`` pairs) for its dump and read the answers; every
    rank's outcome is typed, and the whole call takes at most about ``wait_s``."""
    run_dir = Path(run_dir)
    asked: dict[int, int] = {}
    out: dict[int, RankDump] = {}
    for lr, rank in local_ranks:
        with contextlib.suppress(FileNotFoundError):
            status_path(run_dir, lr).unlink()  # an earlier request's answer is not this one's
        reason = _knock(fifo_path(run_dir, lr))
        if reason:
            out[lr] = RankDump(lr, rank, DumpStatus.NO_LISTENER, reason)
        else:
            asked[lr] = rank
    deadline = clock() + wait_s
    while asked and any(not status_path(run_dir, lr).exists() for lr in asked) \
            and clock() < deadline:
        sleep(0.05)
    for lr, rank in asked.items():
        out[lr] = read_answer(run_dir, lr, rank)
    return [out[lr] for lr in sorted(out)]


def _knock(path: Path) -> str:
    """Write one byte to a worker's FIFO without blocking; "" when it was heard, else why not."""
    try:
        if not stat.S_ISFIFO(os.lstat(path).st_mode):
            return "not a FIFO"
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return "the worker started no listener"
    except OSError as exc:  # ENXIO: nobody has it open for reading (the worker is gone)
        return f"no worker listening ({exc.strerror or exc})"
    try:
        os.write(fd, b"1")
    except OSError as exc:
        return f"could not ask ({exc.strerror or exc})"
    finally:
        os.close(fd)
    return ""


def read_answer(run_dir: str | Path, local_rank: int, rank: int) -> RankDump:
    """One rank's answer, parsed (:func:`parse_dump`), after :func:`respond` wrote it."""
    try:
        raw = status_path(run_dir, local_rank).read_bytes()
    except OSError:
        return RankDump(local_rank, rank, DumpStatus.NO_ANSWER,
                        "no answer before the deadline (its process may hold the GIL)")
    try:
        status = json.loads(raw[:1 << 16])
        apis = [str(a) for a in status.get("apis", ())]
        reasons = "; ".join(str(r) for r in status.get("reasons", ()))
        rank = int(status.get("rank", rank))
    except (ValueError, TypeError, AttributeError) as exc:
        return RankDump(local_rank, rank, DumpStatus.UNREADABLE, f"its status: {exc}")
    if not apis:
        return RankDump(local_rank, rank, DumpStatus.NOT_AVAILABLE, reasons)
    dumps: list[Dump] = []
    files: list[str] = []
    for api in apis:
        path = dump_path(run_dir, local_rank, api)
        try:
            with open(path, "rb") as fh:
                data = fh.read(MAX_DUMP_BYTES + 1)
            if len(data) > MAX_DUMP_BYTES:
                raise ValueError(f"larger than {MAX_DUMP_BYTES} bytes")
            dumps.append(parse_dump(data))
            files.append(str(path))
        except (OSError, ValueError) as exc:
            return RankDump(local_rank, rank, DumpStatus.UNREADABLE, f"{api}: {exc}")
    return RankDump(local_rank, rank, DumpStatus.DUMPED, reasons, merge_dumps(dumps),
                    tuple(files))


# ----- parsing (pure) -------------------------------------------------------------------------


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a flight-recorder dump names no global ({module}.{name})")


def parse_dump(data: bytes) -> Dump:
    """One rank's dump (the pickle torch's dump API returns). Raises ValueError for anything
    else."""
    try:
        obj = _NoGlobals(io.BytesIO(data)).load()
    except Exception as exc:  # pickle raises many kinds on garbage
        raise ValueError(f"not a flight-recorder dump: {type(exc).__name__}: {exc}") from None
    if isinstance(obj, list):  # torch 2.2: the entries alone
        obj = {"entries": obj}
    if not isinstance(obj, dict) or not isinstance(obj.get("entries", []), list):
        raise ValueError("not a flight-recorder dump: no list of entries")
    entries: list[Entry] = []
    pg_names: dict[str, str] = {}  # pg_id -> group name (pg_status is keyed by id)
    for raw in obj.get("entries", []):
        if not isinstance(raw, dict):
            continue
        e = _entry(raw)
        if e is None:
            continue
        entries.append(e)
        if "pg_id" in raw:
            pg_names[str(raw["pg_id"])] = e.group
    completed: dict[str, int] = {}
    status = obj.get("pg_status")
    if isinstance(status, dict):
        for pg_id, s in status.items():
            if isinstance(s, dict) and isinstance(s.get("last_completed_collective"), int):
                completed[pg_names.get(str(pg_id), str(pg_id))] = s["last_completed_collective"]
    members: dict[str, tuple[int, ...]] = {}
    config = obj.get("pg_config")
    if isinstance(config, dict):
        for name, c in config.items():
            ranks = _rank_list(c.get("ranks") if isinstance(c, dict) else c)
            if ranks is not None:
                members[str(name)] = ranks
    return Dump(tuple(entries), completed, members, str(obj.get("version", "")))


def _entry(raw: Mapping[str, Any]) -> Entry | None:
    seq = raw.get("collective_seq_id")
    if not isinstance(seq, int) or isinstance(seq, bool):
        return None
    pg = raw.get("process_group")
    group = str(pg[0]) if isinstance(pg, (tuple, list)) and pg else str(raw.get("pg_id", ""))
    frames = []
    for f in raw.get("frames", ()) or ():
        if isinstance(f, dict):
            frames.append(f"{f.get('filename', '?')}:{f.get('line', '?')} in {f.get('name', '?')}")
    sizes = []
    for s in raw.get("input_sizes", ()) or ():
        with contextlib.suppress(TypeError, ValueError):
            sizes.append(tuple(int(x) for x in s))
    created = raw.get("time_created_ns", 0)
    return Entry(group=group, seq=seq, op=str(raw.get("profiling_name", "?")),
                 state=str(raw.get("state", "")), p2p=bool(raw.get("is_p2p", False)),
                 sizes=tuple(sizes), dtypes=tuple(str(d) for d in raw.get("input_dtypes", ()) or ()),
                 frames=tuple(frames), created_ns=created if isinstance(created, int) else 0)


def _rank_list(value: Any) -> tuple[int, ...] | None:
    """pg_config's ranks: a list, or its text ("[0, 1]")."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if isinstance(value, (list, tuple)) and all(isinstance(r, int) for r in value):
        return tuple(int(r) for r in value)
    return None


def merge_dumps(dumps: Sequence[Dump]) -> Dump:
    """One rank's dumps through several APIs as one (an entry seen twice counts once)."""
    seen: dict[tuple[str, int, str, bool], Entry] = {}
    completed: dict[str, int] = {}
    members: dict[str, tuple[int, ...]] = {}
    for d in dumps:
        for e in d.entries:
            seen.setdefault((e.group, e.seq, e.op, e.p2p), e)
        for g, c in d.completed.items():
            completed[g] = max(c, completed.get(g, c))
        members.update(d.members)
    entries = sorted(seen.values(), key=lambda e: (e.group, e.seq))
    return Dump(tuple(entries), completed, members,
                ",".join(d.version for d in dumps if d.version))


def analyse(ranks: Sequence[RankDump]) -> FlightFacts:
    """The collective a stalled group is stuck in, from every rank's dump (pure).

    Per process group, a rank *entered* collective ``seq`` when its recorder holds it, and
    *completed* it when its state is "completed" or the group's ``last_completed_collective``
    reaches it. The stuck collective is the first one some rank entered and did not complete
    (the oldest, across groups); the ranks whose last entered collective is below it never
    entered it. With nothing in flight, the last collective every dumped rank completed."""
    dumped = [r for r in ranks if r.dump is not None]
    if not dumped:
        return FlightFacts(tuple(ranks))
    groups = sorted({e.group for r in dumped if r.dump is not None for e in r.dump.entries
                     if not e.p2p})
    best: tuple[int, StuckCollective] | None = None
    last: LastCollective | None = None
    for g in groups:
        entered: dict[int, int] = {}
        done: dict[int, int] = {}
        by_rank: dict[int, dict[int, Entry]] = {}
        for r in dumped:
            assert r.dump is not None
            mine = {e.seq: e for e in r.dump.entries if e.group == g and not e.p2p}
            by_rank[r.rank] = mine
            entered[r.rank] = max(mine, default=0)
            done[r.rank] = max([r.dump.completed.get(g, 0),
                                *(s for s, e in mine.items() if e.state == "completed")])
        pending = [rk for rk in entered if entered[rk] > done[rk]]
        if not pending:
            top = min(done.values())
            if top > 0:
                e = next((by_rank[rk][top] for rk in by_rank if top in by_rank[rk]), None)
                if e is not None and (last is None or top > last.seq):
                    last = LastCollective(g, top, e.op)
            continue
        seq = min(done[rk] + 1 for rk in pending)
        holder = next((rk for rk in sorted(pending) if seq in by_rank[rk]),
                      sorted(pending)[0])
        entry = by_rank[holder].get(seq) or by_rank[holder][min(
            s for s in by_rank[holder] if s > done[holder])]
        members = next((r.dump.members[g] for r in dumped
                        if r.dump is not None and g in r.dump.members), ())
        here = {r.rank for r in ranks}
        stuck = StuckCollective(
            group=g, seq=entry.seq, op=entry.op,
            entered=tuple(sorted(rk for rk in entered if entered[rk] >= entry.seq)),
            missing=tuple(sorted(rk for rk in entered if entered[rk] < entry.seq)),
            not_dumped=tuple(sorted((set(members) - here)
                                    | {r.rank for r in ranks if r.dump is None})),
            sizes=entry.sizes, where=_user_frame(entry.frames))
        if best is None or entry.created_ns < best[0]:
            best = (entry.created_ns, stuck)
    return FlightFacts(tuple(ranks), None if best is None else best[1],
                       None if best is not None else last)


def _user_frame(frames: Sequence[str]) -> str:
    """The innermost frame outside torch, the tools and this package: where the user's code
    issued it ("" when every frame is a tool's)."""
    return next((f for f in frames if not any(p in f.replace("\\", "/") for p in _TOOL_PATHS)),
                "")


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
