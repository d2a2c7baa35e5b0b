"""NCCL's own diagnostics in the proof: which variables an NCCL probe worker sets, and what
NCCL's report says. Pure (the table is read through `data`).

Where the NCCL in use has them (``nccl_diagnostics.toml``: each variable with the first NCCL
version that reads it and its public source), an NCCL probe worker forms every connection at
communicator init (``NCCL_RUNTIME_CONNECT=0``, NCCL >= 2.22; by default connections form lazily,
at the first collective that needs them) and runs NCCL's active and RAS diagnostics
(``NCCL_RUN_DIAGNOSTICS=1``, ``NCCL_RUN_RAS_DIAGNOSTICS=1``, NCCL >= 2.31; both off by default).
A variable already in the worker's environment (the user's own, or a remedy candidate's) is
never changed: `diagnostic_env` leaves it out and names it in ``kept``.

NCCL prints both reports on the standard output of the process hosting rank 0 of the
communicator, each line marked ``NCCL DIAG`` (after ``host:pid`` in RAS reports and net-bandwidth
lines), a ``=== ... ===`` header, result lines tagged ``[OK]`` or ``[INFO]`` as ``<check>:
<text>``, and a completion line (the formats of NCCL's troubleshooting pages, "Diagnostics" and
"RAS Diagnostics": https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting/diagnostics.html,
https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting/ras.html). `parse_report`
turns those lines into `Finding` values; the probe result keeps them (``extra`` entries
``nccl_diag``) and the planner shows them in the trace (`trace.NcclDiagnostics`). They are
informational, as NCCL says: a finding never passes or fails a probe, the value-checked
collectives do.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ...errors import InvalidRuleError
from .data import data_tables, parsed, read_data

#: What marks a line of NCCL's diagnostics reports.
MARK = "NCCL DIAG"
#: ``extra`` keys of a probe result: a report line (``nccl_diag``), a variable the worker set
#: (``nccl_set``: ``NAME=VALUE``), one it left as the environment had it (``nccl_kept``).
EXTRA_LINE, EXTRA_SET, EXTRA_KEPT = "nccl_diag", "nccl_set", "nccl_kept"
#: At most this many report lines are kept per probe (an 8-GPU job prints about ten).
MAX_LINES = 40
_KEYS = frozenset({"name", "value", "since", "why", "source"})
_LINE = re.compile(r"^(?:\S+:\d+\s+)?NCCL DIAG\s+(?P<rest>\S.*?)\s*$")
_RESULT = re.compile(r"^\[(?P<tag>OK|INFO)\]\s+(?P<check>[^:]{1,80}):\s*(?P<text>.*)$")
_HEADER = re.compile(r"^===\s*(?P<name>.+?)\s*===$")
_DONE = re.compile(r"^(?P<name>.+?) diagnostics completed in (?P<ms>[\d.]+) ms across "
                   r"(?P<n>\d+) (?P<what>.+)$")


@dataclass(frozen=True)
class Variable:
    """One variable of the table: set to ``value`` where NCCL >= ``since``."""

    name: str
    value: str
    since: tuple[int, int]
    why: str
    source: str


@dataclass(frozen=True)
class DiagnosticEnv:
    """What an NCCL probe worker does about the table: the variables it sets (``set``), the
    ones it leaves as its environment has them (``kept``: names), for NCCL ``version``."""

    set: tuple[tuple[str, str], ...]
    kept: tuple[str, ...]
    version: tuple[int, ...] | None


@dataclass(frozen=True)
class Finding:
    """One result line of a report: ``report`` (``NCCL`` for the active diagnostics, ``RAS``),
    ``ok`` (tagged ``[OK]``; else ``[INFO]``: a condition to review), the ``check`` (``p2p``,
    ``net bw``, ``GPU inventory``, ``CUDA driver version``, ``ECC``, ``NVLink``, ``NCCL
    environment``, or a newer one) and NCCL's ``text``."""

    report: str
    ok: bool
    check: str
    text: str


@dataclass(frozen=True)
class Completed:
    """A report's completion line: ``report`` took ``ms`` across ``peers`` ranks (or RAS peers)."""

    report: str
    ms: float
    peers: int


@dataclass(frozen=True)
class Report:
    """What NCCL's diagnostics said in one probe."""

    findings: tuple[Finding, ...] = ()
    completed: tuple[Completed, ...] = ()

    @property
    def issues(self) -> tuple[Finding, ...]:
        """The ``[INFO]`` findings: conditions NCCL asks to review."""
        return tuple(f for f in self.findings if not f.ok)


def _since(text: object, where: str) -> tuple[int, int]:
    if not isinstance(text, str) or not re.fullmatch(r"\d+\.\d+", text):
        raise InvalidRuleError(where, f"since must be 'MAJOR.MINOR', not {text!r}",
                               "nccl_diagnostics.toml")
    major, minor = text.split(".")
    return int(major), int(minor)


