"""What the probe workers share: fault injection, typed failures and the atomic JSON report."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from .._files import write_json_atomic

FAULT_VAR = "RESILIENT_STRATEGY_PROBE_FAULT"
FAULTS = ("hang", "exit", "wrong")


class ProbeFailure(Exception):
    """A failure the worker recognized: carries the report status and the cause key."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause
        self.status = "wrong_result" if cause == "wrong_result" else "error"


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments every worker takes (the runner passes them all)."""
    p.add_argument("--message-bytes", type=int, default=16 << 20)
    p.add_argument("--report", required=True)
    p.add_argument("--no-train-step", dest="train_step", action="store_false")
    p.add_argument("--parent-pid", type=int, default=None)


#: Variables a remedy candidate sets (see ``plan._REMEDY_FOR_CAUSE``): a worker whose
#: environment sets none of them is plain NCCL, for the ``plain`` qualifier.
REMEDY_VARS = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE")


def _fields(env: Mapping[str, str]) -> list[str]:
    return env.get(FAULT_VAR, "").strip().split(":")


def fault_for(rank: int, env: Mapping[str, str], backend: str = "") -> str:
    """The fault ``env`` injects into ``rank`` ("hang", "exit", "wrong"), or "".

    ``kind:rank`` hits every probe; ``kind:rank:backend`` only probes of that backend (e.g.
    ``hang:1:nccl``: NCCL hangs, gloo works); a fourth field narrows it further: ``plain`` hits
    only a worker whose environment sets none of :data:`REMEDY_VARS` (plain NCCL hangs, its
    remedies work), ``>=N`` makes a data fault corrupt only all-reduces of at least N bytes
    (see :func:`corrupts`).
    """
    fields = _fields(env)
    kind, who = fields[0], fields[1] if len(fields) > 1 else ""
    only = fields[2] if len(fields) > 2 else ""
    where = fields[3] if len(fields) > 3 else ""
    if kind not in FAULTS or (only and only != backend) or len(fields) > 4:
        return ""
    if where == "plain" and any(env.get(v) for v in REMEDY_VARS):
        return ""
    if where not in ("", "plain") and _min_bytes(where) is None:
        return ""
    try:
        return kind if int(who) == rank else ""
    except ValueError:
        return ""


def _min_bytes(where: str) -> int | None:
    digits = where[2:] if where.startswith(">=") else ""
    return int(digits) if digits.isdigit() else None


def corrupts(kind: str, env: Mapping[str, str], nbytes: int) -> bool:
    """Whether data fault ``kind`` (from :func:`fault_for`) corrupts an all-reduce of ``nbytes``:
    always, unless the fault's fourth field is ``>=N`` and ``nbytes`` is below N."""
    if kind != "wrong":
        return False
    fields = _fields(env)
    floor = _min_bytes(fields[3]) if len(fields) > 3 else None
    return floor is None or nbytes >= floor


def act_on_fault(kind: str, rank: int) -> None:
    """Hang or exit here when told to ("wrong" is applied by the caller to its data)."""
    if kind == "hang":
        print(f"{FAULT_VAR}: rank {rank} hangs", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    if kind == "exit":
        print(f"{FAULT_VAR}: rank {rank} exits with code 1", file=sys.stderr, flush=True)
        os._exit(1)


def error_text(exc: BaseException, frames: int = 6) -> str:
    """``Type: message`` then the last lines of the traceback."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    lines = tb.rstrip().splitlines()
    return f"{type(exc).__name__}: {exc}\n" + "\n".join(lines[-2 * frames:])


def write_report(path: str, report: Mapping[str, Any]) -> None:
    """Write the report atomically: a reader sees the old file, no file, or the whole new one."""
    write_json_atomic(Path(path), report, allow_nan=True, durable=False)


def run_worker(path: str, body: Callable[[dict[str, Any]], None]) -> NoReturn:
    """Run ``body`` (which fills the report), always write the report, then exit hard.

    ``os._exit`` skips interpreter teardown, where a broken NCCL communicator can hang.
    """
    report: dict[str, Any] = {"status": "error", "error": "the probe did not finish"}
    try:
        body(report)
        report["status"] = "ok"
        report.pop("error", None)
    except ProbeFailure as exc:
        report.update(status=exc.status, error=str(exc), cause=exc.cause)
    except BaseException as exc:
        report.update(status="error", error=error_text(exc))
    code = 0 if report["status"] == "ok" else 1
    try:
        write_report(path, report)
    except (OSError, ValueError, TypeError) as exc:
        print(f"cannot write the probe report {path}: {exc}", file=sys.stderr)
        code = 1
    if code:
        print(f"probe failed: {report.get('error', '')}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
