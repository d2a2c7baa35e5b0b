"""torch's flight-recorder dump, parsed and analysed (pure): `parse_dump` reads one rank's
dump, `analyse` names the collective a stalled group is stuck in, its operation, the ranks
that entered it and the ranks that never did (or the last collective every rank completed), as
typed facts (`FlightFacts`) that ride in the attempt's verdict. The dumps come from
`flight`, which also cites the dump's shape in torch's source.

A dump is read with an unpickler that refuses every global: torch's pickler writes plain dicts,
lists, tuples, strings and numbers (the first dumps, torch 2.2, were a list of entries; later a
dict with ``version``, ``pg_config``, ``pg_status`` and ``entries``:
torch/csrc/distributed/c10d/FlightRecorder.hpp). Standard library only.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

#: How many entries of each rank around the stuck collective the evidence file shows.
SHOWN = 6
#: Frames of these places are the tools', not the user's: ``where`` names the first other one
#: (and frames of this package, wherever it is installed).
_TOOL_PATHS = ("/torch/", "/site-packages/", "/dist-packages/", "<frozen", "/lightning/",
               "/accelerate/")
_OWN_DIR = str(Path(__file__).resolve().parents[1]).replace("\\", "/") + "/"


class DumpStatus(Enum):
    """What became of one rank's dump. The value is the word written to records."""

    DUMPED = "dumped"
    #: The worker answered: its torch has no dump API, or the API failed, or torch was absent.
    NOT_AVAILABLE = "not_available"
    #: No worker was listening (it never started one, or it is gone).
    NO_LISTENER = "no_listener"
    #: Asked, but no answer before the deadline.
    NO_ANSWER = "no_answer"
    #: Not asked, or no longer waited for: its process is stopped (``SIGSTOP``, a debugger:
    #: state T or t in ``/proc``) and cannot answer until it is continued.
    STOPPED = "stopped"
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
    desc: str = ""  # the process group's description ("default_pg" for the default group)
    pg_id: str = ""  # the recorder's number for the group


#: torch's description of the default group, the one every rank of the job is in.
DEFAULT_PG = "default_pg"


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
    """What the recorders of one stalled attempt say (`analyse`)."""

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
        """Raises ValueError for a record that is not what `to_dict` writes."""
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
    entries = [e for raw in obj.get("entries", []) if isinstance(raw, dict)
               and (e := _entry(raw)) is not None]
    pg_names = {e.pg_id: e.group for e in entries if e.pg_id}  # pg_status is keyed by id
    completed: dict[str, int] = {}
    status = obj.get("pg_status")
    if isinstance(status, dict):
        for pg_id, s in status.items():
            if isinstance(s, dict) and isinstance(s.get("last_completed_collective"), int):
                completed[pg_names.get(str(pg_id), str(pg_id))] = s["last_completed_collective"]
    config = obj.get("pg_config")
    members = _members(config if isinstance(config, dict) else {}, entries)
    return Dump(tuple(entries), completed, members, str(obj.get("version", "")))


def _members(config: Mapping[Any, Any], entries: Sequence[Entry]) -> dict[str, tuple[int, ...]]:
    """pg_config's ranks, per group as its entries name it. torch's analyser looks a group up
    by the key its entries name (``process_group[0]``); a key no entry names (torch 2.13's gloo
    keys its one slot "", name and desc "", whichever group was made last) is attributed to
    a group only by the slot's own name, else its description, else the entries' ``pg_id``,
    when that names exactly one group and one slot with ranks; never otherwise."""
    slots: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {}
    members: dict[str, tuple[int, ...]] = {}
    for key, c in config.items():
        ranks = _rank_list(c.get("ranks") if isinstance(c, dict) else c)
        if ranks is not None:
            members[str(key)] = ranks
            if ranks:
                slots[str(key)] = (c if isinstance(c, dict) else {}, ranks)
    groups = {e.group: e for e in entries if e.group}
    free = {k: c for k, (c, _) in slots.items() if k not in groups}
    descs = [e.desc for e in groups.values()]
    claimed = {g: k for g, e in groups.items() if g not in members
               and (k := _claim(g, e, descs.count(e.desc) == 1, free)) is not None}
    for g, k in claimed.items():
        if list(claimed.values()).count(k) == 1:
            members[g] = slots[k][1]
    return members


