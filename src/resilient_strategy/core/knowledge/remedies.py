"""Remedies as data: cause -> ordered environment changes, each gated by facts and sourced.

The table (``remedies.toml``, versioned) holds ``[[remedy]]`` entries (``env``, the backends it
applies to, ``when`` clauses in the known-issue rules' language, ``source``) and a ``[causes]``
table naming each cause's remedies in the order to try them. The planner
(`resilient_strategy.core.planning.plan.plan`) asks `Remedies.for_cause` which apply to a
failed candidate on these facts. Users extend it the way they extend rules
(``RESILIENT_STRATEGY_REMEDIES``, `load_remedies`). Pure except reading the named files
(bounded, `bounded`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import FileFormatError, InvalidRuleError, UnsafePathError
from ...vocab import BACKENDS
from ..values import bounded
from .candidate_env import refusal
from .clauses import Clause, FactValue, clause_holds, parse_clause
from .data import data_tables, parsed, read_data, table_id

#: The table format this code reads.
VERSION = 1
#: The environment variable naming the user's remedy files (os.pathsep-separated).
ENV_VAR = "RESILIENT_STRATEGY_REMEDIES"
#: The pseudo-cause of a communicator that hung in its set-up (a hang judged from progress).
SETUP_HANG = "setup_hang"
_KEYS = frozenset({"id", "env", "backends", "when", "message", "source"})
_FACT_VALUE = re.compile(r"\{([a-z_]+\.[A-Za-z0-9_]+)\}")


@dataclass(frozen=True)
class Remedy:
    """One remedy: ``env`` for a candidate of ``backends`` where every ``when`` clause holds."""

    id: str
    env: tuple[tuple[str, str], ...]
    source: str
    message: str = ""
    backends: tuple[str, ...] = ("nccl",)
    when: tuple[Clause, ...] = ()
    origin: str = "built-in"

    def resolve(self, values: Mapping[str, FactValue]) -> dict[str, str] | None:
        """The variables this remedy sets on these facts, or None when it does not apply (a
        clause does not hold, or a ``{fact}`` value is unknown or empty)."""
        if not all(clause_holds(c, values) for c in self.when):
            return None
        out: dict[str, str] = {}
        for name, raw in self.env:
            missing = False

            def fill(m: re.Match[str]) -> str:
                nonlocal missing
                value = values.get(m.group(1))
                if isinstance(value, tuple):
                    value = ",".join(value)
                if value is None or value == "" or value is False:
                    missing = True
                    return ""
                return str(value)

            text = _FACT_VALUE.sub(fill, raw)
            if missing:
                return None
            out[name] = text
        return out


@dataclass(frozen=True)
class Remedies:
    """The remedies and each cause's ordered list of remedy ids."""

    remedies: tuple[Remedy, ...]
    causes: tuple[tuple[str, tuple[str, ...]], ...]
    version: int = VERSION

    def by_id(self, rid: str) -> Remedy | None:
        return next((r for r in self.remedies if r.id == rid), None)

    def for_cause(self, cause: str, backend: str, values: Mapping[str, FactValue]
                  ) -> tuple[tuple[Remedy, dict[str, str]], ...]:
        """The remedies for ``cause`` that apply to a ``backend`` candidate on these facts, in
        order, each with the variables it sets."""
        ids = dict(self.causes).get(cause, ())
        out: list[tuple[Remedy, dict[str, str]]] = []
        for rid in ids:
            remedy = self.by_id(rid)
            if remedy is None or backend not in remedy.backends:
                continue
            env = remedy.resolve(values)
            if env is not None:
                out.append((remedy, env))
        return tuple(out)


