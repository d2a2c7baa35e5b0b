"""Probe specs and results as data, and the pure parser from a finished worker to a result.

Nothing here starts a process: `resilient_strategy.probing.proc` runs workers and
`resilient_strategy.probing.prober` ties the two together. Workers (``probing/workers/``) write one JSON
object per rank; `parse_probe` turns exit codes, signals, those JSON texts and stderr into a
`ProbeResult`, and is tested from strings.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any, Protocol, TypeVar

from ...errors import FileFormatError
from ..knowledge import nccldiag
from ..knowledge.causes import CAUSES as CAUSES  # re-exported: the causes' long-standing home
from ..knowledge.causes import ENVIRONMENTAL_CAUSES as ENVIRONMENTAL_CAUSES
from ..knowledge.causes import HANG_WORDS as HANG_WORDS
from ..knowledge.signatures import Signatures, builtin_signatures
from ..values.bounded import parse_json
from ..values.candidate import CandidateKey
from ..values.outcome import WorkerOutcome


class Stall(Protocol):
    """What `resilient_strategy.records.progress.Stall` offers here (the planner imports this
    module, and must not reach ``progress``, which uses ``os``)."""

    @property
    def kind(self) -> str: ...

    @property
    def ranks(self) -> tuple[int, ...]: ...

    @property
    def waited_s(self) -> float: ...

    @property
    def limit_s(self) -> float: ...

    def where(self) -> str: ...

    def describe(self) -> str: ...

#: Probe statuses.
OK, ERROR, TIMEOUT = "ok", "error", "timeout"
#: ``extra`` keys of a probe cut while its host was too busy to run it (`probing.cost.host_busy`,
#: issue 41): the share of a CPU its most starved worker got, and the deadline it was retried
#: with. A failure so marked is load, not the transport's: never cached (`deciding.cache`).
HOST_BUSY, BUSY_RETRIED = "host_busy", "busy_retried"

@dataclass(frozen=True)
class ProbeSpec:
    """What to prove: a candidate run by ``world_size`` processes (1 for TF single-process)."""

    candidate: str  # the candidate's key
    framework: str
    backend: str
    devices: tuple[int, ...]
    env: tuple[tuple[str, str], ...] = ()
    world_size: int = 1
    timeout_s: float = 30.0
    message_bytes: int = 16 << 20  # all-reduce size for the bandwidth figure
    check_bytes: tuple[int, ...] = ()  # more sizes to check exactly (the user's largest bucket)
    train_step: bool = True
    logical_cpus: int = 0  # TF: replicas on N logical CPU devices (testing without GPUs)
    #: TF multi-worker (TF_CONFIG): the workers that each run this probe's one local process
    #: together, and this one's id; 1: an ordinary probe on this machine
    workers: int = 1
    worker_rank: int = 0
    #: A sharded candidate (FSDP2): the workers also prove all-gather and reduce-scatter,
    #: value-checked at the sizes FSDP sends, and take a sharded training step.
    sharded: bool = False

    @property
    def identity(self) -> CandidateKey:
        """The candidate's key as a value (its marks: sharded, offloaded, node 0 alone)."""
        return CandidateKey.parse(self.candidate)