def _claim(group: str, e: Entry, unique_desc: bool,
           free: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The one pg_config slot (no entry names its key) that is ``group``'s, by the slot's name,
    else its description (one group of that description), else the entries' ``pg_id``."""
    for claims in ((lambda k, c: str(c.get("name", "")) == group),
                   (lambda k, c: unique_desc and bool(e.desc) and str(c.get("desc", "")) == e.desc),
                   (lambda k, c: bool(e.pg_id) and k == e.pg_id)):
        found = [k for k, c in free.items() if claims(k, c)]
        if found:
            return found[0] if len(found) == 1 else None
    return None


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
                 frames=tuple(frames), created_ns=created if isinstance(created, int) else 0,
                 desc=str(pg[1]) if isinstance(pg, (tuple, list)) and len(pg) > 1 else "",
                 pg_id=str(raw.get("pg_id", "")))


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


def analyse(ranks: Sequence[RankDump], world: int = 0) -> FlightFacts:
    """The collective a stalled group is stuck in, from every rank's dump (pure).

    Per process group, a rank *entered* collective ``seq`` when its recorder holds it, and
    *completed* it when its state is "completed" or the group's ``last_completed_collective``
    reaches it, or when another rank completed it (no rank completes a collective of its group
    before every rank entered it). The stuck collective is the first one some rank entered and did not complete
    (the oldest, across groups); the ranks whose last entered collective is below it never
    entered it. With nothing in flight, the last collective every dumped rank completed.
    ``world`` (the job's ranks, 0 when not known) is the default group's membership where no
    dump names it (torch 2.13's gloo records none it can be matched to: `_members`)."""
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
        # a collective of one group that completed on some rank was entered by every rank: a
        # rank whose own record lags behind (gloo notes a completion after the work's waiter
        # ran) is not stuck in it
        frontier = max(done.values(), default=0)
        done = {rk: max(d, min(frontier, entered[rk])) for rk, d in done.items()}
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
        members = _group_members(dumped, g, world)
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


def _group_members(dumped: Sequence[RankDump], group: str, world: int) -> tuple[int, ...]:
    """The ranks of ``group`` as a dump names them; else, for the default group, the job's."""
    known = next((r.dump.members[group] for r in dumped
                  if r.dump is not None and r.dump.members.get(group)), None)
    if known is not None:
        return known
    default = any(e.group == group and e.desc == DEFAULT_PG
                  for r in dumped if r.dump is not None for e in r.dump.entries)
    return tuple(range(world)) if default and world > 0 else ()


def _user_frame(frames: Sequence[str]) -> str:
    """The innermost frame outside torch, the tools and this package: where the user's code
    issued it ("" when every frame is a tool's)."""
    def tool(frame: str) -> bool:
        frame = frame.replace("\\", "/")
        return frame.startswith(_OWN_DIR) or any(p in frame for p in _TOOL_PATHS)

    return next((f for f in frames if not tool(f)), "")


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def divergence(ranks: Sequence[RankDump]) -> str:
    """The proof that the ranks are in different collectives, from their recorders (pure): one
    collective number of one process group issued as different operations, or with different
    tensor sizes, on two ranks. "" when no dump proves it (the recorders agree, or too few
    answered): a rank that never arrived is then held up, not diverged."""
    dumped = [r for r in ranks if r.dump is not None]
    seen: dict[tuple[str, int], tuple[int, Entry]] = {}
    for r in sorted(dumped, key=lambda d: d.rank):
        assert r.dump is not None
        for e in r.dump.entries:
            if e.p2p:
                continue
            first = seen.setdefault((e.group, e.seq), (r.rank, e))
            other_rank, other = first
            if other_rank == r.rank:
                continue
            if other.op != e.op or (other.sizes and e.sizes and other.sizes != e.sizes):
                return (f"collective #{e.seq} of group {e.group} is {other.op} "
                        f"{list(map(list, other.sizes))} on rank {other_rank} but {e.op} "
                        f"{list(map(list, e.sizes))} on rank {r.rank}")
    return ""