def _strings(value: object, key: str, rid: str, origin: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise InvalidRuleError(rid, f"{key} must be a string or an array of strings, not {value!r}",
                           origin)


def remedy_from_dict(d: Mapping[str, Any], origin: str, where: str) -> Remedy:
    """One remedy from its TOML table; every problem an `InvalidRuleError` naming it."""
    rid = table_id(d, "remedy", _KEYS, origin, where)
    env = d.get("env")
    if not isinstance(env, Mapping) or not env or not all(
            isinstance(k, str) and k and isinstance(v, str) for k, v in env.items()):
        raise InvalidRuleError(rid, "env must be a non-empty table of strings", origin)
    backends = _strings(d.get("backends", ["nccl"]), "backends", rid, origin)
    if not backends or not set(backends) <= set(BACKENDS):
        raise InvalidRuleError(rid, f"backends must name backends out of {BACKENDS}, not "
                               f"{backends!r}", origin)
    source, message = d.get("source"), d.get("message", "")
    if not isinstance(source, str) or not source.strip():
        raise InvalidRuleError(rid, "every remedy needs a source (where it was reported)", origin)
    if not isinstance(message, str):
        raise InvalidRuleError(rid, f"message must be a string, not {message!r}", origin)
    when = tuple(parse_clause(c, rid, origin) for c in _strings(d.get("when", []), "when", rid,
                                                                  origin))
    for value in env.values():
        for fact in _FACT_VALUE.findall(value):
            parse_clause(fact, rid, origin)  # a {fact} must name a known fact
    for why in (refusal(k, v) for k, v in env.items()):
        if why:  # what a probe worker would refuse to set (candidate_env)
            raise InvalidRuleError(rid, f"env: {why}", origin)
    return Remedy(id=rid, env=tuple(sorted(env.items())), source=source.strip(),
                  message=message.strip(), backends=backends, when=when, origin=origin)


def parse_remedies(text: str, origin: str) -> tuple[tuple[Remedy, ...], dict[str, tuple[str, ...]]]:
    """The remedies and cause lists of one TOML document (bounded parse)."""
    data, tables = data_tables(text, origin, "remedy", VERSION, frozenset({"causes"}))
    remedies = tuple(remedy_from_dict(t, origin, f"#{n}") for n, t in enumerate(tables, 1))
    ids = [r.id for r in remedies]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise InvalidRuleError(dupes[0], "duplicate remedy id", origin)
    causes_raw = data.get("causes", {})
    if not isinstance(causes_raw, Mapping):
        raise InvalidRuleError("?", "[causes] must be a table of cause = [remedy ids]", origin)
    causes = {str(k): _strings(v, f"causes.{k}", "?", origin) for k, v in causes_raw.items()}
    return remedies, causes


def merge(base: Remedies, remedies: Iterable[Remedy], causes: Mapping[str, tuple[str, ...]]
          ) -> Remedies:
    """``base`` with these remedies (an id already there is replaced) and cause lists (a cause
    already there gets the new list); every id a cause names must exist."""
    table = {r.id: r for r in base.remedies}
    table.update({r.id: r for r in remedies})
    lists = dict(base.causes)
    lists.update(causes)
    for cause, ids in lists.items():
        missing = sorted(set(ids) - set(table))
        if missing:
            raise InvalidRuleError("?", f"causes.{cause} names unknown remedy id(s) {missing}")
    return Remedies(tuple(table.values()), tuple(lists.items()))


def builtin_remedies() -> Remedies:
    """The table shipped with the package (read once per process)."""
    def parse() -> Remedies:
        remedies, causes = parse_remedies(*read_data("remedies.toml"))
        return merge(Remedies((), ()), remedies, causes)

    return parsed(("remedies",), parse)


def load_remedies(extra: Iterable[str | Path] | str | Path = ()) -> Remedies:
    """The built-in table plus the user's files (TOML, the same form)."""
    items = (extra,) if isinstance(extra, (str, Path)) else tuple(extra)
    paths = tuple(str(p) for p in items if str(p))
    return builtin_remedies() if not paths else parsed(("remedies", *paths),
                                                       lambda: _load(paths), shipped=False)


def _load(paths: tuple[str, ...]) -> Remedies:
    table = builtin_remedies()
    for name in paths:
        path = Path(name)
        try:
            text = bounded.read_user_file(path, bounded.MAX_RULES_BYTES).decode()
        except (OSError, UnsafePathError, FileFormatError, UnicodeDecodeError) as exc:
            raise InvalidRuleError("?", f"cannot read it: {exc}", str(path)) from None
        remedies, causes = parse_remedies(text, str(path))
        table = merge(table, remedies, causes)
    return table