@dataclass(frozen=True)
class ProbeResult:
    """The outcome of one probe. ``cause`` is a key of `CAUSES` (``""`` when ok)."""

    candidate: str
    status: str  # OK / ERROR / TIMEOUT
    elapsed_s: float = 0.0
    cause: str = ""
    detail: str = ""
    stderr_tail: str = ""
    bus_bandwidth_gbps: float | None = None  # measured at message_bytes
    message_bytes: int | None = None
    #: the spread of the timed all-reduces, relative: (slowest - fastest) / median; a speed
    #: difference smaller than this is noise (see the planner's ranking)
    bandwidth_spread: float | None = None
    step_seconds: float | None = None  # one training step after warm-up
    ranks: int = 1
    extra: tuple[tuple[str, str], ...] = field(default=())
    #: where the time went: (phase, seconds from the first worker's start when the slowest rank
    #: reached it), in order - started, imported, comm_ready, checked, measured, stepped, ...
    phases: tuple[tuple[str, float], ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.status == OK

    def why(self) -> str:
        """One line: the cause in words plus the detail."""
        words = HANG_WORDS if judged_hang(self) else CAUSES.get(self.cause, self.cause)
        said = dict(self.extra).get("unplaced")
        if said is not None:
            quoted = f': "{said}"' if said and said != "(no output)" else ""
            words += (f"{quoted} (no entry of the signature table places its text; "
                      "RESILIENT_STRATEGY_SIGNATURES adds one)")
        if self.detail and self.detail not in words:
            return f"{words}: {self.detail}" if words else self.detail
        return words

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ProbeResult:
        """Build a result from plain data (JSON), checking every field.

        Unknown keys are ignored (a newer writer may add some). Raises `ValueError` for
        anything else that is not what `to_dict` writes: a missing candidate or status, an
        unknown status or cause, a wrong type, a negative or non-finite number.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"a probe result must be an object, not {type(d).__name__}")
        for name in ("candidate", "status"):
            if name not in d:
                raise ValueError(f"a probe result needs {name!r}")
        status = _text(d, "status")
        if status not in _STATUSES:
            raise ValueError(f"status {status!r} is not one of {sorted(_STATUSES)}")
        cause = _text(d, "cause")
        if cause not in CAUSES:
            raise ValueError(f"cause {cause!r} is not a known cause")
        extra = d.get("extra", ())
        if not isinstance(extra, (list, tuple)) or not all(
            isinstance(x, (list, tuple)) and len(x) == 2 and all(isinstance(y, str) for y in x)
            for x in extra
        ):
            raise ValueError(f"extra must be a list of [name, value] strings, not {extra!r}")
        return cls(
            candidate=_text(d, "candidate"),
            status=status,
            elapsed_s=_number(d, "elapsed_s", 0.0),
            cause=cause,
            detail=_text(d, "detail"),
            stderr_tail=_text(d, "stderr_tail"),
            bus_bandwidth_gbps=_maybe(d, "bus_bandwidth_gbps", _number),
            message_bytes=_maybe(d, "message_bytes", _count),
            bandwidth_spread=_maybe(d, "bandwidth_spread", _number),
            step_seconds=_maybe(d, "step_seconds", _number),
            ranks=_count(d, "ranks", 1),
            extra=tuple((str(k), str(v)) for k, v in extra),
            phases=_phases(d.get("phases", ())),
        )


def _phases(value: Any) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str)
        and isinstance(x[1], (int, float)) and not isinstance(x[1], bool)
        and math.isfinite(x[1]) and x[1] >= 0 for x in value
    ):
        raise ValueError(f"phases must be a list of [name, seconds], not {value!r}")
    return tuple((str(k), float(v)) for k, v in value)


def phase_times(outcomes: Sequence[WorkerOutcome], started_at: float
                ) -> tuple[tuple[str, float], ...]:
    """Where a probe's time went, from the ``phase_at`` marks its workers reported (monotonic
    seconds, one clock for every process of the machine): per phase, the seconds from
    ``started_at`` until the slowest rank reached it, in time order. Ranks without marks (no
    report, an older worker) are left out; nothing here raises."""
    latest: dict[str, float] = {}
    for o in outcomes:
        try:
            rep = parse_json(o.report, f"report of rank {o.rank}", allow_nan=True) \
                if o.report.strip() else {}
        except (FileFormatError, ValueError):
            continue
        marks = rep.get("phase_at") if isinstance(rep, dict) else None
        if not isinstance(marks, dict):
            continue
        for name, at in marks.items():
            if (isinstance(name, str) and isinstance(at, (int, float))
                    and not isinstance(at, bool) and math.isfinite(at) and at >= started_at):
                latest[name] = max(latest.get(name, 0.0), at - started_at)
    return tuple(sorted(((k, round(v, 3)) for k, v in latest.items()), key=lambda kv: kv[1]))


_STATUSES = frozenset({OK, ERROR, TIMEOUT})
#: Causes of a collective that completed with bad values (each its own cause).
VALUE_CAUSES = ("wrong_result", "nan_result", "zero_result")
_T = TypeVar("_T", int, float)


def _text(d: Mapping[str, Any], name: str) -> str:
    value = d.get(name, "")
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, not {value!r}")
    return value


def _number(d: Mapping[str, Any], name: str, default: float) -> float:
    """A finite, non-negative number."""
    value = d.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, not {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and non-negative, not {value!r}")
    return float(value)


def _count(d: Mapping[str, Any], name: str, default: int) -> int:
    """A non-negative integer."""
    value = d.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, not {value!r}")
    return value


def _maybe(
    d: Mapping[str, Any], name: str, read: Callable[[Mapping[str, Any], str, _T], _T]
) -> _T | None:
    """An optional field: None when absent or null, else what ``read`` makes of it."""
    return None if d.get(name) is None else read(d, name, 0)


# --------------------------------------------------------------------------------------------
# Classification of failure text (pure)
# --------------------------------------------------------------------------------------------
def classify(text: str, signatures: Signatures | None = None) -> str:
    """The cause that best explains a failure's text, from the signature table
    (``signatures.toml``; "worker_error" when no entry places it)."""
    return (signatures or builtin_signatures()).classify(text)


def tail(text: str, lines: int = 20, chars: int = 4000) -> str:
    """The last lines of a text, bounded in size."""
    return "\n".join(text.rstrip().splitlines()[-lines:])[-chars:]


def parse_probe(
    spec: ProbeSpec,
    outcomes: Sequence[WorkerOutcome],
    elapsed_s: float,
    timed_out: bool,
    stall: Stall | None = None,
    signatures: Signatures | None = None,
) -> ProbeResult:
    """Turn what every worker did into one result (`_verdict`), with what the workers said of
    how they ran in its ``extra``: the rendezvous store (``rendezvous``), and NCCL's own
    diagnostics (`nccldiag`: the variables set or kept, the report lines). Those never change
    the verdict. Pure."""
    result = _verdict(spec, outcomes, elapsed_s, timed_out, stall, signatures)
    said = _how_they_ran(outcomes)
    return replace(result, extra=(*result.extra, *said)) if said else result


def _how_they_ran(outcomes: Sequence[WorkerOutcome]) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    for o in outcomes:
        try:
            rep = parse_json(o.report, "report", allow_nan=True) if o.report.strip() else {}
        except FileFormatError:
            continue
        if not isinstance(rep, dict):
            continue
        store = rep.get("rendezvous")
        if isinstance(store, dict) and not any(k == "rendezvous" for k, _ in out):
            kind = str(store.get("store", "?"))[:40]
            out.append(("rendezvous", f"{kind} libuv" if store.get("libuv") is True else kind))
        diag = rep.get("nccl_diagnostics")
        if isinstance(diag, dict) and not any(k == nccldiag.EXTRA_SET for k, _ in out) \
                and not any(k == nccldiag.EXTRA_KEPT for k, _ in out):
            for key, name in ((nccldiag.EXTRA_SET, "set"), (nccldiag.EXTRA_KEPT, "kept")):
                values = diag.get(name)
                if isinstance(values, list):
                    out += [(key, str(v)[:200]) for v in values[:8]]
    lines: list[str] = []
    for o in outcomes:
        lines += nccldiag.report_lines(o.stdout + "\n" + o.stderr,
                                       nccldiag.MAX_LINES - len(lines))
    return (*out, *((nccldiag.EXTRA_LINE, line) for line in lines))


def _verdict(
    spec: ProbeSpec,
    outcomes: Sequence[WorkerOutcome],
    elapsed_s: float,
    timed_out: bool,
    stall: Stall | None = None,
    signatures: Signatures | None = None,
) -> ProbeResult:
    """Turn what every worker did into one result. Pure. Failure text is placed on a cause by
    ``signatures`` (the built-in table when None); text no entry places stays ``worker_error``
    and the result's ``extra`` quotes the line it could not place (``unplaced``).

    Order of blame: the worker whose failure stopped the group (its peers' errors, such as
    "connection reset by peer", are only echoes of it); then a worker that reported an error or
    wrong value; then a worker that died on its own; then a stall the runner judged from the
    workers' progress (a hang, cut before the deadline: its ``extra`` says where); then the
    deadline. A probe is OK only when
    every rank reported ``ok`` and its checked value, and exited 0.
    """
    reports: list[dict[str, Any]] = []
    for o in outcomes:
        try:
            rep = parse_json(o.report, f"report of rank {o.rank}", allow_nan=True) if o.report.strip() else {}
        except FileFormatError:  # not JSON, or nested too deep
            rep = {"status": "error", "error": f"unreadable report: {o.report[:200]!r}"}
        reports.append(rep if isinstance(rep, dict) else {})
    stderr_all = "\n".join(f"[rank {o.rank}] {line}" for o in outcomes
                           for line in tail(o.stderr, 8).splitlines() if line)
    table = signatures or builtin_signatures()
    base = partial(ProbeResult, candidate=spec.candidate, elapsed_s=round(elapsed_s, 3),
                   stderr_tail=tail(stderr_all, 30), ranks=len(outcomes))

    # 0. the rank whose failure stopped the group
    first = _first_failure(outcomes, reports)
    if first is not None:
        found = (_reported(outcomes[first], reports[first], base, table)
                 or _died(outcomes[first], base, table))
        if found is not None:
            return found
    # 1. a rank that said what went wrong
    for o, rep in zip(outcomes, reports, strict=True):
        found = _reported(o, rep, base, table)
        if found is not None:
            return found
    # 2. a rank that died on its own (not killed by us)
    for o in outcomes:
        found = _died(o, base, table)
        if found is not None:
            return found
    # 3. a hang judged from progress records, or the deadline
    if stall is not None:
        return base(status=TIMEOUT, cause="timeout", detail=f"hang: {stall.describe()}",
                    extra=stall_extra(stall))
    if timed_out:
        waiting = [o.rank for o, rep in zip(outcomes, reports, strict=True) if rep.get("status") != "ok"]
        return base(status=TIMEOUT, cause="timeout",
                           detail=f"ranks {waiting} did not finish within {spec.timeout_s:g} s")
    # 4. everyone must have reported ok
    missing = [o.rank for o, rep in zip(outcomes, reports, strict=True) if rep.get("status") != "ok"]
    if missing or not outcomes:
        return base(status=ERROR, cause="worker_error",
                           detail=f"ranks {missing} exited without a report")
    bws = [v for r in reports if (v := _positive(r.get("bus_bandwidth_gbps"))) is not None]
    spreads = [v for r in reports if (v := _positive(r.get("bandwidth_spread"))) is not None]
    steps = [v for r in reports if (v := _positive(r.get("step_seconds"))) is not None]
    message_bytes = reports[0].get("message_bytes")
    return base(
        status=OK,
        bus_bandwidth_gbps=round(min(bws), 3) if bws else None,
        bandwidth_spread=round(max(spreads), 3) if spreads and bws else None,
        message_bytes=message_bytes if isinstance(message_bytes, int)
        and not isinstance(message_bytes, bool) and message_bytes > 0 else None,
        step_seconds=round(max(steps), 6) if steps else None,
        detail=str(reports[0].get("detail", "")),
    )


_Make = Callable[..., ProbeResult]


def _first_failure(outcomes: Sequence[WorkerOutcome], reports: Sequence[Mapping[str, Any]]
                   ) -> int | None:
    """The index of the rank whose failure stopped the group. The runner names the one it saw
    exit first, but it sees exits in one sweep of polls: an echo (a peer's "connection reset"
    after the failing rank exited) can exit between two polls and be seen first. A worker's
    failure report carries when it failed (``failed_at``, the monotonic clock, one per host),
    so the earliest failure reported wins over the runner's pick; a rank that died without a
    report (it could not say when) keeps the runner's pick."""
    picked = next((i for i, o in enumerate(outcomes) if o.failed_first), None)
    if picked is None or not reports[picked]:
        return picked
    times = [(t, i) for i, rep in enumerate(reports)
             if rep.get("status") not in (None, "ok")
             and (t := _positive(rep.get("failed_at"))) is not None]
    return min(times)[1] if times else picked


