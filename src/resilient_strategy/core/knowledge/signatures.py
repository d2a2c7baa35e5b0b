"""Failure signatures as data: what a failing probe or training rank prints -> a cause.

The table (``signatures.toml``, versioned) is read by the probe parser
(`resilient_strategy.core.measures.probe.parse_probe`) and by the supervisor's classifier
(`resilient_strategy.run.verdicts.classify_error`): one table, two readers. Each entry
names a cause of `CAUSES` and the public source it comes
from; the first entry that matches wins. Users add entries the way they add rules
(``RESILIENT_STRATEGY_SIGNATURES``, `load_signatures`). Pure: no I/O except reading the
files named to `load_signatures` (bounded, `bounded`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import FileFormatError, InvalidRuleError, UnsafePathError
from ..values import bounded
from .causes import CAUSES
from .data import data_tables, parsed, read_data, table_id

#: The table format this code reads; a file of a newer version is refused (it may mean more).
VERSION = 1
#: What prints a signature (documentation, and a check against typos).
KINDS = ("nccl_warn", "nccl_result", "torch", "tensorflow", "cuda", "gloo", "store", "signal")
#: The environment variable naming the user's signature files (os.pathsep-separated).
ENV_VAR = "RESILIENT_STRATEGY_SIGNATURES"
_KEYS = frozenset({"id", "cause", "kind", "match", "signal", "source"})
#: The cause of text no signature places.
UNPLACED = "worker_error"


@dataclass(frozen=True)
class Signature:
    """One entry: text matching ``pattern`` (or an exit by ``signal``) means ``cause``."""

    id: str
    cause: str
    kind: str
    source: str
    pattern: re.Pattern[str] | None = None
    signal: int | None = None
    origin: str = "built-in"


@dataclass(frozen=True)
class DistributedFrame:
    """A module whose frames are the distributed runtime's (it and its submodules)."""

    id: str
    module: str
    source: str
    origin: str = "built-in"

    def holds(self, module: str) -> bool:
        return module == self.module or module.startswith(self.module + ".")


@dataclass(frozen=True)
class ScriptFault:
    """Text that is the script's fault (a kernel's device-side assert, a bad address) when
    raised outside a distributed frame, or ``anywhere``."""

    id: str
    pattern: re.Pattern[str]
    anywhere: bool
    source: str
    origin: str = "built-in"


@dataclass(frozen=True)
class Blame:
    """Who raised an exception, as data: the distributed runtime's modules and the texts that
    are the script's (``[[distributed_frame]]``, ``[[script_fault]]`` in ``signatures.toml``)."""

    frames: tuple[DistributedFrame, ...] = ()
    script: tuple[ScriptFault, ...] = ()

    def distributed(self, module: str) -> bool:
        """Whether a frame of ``module`` is the distributed runtime's."""
        return any(f.holds(module) for f in self.frames)

    def script_fault(self, text: str, in_distributed: bool) -> ScriptFault | None:
        """The entry that makes ``text`` the script's (raised inside a distributed frame or
        not), if any."""
        return next((e for e in self.script if (e.anywhere or not in_distributed)
                     and e.pattern.search(text)), None)

    def __add__(self, other: Blame) -> Blame:
        return Blame(self.frames + other.frames, self.script + other.script)


@dataclass(frozen=True)
class Signatures:
    """The ordered table: `match` returns the first entry that places a text."""

    entries: tuple[Signature, ...]
    version: int = VERSION
    blame: Blame = field(default_factory=Blame)

    def match(self, text: str) -> Signature | None:
        if not text:
            return None
        for entry in self.entries:
            if entry.pattern is not None and entry.pattern.search(text):
                return entry
        return None

    def classify(self, text: str) -> str:
        """The cause that best explains a failure's text (``worker_error`` when none does)."""
        found = self.match(text)
        return UNPLACED if found is None else found.cause

    def for_signal(self, signum: int) -> Signature | None:
        """The entry for a worker that died from signal ``signum``, if one names it."""
        return next((e for e in self.entries if e.signal == signum), None)

    @property
    def causes(self) -> tuple[str, ...]:
        """The distinct causes the table can place, in table order."""
        return tuple(dict.fromkeys(e.cause for e in self.entries))


def signature_from_dict(d: Mapping[str, Any], origin: str, where: str) -> Signature:
    """One entry from its TOML table; every problem is an `InvalidRuleError` naming it."""
    sid = table_id(d, "signature", _KEYS, origin, where)
    cause, kind, source = d.get("cause"), d.get("kind", ""), d.get("source")
    if cause not in CAUSES or not cause or cause in ("budget", "timeout_short"):
        raise InvalidRuleError(sid, f"cause must be one of {sorted(c for c in CAUSES if c)}, "
                               f"not {cause!r}", origin)
    if kind not in KINDS:
        raise InvalidRuleError(sid, f"kind must be one of {KINDS}, not {kind!r}", origin)
    if not isinstance(source, str) or not source.strip():
        raise InvalidRuleError(sid, "every signature needs a source (where it was reported)",
                               origin)
    match, signum = d.get("match"), d.get("signal")
    if (match is None) == (signum is None):
        raise InvalidRuleError(sid, "give exactly one of match (a regular expression) or signal "
                               "(a signal number)", origin)
    pattern = None
    if match is not None:
        if not isinstance(match, str) or not match:
            raise InvalidRuleError(sid, f"match must be a regular expression, not {match!r}",
                                   origin)
        try:
            pattern = re.compile(match, re.IGNORECASE)
        except re.error as exc:
            raise InvalidRuleError(sid, f"match {match!r} is not a regular expression ({exc})",
                                   origin) from exc
    elif isinstance(signum, bool) or not isinstance(signum, int) or not 1 <= signum <= 64:
        raise InvalidRuleError(sid, f"signal must be a signal number 1..64, not {signum!r}",
                               origin)
    return Signature(id=sid, cause=str(cause), kind=str(kind), source=source.strip(),
                     pattern=pattern, signal=signum, origin=origin)