def parse_table(text: str, origin: str) -> tuple[Variable, ...]:
    """The ``[[variable]]`` entries of a table's ``text``; InvalidRuleError for a bad one."""
    _, entries = data_tables(text, origin, "variable", 1)
    out: list[Variable] = []
    for i, e in enumerate(entries):
        where = str(e.get("name", f"variable {i + 1}")) if isinstance(e, dict) else f"#{i + 1}"
        if not isinstance(e, dict) or set(e) != _KEYS or not all(
                isinstance(e[k], str) and e[k] for k in _KEYS):
            raise InvalidRuleError(where, f"needs exactly the string fields {sorted(_KEYS)}",
                                   origin)
        if not re.fullmatch(r"NCCL_[A-Z0-9_]+", e["name"]):
            raise InvalidRuleError(where, "name must be an NCCL_* variable", origin)
        out.append(Variable(e["name"], e["value"], _since(e["since"], where), e["why"],
                            e["source"]))
    return tuple(out)


def builtin_table() -> tuple[Variable, ...]:
    """The shipped table (``nccl_diagnostics.toml``), parsed once per process."""
    return parsed(("nccl_diagnostics",), lambda: parse_table(*read_data("nccl_diagnostics.toml")))


def version_tuple(version: object) -> tuple[int, ...] | None:
    """An NCCL version as numbers: ``(2, 28, 9)`` from that tuple (torch's, with or without its
    suffix string), from ``"2.28.9"``, or from the integer NCCL's ``ncclGetVersion`` gives
    (``22809``: major*10000 + minor*100 + patch since 2.9); None when it is none of these."""
    if isinstance(version, bool):
        return None
    if isinstance(version, int):
        return (version // 10000, version // 100 % 100, version % 100) if version >= 20900 \
            else (version // 1000, version // 100 % 10, version % 100)
    if isinstance(version, str):
        parts = re.findall(r"\d+", version.split("+")[0])
        return tuple(int(p) for p in parts[:3]) if len(parts) >= 2 else None
    if isinstance(version, tuple):  # torch.cuda.nccl.version(): (2, 28, 9[, "suffix"])
        nums = [p for p in version[:3] if isinstance(p, int) and not isinstance(p, bool)]
        return tuple(nums) if len(nums) >= 2 and nums == list(version[:len(nums)]) else None
    return None


def diagnostic_env(version: object, env: Mapping[str, str],
                   table: Iterable[Variable] | None = None) -> DiagnosticEnv:
    """The variables an NCCL probe worker sets for NCCL ``version`` (see `version_tuple`; unknown:
    none), never one already in ``env`` (those are ``kept``, the user's choice wins)."""
    have = version_tuple(version)
    out: list[tuple[str, str]] = []
    kept: list[str] = []
    if have is None:
        return DiagnosticEnv((), (), None)
    for v in builtin_table() if table is None else table:
        if have[:2] < v.since:
            continue
        if v.name in env:
            kept.append(v.name)
        else:
            out.append((v.name, v.value))
    return DiagnosticEnv(tuple(out), tuple(kept), have)


def report_lines(text: str, limit: int = MAX_LINES) -> tuple[str, ...]:
    """The lines of ``text`` (a worker's output) that NCCL's diagnostics printed, each without its
    ``host:pid NCCL DIAG`` prefix, at most ``limit``."""
    out: list[str] = []
    if limit <= 0:
        return ()
    for line in text.splitlines():
        if MARK not in line:
            continue
        m = _LINE.match(line.strip())
        if m is not None:
            out.append(m.group("rest")[:300])
            if len(out) >= limit:
                break
    return tuple(out)


def parse_report(lines: Iterable[str]) -> Report:
    """The findings of report lines (as `report_lines` gives them; a line with its prefix is
    taken too). A line of none of the documented forms is skipped."""
    findings: list[Finding] = []
    completed: list[Completed] = []
    report = "NCCL"
    for raw in lines:
        m = _LINE.match(raw.strip())
        line = m.group("rest") if m is not None else raw.strip()
        if (h := _HEADER.match(line)) is not None:
            report = "RAS" if h.group("name").upper().startswith("RAS") else "NCCL"
        elif (r := _RESULT.match(line)) is not None:
            findings.append(Finding(report, r.group("tag") == "OK", r.group("check").strip(),
                                    r.group("text").strip()))
        elif (d := _DONE.match(line)) is not None:
            name = "RAS" if d.group("name").upper().startswith("RAS") else "NCCL"
            completed.append(Completed(name, float(d.group("ms")), int(d.group("n"))))
    return Report(tuple(findings), tuple(completed))


def from_extra(extra: Iterable[tuple[str, str]]) -> tuple[Report, tuple[str, ...],
                                                          tuple[str, ...]]:
    """A probe result's ``extra`` read back: the report, the variables set (``NAME=VALUE``) and
    the ones kept as the environment had them."""
    items = list(extra)
    return (parse_report(v for k, v in items if k == EXTRA_LINE),
            tuple(v for k, v in items if k == EXTRA_SET),
            tuple(v for k, v in items if k == EXTRA_KEPT))