def stall_extra(stall: Stall) -> tuple[tuple[str, str], ...]:
    """A stall as ``extra`` entries of a result (cached with it)."""
    return (("hang", stall.kind), ("hang_at", stall.where()),
            ("hang_ranks", ",".join(map(str, stall.ranks))),
            ("hang_waited_s", f"{stall.waited_s:g}"), ("hang_limit_s", f"{stall.limit_s:g}"))


def judged_hang(result: ProbeResult) -> bool:
    """Whether a timeout was judged from progress (a real hang), not by the deadline alone."""
    return result.status == TIMEOUT and any(k == "hang" for k, _ in result.extra)


def _positive(value: Any) -> float | None:
    """A worker's figure when it is a finite positive number, else None (never NaN or a str)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def _reported(o: WorkerOutcome, rep: Mapping[str, Any], base: _Make,
              table: Signatures) -> ProbeResult | None:
    """The result a worker's own error report gives, if it made one."""
    err = str(rep.get("error", ""))
    if rep.get("status") == "wrong_result":
        reported = rep.get("cause")
        cause = reported if reported in VALUE_CAUSES else "wrong_result"
        return base(status=ERROR, cause=cause, detail=f"rank {o.rank}: {_first_line(err)}")
    if rep.get("status") == "error":
        reported = rep.get("cause")
        if isinstance(reported, str) and reported in CAUSES and reported:
            return base(status=ERROR, cause=reported, detail=f"rank {o.rank}: {_summary(err)}")
        text = err + "\n" + o.stderr
        return base(status=ERROR, cause=table.classify(text),
                    detail=f"rank {o.rank}: {_summary(err)}", extra=_unplaced(table, text))
    return None


