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

from ...core.call.probe_fault import PROBE_FAULT_VAR, PROBE_FAULTS, parse_probe_fault
from ...errors import InvalidOptionError
from ...machine.files import write_json_atomic

FAULT_VAR = PROBE_FAULT_VAR
#: ``hang``: sleep forever before the first collective (communicator ready); ``hang_setup``:
#: inside communicator setup; ``hang_rendezvous``: inside the store rendezvous (torch);
#: ``hang_collective``: inside collective 1; ``hang_broadcast`` / ``hang_gather``: inside the
#: first broadcast / all-gather (torch); ``exit``: exit 1 without a report; ``wrong`` / ``nan``
#: / ``zero``: corrupt the all-reduce (one value off by one, a NaN in the contribution, a chunk
#: of the result zeroed as a broken peer copy would leave it); ``wrong_broadcast`` /
#: ``wrong_gather``: one value of what a broadcast / all-gather returned off by one (torch).
FAULTS = PROBE_FAULTS
HANGS = ("hang", "hang_setup", "hang_rendezvous", "hang_collective", "hang_broadcast",
         "hang_gather")
#: Causes of a collective that completed with bad values.
VALUE_CAUSES = ("wrong_result", "nan_result", "zero_result")


#: Sizes every multi-rank probe checks exactly, in bytes: the old 1,024-element check, below
#: the 512 KiB where NCCL 2.26.2 failed on RTX PRO 6000, 1 MiB (DDP's first bucket) and DDP's
#: 25 MiB default bucket. ``--check-bytes`` adds more (the user's largest gradient bucket).
CHECK_BYTES = (4 << 10, 256 << 10, 1 << 20, 25 << 20)
CHECK_ITERS = 3  # iterations per size (each with different contributions)
#: Iterations per size of the broadcasts and all-gathers every process-group probe checks (two:
#: the second's values differ from the first's, so a stale buffer shows, and a broadcast comes
#: from two roots; gloo's all-gather of 25 MiB takes ~0.1 s on a loaded 2-core host).
OTHER_ITERS = 2
MAX_CHECK_BYTES = 256 << 20
#: The contributions are multiples of the pattern 1..PATTERN_MOD: rank r adds
#: (r + 1 + it * world) x pattern in iteration it, so each sum is exact in float32 (below 2**24)
#: for up to 8 ranks and 16 iterations, and differs from every other iteration's.
PATTERN_MOD = 509
STEP_ALLOW_S = 20.0  # DDP construction and first step (bucket building; slow on a loaded host): a
#: hang there is rare, and the checked all-reduces before it catch a broken transport in seconds


