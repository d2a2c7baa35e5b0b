"""After a hung GPU probe was killed: does every GPU it used still work?

A killed NCCL job can leave a GPU that no longer initializes or hangs in its first kernel until
it is reset. Training on it would hang again, so :func:`check_after` runs a fresh process
(``probes/health_worker``) under a deadline that initializes each GPU in turn and runs a kernel
whose result it checks; a GPU that fails, or the one it was on when the deadline passed, is
named in a :class:`~resilient_strategy.errors.GpuUnusableError`.

The decisions (:func:`needs_check`, :func:`broken_gpus`) are pure and tested without GPUs; the
check itself runs only where a probe used real GPUs.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..core.probe import ERROR, TIMEOUT, ProbeResult, ProbeSpec
from ..errors import GpuUnusableError
from . import proc as _proc

#: The directory that holds the ``resilient_strategy`` package, for the worker's PYTHONPATH.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
#: Seconds the whole check may take: a framework import plus CUDA initialization of each GPU
#: (a healthy GPU initializes in well under a second; a broken one hangs or fails).
HEALTH_TIMEOUT_S = 30.0


def needs_check(spec: ProbeSpec, result: ProbeResult) -> bool:
    """Whether ``result`` may have left a GPU broken: a probe on real GPUs whose workers were
    killed (a hang) or died from a signal."""
    on_gpus = bool(spec.devices) and not spec.logical_cpus and spec.backend != "cpu"
    killed = result.status == TIMEOUT or (result.status == ERROR and result.cause == "crash")
    return on_gpus and killed


def broken_gpus(devices: Sequence[int], report: str, timed_out: bool,
                returncode: int | None) -> list[tuple[int, str]]:
    """The GPUs the health worker's report (JSON) shows broken, each with what went wrong.

    The worker checks ``devices`` in order and rewrites its report after each; a GPU it never
    reported on is blamed only when the check was cut (deadline) or died while on it.
    """
    try:
        data = json.loads(report) if report.strip() else {}
    except json.JSONDecodeError:
        data = {}
    gpus: Mapping[str, Any] = data.get("gpus", {}) if isinstance(data, dict) else {}
    out: list[tuple[int, str]] = []
    for d in devices:
        entry = gpus.get(str(d))
        if isinstance(entry, dict):
            if not entry.get("ok"):
                out.append((d, str(entry.get("error", "failed"))[:300]))
            continue
        current = data.get("current") if isinstance(data, dict) else None
        if current == d:
            why = ("did not initialize or finish a kernel within the health check's deadline"
                   if timed_out else f"the check died on it (exit {returncode})")
            out.append((d, why))
        elif not data and (timed_out or returncode):
            # nothing reported at all: the framework import itself hung or died
            return []
    return out


def check_after(spec: ProbeSpec, result: ProbeResult, env: Mapping[str, str], *,
                python: str = sys.executable, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Raise :class:`GpuUnusableError` when ``result`` left a GPU of ``spec`` unusable."""
    if not needs_check(spec, result):
        return
    broken = run_check(spec.framework, spec.devices, env, python=python, timeout_s=timeout_s)
    if broken:
        raise GpuUnusableError(broken, after=f"the hung probe of {spec.candidate} was killed")


def run_check(framework: str, devices: Sequence[int], env: Mapping[str, str], *,
              python: str = sys.executable, timeout_s: float = HEALTH_TIMEOUT_S,
              ) -> list[tuple[int, str]]:
    """Check each GPU in a fresh process; the broken ones with why."""
    wenv = dict(env)
    existing = env.get("PYTHONPATH", "")
    wenv["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT, existing]) if existing else PACKAGE_ROOT
    with tempfile.TemporaryDirectory(prefix="rs-health-", ignore_cleanup_errors=True) as tmp:
        report = str(Path(tmp) / "health.json")
        argv = (python, "-m", "resilient_strategy.probing.workers.health_worker", "--framework", framework,
                "--devices", ",".join(map(str, devices)), "--report", report,
                "--parent-pid", str(os.getpid()))
        cmd = _proc.WorkerCommand(argv=argv, env=wenv, cwd=tmp, report_path=report)
        try:
            group = _proc.run_group([cmd], timeout_s)
        except OSError as exc:
            return [(d, f"the health check could not start: {exc}") for d in devices]
    o = group.outcomes[0]
    return broken_gpus(devices, o.report, group.timed_out, o.returncode)