def _died(o: WorkerOutcome, base: _Make, table: Signatures) -> ProbeResult | None:
    """The result of a worker that ended badly on its own (not stopped by the runner)."""
    if o.status_lost and not o.killed_by_runner:  # how it ended is unknown: no verdict
        return base(status=ERROR, cause="status_lost",
                    detail=f"rank {o.rank}'s exit status was taken by another reaper in the "
                    "deciding process (a SIGCHLD handler that waits for every child)")
    if o.killed_by_runner or o.returncode == 0:
        return None
    if o.signal is not None:
        entry = table.for_signal(o.signal)
        return base(status=ERROR, cause="crash" if entry is None else entry.cause,
                    detail=f"rank {o.rank} died from signal {o.signal}")
    if o.returncode is None:
        return None
    return base(status=ERROR, cause=table.classify(o.stderr),
                detail=f"rank {o.rank} exited with code {o.returncode}: "
                       f"{_first_line(_last_error_line(o.stderr))}",
                extra=_unplaced(table, o.stderr))


def _unplaced(table: Signatures, text: str) -> tuple[tuple[str, str], ...]:
    """``(("unplaced", line),)`` quoting the most telling line of a failure no signature
    places (`telling_line`), else ()."""
    if table.match(text) is not None:
        return ()
    line = telling_line(text)
    return (("unplaced", line),) if line else (("unplaced", "(no output)"),)


