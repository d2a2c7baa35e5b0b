"""The data files the package ships: one list, read through `importlib.resources`, and the
checks every versioned table of ``[[entries]]`` passes (`data_tables`, `table_id`).

Every table the engine reads at run time (``known_issues.toml``, ``signatures.toml``,
``remedies.toml``) is named in `DATA_FILES` and read with `read_data`, so an installed wheel
reads the same bytes a source checkout does (the wheel's package data is
``core/knowledge/*.toml``; ``tests/test_package.py`` builds the wheel and checks that every name here is in it).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from importlib import resources
from typing import Any, TypeVar

from ...errors import FileFormatError, InvalidRuleError, MissingDataFileError
from ...process import PROCESS
from ..values import bounded

DATA_FILES: tuple[str, ...] = ("known_issues.toml", "signatures.toml", "remedies.toml",
                               "node_differences.toml", "nccl_diagnostics.toml")
_T = TypeVar("_T")
#: The user's tables kept parsed at the most (the oldest goes first); the shipped ones stay.
MAX_USER_TABLES = 16
_TABLES: dict[tuple[Hashable, ...], Any] = PROCESS.hold(
    "core.knowledge.data.tables", dict,
    "every table parsed once per process: a shipped one by its kind, a user's by its paths")


def parsed(key: tuple[Hashable, ...], parse: Callable[[], _T], *, shipped: bool = True) -> _T:
    """``parse()`` once per ``key`` in this process (a table's kind, and the paths of a user's
    files); a user's (``shipped=False``) are kept `MAX_USER_TABLES` at the most, the oldest
    going first. A parse that raises keeps nothing."""
    stored = (shipped, *key)
    if stored in _TABLES:
        value: _T = _TABLES[stored]
        return value
    value = parse()
    if not shipped:
        users = [k for k in _TABLES if not k[0]]
        for old in users[:max(0, len(users) - MAX_USER_TABLES + 1)]:
            del _TABLES[old]
    _TABLES[stored] = value
    return value


def read_data(name: str) -> tuple[str, str]:
    """The text of a shipped data file and where it was read from (for error messages)."""
    if name not in DATA_FILES:
        raise ValueError(f"{name!r} is not one of the shipped data files {DATA_FILES}")
    entry = resources.files(__package__ or "resilient_strategy.core.knowledge").joinpath(name)
    try:
        return entry.read_text(encoding="utf-8"), str(entry)
    except FileNotFoundError:
        raise MissingDataFileError(
            f"the installed resilient_strategy has no {name} (at {entry}); reinstall it "
            "from a wheel built with its package data") from None


def table_id(d: Any, what: str, keys: frozenset[str] | set[str], origin: str, where: str) -> str:
    """The id of one ``[[what]]`` table of a data file (rules, signatures, remedies), after
    checking it is a table with a non-empty id and no key outside ``keys``; every problem an
    `InvalidRuleError` naming the entry and the file."""
    if not isinstance(d, Mapping):
        raise InvalidRuleError(where, f"a {what} must be a table ([[{what}]]), not {d!r}", origin)
    tid = d.get("id")
    if not isinstance(tid, str) or not tid.strip():
        raise InvalidRuleError(where, f"every {what} needs an id, not {tid!r}", origin)
    tid = tid.strip()
    extra = sorted(set(d) - set(keys))
    if extra:
        raise InvalidRuleError(tid, f"unknown key(s) {extra}; allowed: {sorted(keys)}", origin)
    return tid


def data_tables(text: str, origin: str, what: str, version: int,
                extra_keys: frozenset[str] = frozenset()) -> tuple[dict[str, Any], list[Any]]:
    """One versioned TOML data file of ``[[what]]`` tables (signatures, remedies), parsed with
    its bounds and checked: the top-level keys, the version (1 to ``version``), the array of
    tables. Returns the whole document and the tables; every problem an InvalidRuleError."""
    try:
        data = bounded.parse_toml(text, origin)
    except FileFormatError as exc:
        raise InvalidRuleError("?", exc.problem, origin) from None
    unknown = sorted(set(data) - {"version", what} - extra_keys)
    if unknown:
        raise InvalidRuleError("?", f"unknown top-level key(s) {unknown}; write a version and "
                               f"[[{what}]] tables", origin)
    found = data.get("version")
    if isinstance(found, bool) or not isinstance(found, int) or not 1 <= found <= version:
        raise InvalidRuleError("?", f"version must be an integer from 1 to {version} (this "
                               f"resilient_strategy reads version {version}), not {found!r}",
                               origin)
    tables = data.get(what, [])
    if not isinstance(tables, list):
        raise InvalidRuleError("?", f"'{what}' must be an array of tables ([[{what}]])", origin)
    return data, tables