def check_sizes(extra: str) -> list[int]:
    """The sizes to check: `CHECK_BYTES` plus the valid ones in ``extra``, sorted."""
    sizes = set(CHECK_BYTES)
    for part in extra.split(","):
        if part.strip().isdigit() and 4 <= int(part) <= MAX_CHECK_BYTES:
            sizes.add(int(part) // 4 * 4)
    return sorted(sizes)


def contribution(rank: int, world: int, it: int) -> int:
    return rank + 1 + it * world


def expected_sum(world: int, it: int) -> int:
    return sum(contribution(r, world, it) for r in range(world))


def spread(times: list[float]) -> float:
    """(slowest - fastest) / median of timed repetitions: the measured noise, relative."""
    if len(times) < 2:
        return 0.0
    ordered = sorted(times)
    median = ordered[len(ordered) // 2]
    return (ordered[-1] - ordered[0]) / median if median > 0 else 0.0


def record_bandwidth(report: dict[str, Any], message_bytes: int, nbytes: int, per_op: float,
                     noise: float, ranks: int) -> str:
    """The timed all-reduce's bus bandwidth (nccl-tests' busbw: bytes / time x 2(n-1)/n) and
    its spread, written into ``report``; the phrase for the probe's detail."""
    gbps = nbytes / per_op * 2 * (ranks - 1) / ranks / 1e9
    report.update(bus_bandwidth_gbps=round(gbps, 3), message_bytes=message_bytes,
                  bandwidth_spread=round(noise, 3))
    return f"{gbps:.2f} GB/s bus at {message_bytes / 2**20:g} MiB"


def human(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} B"


class ProbeFailure(Exception):
    """A failure the worker recognized: carries the report status and the cause key."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause
        self.status = "wrong_result" if cause in VALUE_CAUSES else "error"


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments every worker takes (the runner passes them all)."""
    p.add_argument("--message-bytes", type=int, default=16 << 20)
    p.add_argument("--report", required=True)
    p.add_argument("--no-train-step", dest="train_step", action="store_false")
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--progress", default="", help="this rank's progress record file")
    p.add_argument("--check-bytes", default="",
                   help="extra all-reduce sizes to check exactly (comma-separated bytes)")


#: Variables a remedy candidate sets (see ``plan._REMEDY_FOR_CAUSE``): a worker whose
#: environment sets none of them is plain NCCL, for the ``plain`` qualifier.
REMEDY_VARS = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE")


def _fields(env: Mapping[str, str]) -> list[str]:
    return env.get(FAULT_VAR, "").strip().split(":")


def fault_for(rank: int, env: Mapping[str, str], backend: str = "") -> str:
    """The fault ``env`` injects into ``rank`` (one of `FAULTS`), or "".

    ``kind:rank`` hits every probe; ``kind:rank:backend`` only probes of that backend (e.g.
    ``hang:1:nccl``: NCCL hangs, gloo works); a fourth field narrows it further: ``plain`` hits
    only a worker whose environment sets none of `REMEDY_VARS` (plain NCCL hangs, its
    remedies work), ``>=N`` makes a data fault corrupt only all-reduces of at least N bytes
    (see `corrupts`).
    """
    try:  # the decision refused a malformed one (core/call/arguments.py); none here means none
        fault = parse_probe_fault(env.get(FAULT_VAR, ""))
    except InvalidOptionError:
        return ""
    if fault is None or (fault.backend and fault.backend != backend):
        return ""
    if fault.where == "plain" and any(env.get(v) for v in REMEDY_VARS):
        return ""
    return fault.kind if fault.rank == rank else ""


def _min_bytes(where: str) -> int | None:
    digits = where[2:] if where.startswith(">=") else ""
    return int(digits) if digits.isdigit() else None


DATA_FAULTS = ("wrong", "nan", "zero")


def corrupts(kind: str, env: Mapping[str, str], nbytes: int) -> bool:
    """Whether data fault ``kind`` (from `fault_for`: wrong, nan, zero) corrupts an all-reduce of ``nbytes``:
    always, unless the fault's fourth field is ``>=N`` and ``nbytes`` is below N."""
    if kind not in DATA_FAULTS:
        return False
    fields = _fields(env)
    floor = _min_bytes(fields[3]) if len(fields) > 3 else None
    return floor is None or nbytes >= floor


def act_on_fault(kind: str, rank: int, where: str = "hang") -> None:
    """Hang (when ``kind`` is the hang for ``where``) or exit here when told to; data faults are
    applied by the caller."""
    if kind in HANGS and kind == where:
        print(f"{FAULT_VAR}: rank {rank} hangs ({kind})", file=sys.stderr, flush=True)
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
        report.update(status=exc.status, error=str(exc), cause=exc.cause,
                      failed_at=time.monotonic())
    except BaseException as exc:
        report.update(status="error", error=error_text(exc), failed_at=time.monotonic())
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


def mismatch_failure(where: str, nans: int, zeros: int) -> ProbeFailure:
    """A checked all-reduce that returned wrong values, as its cause: NaNs, zeros where values
    were due (both classic signs of a broken P2P or IOMMU path), else plain wrong values."""
    if nans:
        return ProbeFailure("nan_result", f"{nans} NaN(s) in the {where}")
    if zeros:
        return ProbeFailure("zero_result", f"{zeros} zero(s) in the {where}")
    return ProbeFailure("wrong_result", where)