#: The most characters of a quoted line (`telling_line`): a short line keeps room for it.
TELLING_CHARS = 120
_NCCL_WARN = re.compile(r"NCCL WARN\s+(\S.*)")
#: The last line of a Python traceback: the exception's (qualified) class, then its message.
_EXCEPTION_LINE = re.compile(
    r"^\s*((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Fault|Failure))"
    r"(?::\s*(\S.*))?$")


def telling_line(text: str, limit: int = TELLING_CHARS) -> str:
    """The one line of a failing process's output that tells most, verbatim and short (at
    most ``limit`` characters, whole words): NCCL's first ``NCCL WARN`` (its message, the
    root of what follows), else the last exception line of a traceback ("OSError: [Errno 28]
    No space left on device"), else the last line naming an error (`_last_error_line`,
    never a framework's INFO or WARNING banner), else the last line; "" for no output. Pure."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return ""
    warned = next((m.group(1) for ln in lines if (m := _NCCL_WARN.search(ln))), None)
    if warned is not None:
        found = f"NCCL WARN {warned}"
    else:
        found = next((ln for ln in reversed(lines) if _EXCEPTION_LINE.match(ln)
                      and not _LOG_BANNER.match(ln)), "") or _last_error_line(text).strip()
    return _short(found, limit)


def names_the_error(line: str) -> bool:
    """Whether a `telling_line` is NCCL's WARN or an exception's line (not merely a last line
    of output). Pure."""
    return line.startswith("NCCL WARN") or _EXCEPTION_LINE.match(line) is not None


def _short(line: str, limit: int) -> str:
    """``line`` (one line) cut to ``limit`` characters at a word, "..." where cut."""
    line = " ".join(line.split())
    if len(line) <= limit:
        return line
    cut = line[: limit - 3].rsplit(" ", 1)[0] if " " in line[: limit - 3] else line[: limit - 3]
    return cut + "..."


_NCCL_LAST_ERROR = re.compile(r"^\s*Last error:\s*\n\s*(\S.*)$", re.M)


def _summary(err: str) -> str:
    """The error's first line, plus NCCL's "Last error:" line: the one that names the culprit
    (``Unrecognized element token "bogus"``, ``Bootstrap : no socket interface found``)."""
    first = _first_line(err)
    if first.startswith("Traceback (most recent call last)") or _LOG_BANNER.match(first):
        first = telling_line(err, 300) or first
    last = _NCCL_LAST_ERROR.search(err)
    return f"{first} [NCCL: {last.group(1).strip()[:200]}]" if last else first


def _first_line(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


#: A framework's own INFO / WARNING log line (absl / glog as TensorFlow and XLA print them:
#: "2026-11-25 18:00:00.123: I tensorflow/...", "W0000 00:00:...", "I1125 18:00:00.1 ..."): a
#: banner such as oneDNN's ("... round-off errors ...") is never the reason a worker failed.
_LOG_BANNER = re.compile(r"^\s*(?:\d{4}-\d\d-\d\d[ T][\d:.]+: [IW] |[IW]\d{4} [\d:.]+ )")
_ERROR_WORD = re.compile(r"Error\b|Exception\b|\berror\b|\bfailed\b", re.I)


def _last_error_line(text: str) -> str:
    """The last line that names an error, skipping the frameworks' INFO / WARNING log lines."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and not _LOG_BANNER.match(ln)]
    for line in reversed(lines):
        if _ERROR_WORD.search(line):
            return line
    return lines[-1] if lines else ""