_BLAME_TABLES = frozenset({"distributed_frame", "script_fault"})
_FRAME_KEYS = frozenset({"id", "module", "source"})
_SCRIPT_KEYS = frozenset({"id", "match", "anywhere", "source"})


def parse_signatures(text: str, origin: str) -> tuple[Signature, ...]:
    """The entries of one TOML document (bounded parse; ``origin`` names it in errors)."""
    _, tables = data_tables(text, origin, "signature", VERSION, _BLAME_TABLES)
    entries = tuple(signature_from_dict(t, origin, f"#{n}") for n, t in enumerate(tables, 1))
    ids = [e.id for e in entries]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise InvalidRuleError(dupes[0], "duplicate signature id", origin)
    return entries


def parse_blame(text: str, origin: str) -> Blame:
    """The ``[[distributed_frame]]`` and ``[[script_fault]]`` tables of one TOML document;
    every problem an `InvalidRuleError` naming the entry."""
    data, _ = data_tables(text, origin, "signature", VERSION, _BLAME_TABLES)
    frames: list[DistributedFrame] = []
    script: list[ScriptFault] = []
    for what, keys in (("distributed_frame", _FRAME_KEYS), ("script_fault", _SCRIPT_KEYS)):
        tables = data.get(what, [])
        if not isinstance(tables, list):
            raise InvalidRuleError("?", f"'{what}' must be an array of tables ([[{what}]])",
                                   origin)
        for n, d in enumerate(tables, 1):
            eid = table_id(d, what, keys, origin, f"{what} #{n}")
            source = d.get("source")
            if not isinstance(source, str) or not source.strip():
                raise InvalidRuleError(eid, f"every {what} needs a source", origin)
            if what == "distributed_frame":
                module = d.get("module")
                if not isinstance(module, str) or not re.fullmatch(r"\w+(\.\w+)*", module):
                    raise InvalidRuleError(eid, f"module must be a dotted module name, not "
                                           f"{module!r}", origin)
                frames.append(DistributedFrame(eid, module, source.strip(), origin))
                continue
            match, anywhere = d.get("match"), d.get("anywhere", False)
            if not isinstance(anywhere, bool):
                raise InvalidRuleError(eid, f"anywhere must be true or false, not {anywhere!r}",
                                       origin)
            if not isinstance(match, str) or not match:
                raise InvalidRuleError(eid, f"match must be a regular expression, not {match!r}",
                                       origin)
            try:
                pattern = re.compile(match, re.IGNORECASE)
            except re.error as exc:
                raise InvalidRuleError(eid, f"match {match!r} is not a regular expression "
                                       f"({exc})", origin) from exc
            script.append(ScriptFault(eid, pattern, anywhere, source.strip(), origin))
    return Blame(tuple(frames), tuple(script))


def merge(builtin: Iterable[Signature], user: Iterable[Signature]) -> Signatures:
    """The user's entries first (they refine the built-in ones), then the built-in entries; a
    user entry with a built-in id takes that entry's place instead."""
    base = list(builtin)
    ids = {e.id: i for i, e in enumerate(base)}
    first: list[Signature] = []
    for entry in user:
        if entry.id in ids:
            base[ids[entry.id]] = entry
        else:
            first.append(entry)
    return Signatures(tuple(first + base))


def builtin_signatures() -> Signatures:
    """The table shipped with the package (read once per process)."""
    def parse() -> Signatures:
        text, origin = read_data("signatures.toml")
        return Signatures(parse_signatures(text, origin), blame=parse_blame(text, origin))

    return parsed(("signatures",), parse)


def load_signatures(extra: Iterable[str | Path] | str | Path = ()) -> Signatures:
    """The built-in table plus the user's files (TOML, the same form). A bare path is one file;
    an empty name is skipped (an empty ``RESILIENT_STRATEGY_SIGNATURES``)."""
    items = (extra,) if isinstance(extra, (str, Path)) else tuple(extra)
    paths = tuple(str(p) for p in items if str(p))
    return builtin_signatures() if not paths else parsed(("signatures", *paths),
                                                         lambda: _load(paths), shipped=False)


def _load(paths: tuple[str, ...]) -> Signatures:
    user: list[Signature] = []
    blame = Blame()
    for name in paths:
        path = Path(name)
        try:
            text = bounded.read_user_file(path, bounded.MAX_RULES_BYTES).decode()
        except (OSError, UnsafePathError, FileFormatError, UnicodeDecodeError) as exc:
            raise InvalidRuleError("?", f"cannot read it: {exc}", str(path)) from None
        user.extend(parse_signatures(text, str(path)))
        blame = blame + parse_blame(text, str(path))
    merged = merge(builtin_signatures().entries, user)
    return Signatures(merged.entries, blame=builtin_signatures().blame + blame)


def signatures_from_env(env: Mapping[str, str], sep: str) -> Signatures:
    """The table for an environment (``RESILIENT_STRATEGY_SIGNATURES``, ``sep``-separated)."""
    raw = env.get(ENV_VAR, "")
    return load_signatures([p for p in raw.split(sep) if p.strip()]) if raw else \
        builtin_signatures()
