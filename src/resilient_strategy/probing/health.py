"""After a hung GPU probe was killed: does every GPU it used still work?

A killed NCCL job can leave a GPU that no longer initializes or hangs in its first kernel until
it is reset. Training on it would hang again, so `check_after` runs a fresh process
(``probing/workers/health_worker``) under a deadline that initializes each GPU in turn and runs a kernel
whose result it checks; a GPU that fails, or the one it was on when the deadline passed, is
named in a `GpuUnusableError`.

The decisions (`needs_check`, `broken_gpus`, `Unproven`) are pure and tested
without GPUs; the check itself runs only where a probe used real GPUs.

Within one decision the check is deferred (issue 21: three hung GPU probes cost three checks,
12 s of a 42 s worst case): a killed probe leaves its GPUs *unproven* (`Unproven`); a
later probe that passes on a GPU proves it (it initialised it and ran checked collectives and
kernels on it, which is what the check does); a later probe that fails or hangs before its
devices are ready on an unproven GPU is checked at once (a wedged GPU is named, not turned into
a chain of hangs); before the decision returns, one check covers the GPUs still unproven
(`Unproven.final`). Nothing trains on a GPU a killed probe may have broken without proof.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.measures.probe import ERROR, OK, TIMEOUT, ProbeResult, ProbeSpec
from ..errors import GpuUnusableError
from . import proc

#: The directory that holds the ``resilient_strategy`` package, for the worker's PYTHONPATH.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
#: Seconds the whole check may take: a framework import plus CUDA initialization of each GPU
#: (a healthy GPU initializes in well under a second; a broken one hangs or fails).
HEALTH_TIMEOUT_S = 30.0


def gpus_of(spec: ProbeSpec) -> tuple[int, ...]:
    """The real GPUs a probe runs on (none for CPU, logical CPUs or the ``cpu`` backend)."""
    on_gpus = bool(spec.devices) and not spec.logical_cpus and spec.backend != "cpu"
    return tuple(spec.devices) if on_gpus else ()


def killed(result: ProbeResult) -> bool:
    """Whether a probe's workers were killed (a hang) or died from a signal."""
    return result.status == TIMEOUT or (result.status == ERROR and result.cause == "crash")


def needs_check(spec: ProbeSpec, result: ProbeResult) -> bool:
    """Whether ``result`` may have left a GPU broken: a probe on real GPUs whose workers were
    killed (a hang) or died from a signal."""
    return bool(gpus_of(spec)) and killed(result)


#: Hangs judged once every rank was past its device: in communicator set-up, inside a
#: collective, or silent after the communicator was ready (see `records.progress.Stall`).
#: A ``straggler`` (ranks that never arrived, e.g. stuck initialising a wedged GPU) is not.
READY_HANGS = frozenset({"setup", "collective", "quiet"})
#: The progress phase a worker records once its device is initialised.
DEVICE_READY = "device_ready"


def devices_ready(result: ProbeResult) -> bool:
    """Whether every rank of a probe had its device initialised: it passed, its phases show
    ``device_ready``, or its hang was judged past that point (`READY_HANGS`). Unknown
    (an error without phases, a hang only the deadline cut, a straggler) counts as not."""
    if result.status == OK or any(name == DEVICE_READY for name, _ in result.phases):
        return True
    return result.status == TIMEOUT and dict(result.extra).get("hang") in READY_HANGS


@dataclass
class Unproven:
    """The GPUs of one decision that a killed probe may have broken and nothing proved since.

    Pure: `after_probe` says which GPUs to check now, `checked` records a healthy
    check, `final` splits what is left before the decision returns."""

    gpus: set[int] = field(default_factory=set)
    #: the probes that left GPUs unproven, for the trace and the error (candidate keys)
    by: list[str] = field(default_factory=list)
    #: whether a killed probe was already checked at once in this decision (the first hang is:
    #: a wedged GPU is named before any hung variant is tried on it; later hangs are deferred)
    hung_once: bool = False

    def after_probe(self, spec: ProbeSpec, result: ProbeResult,
                    can_check_now: bool = True) -> tuple[int, ...]:
        """Take in one probe's result; the GPUs to check right now (else ``()``).

        A probe on an unproven GPU that failed or hung before its devices were ready is checked
        at once: its own GPUs and the unproven ones (a broken GPU must be named as such, and the
        next candidate would hang on it again). The first killed probe of a decision is checked
        at once too (issue 31): a silent hang is followed by a search over hung variants, and a
        wedged GPU must end it after one hang, not after two. A probe that passed proves its
        GPUs; a later killed one leaves its GPUs unproven until a later probe or the final check
        proves them."""
        mine = gpus_of(spec)
        if not mine:
            return ()
        if result.status == OK:
            self.gpus -= set(mine)
            return ()
        suspects = self.gpus & set(mine)
        if suspects and not devices_ready(result):
            return tuple(sorted(suspects | (set(mine) if killed(result) else set())))
        # the first hang: checked between variants, where the check fits the probe budget
        # (``can_check_now``; else deferred like any later hang)
        if killed(result) and not self.hung_once and can_check_now:
            self.hung_once = True
            self.by.append(spec.candidate)
            return tuple(sorted(set(mine) | suspects))
        if killed(result):
            self.gpus |= set(mine)
            self.by.append(spec.candidate)
        return ()

    def checked(self, gpus: Sequence[int]) -> None:
        """A health check found ``gpus`` working: they are proven."""
        self.gpus -= set(gpus)

    def final(self, chosen: Sequence[int], affordable: bool) -> tuple[tuple[int, ...],
                                                                      tuple[int, ...]]:
        """Before the decision returns: (the GPUs to check, the GPUs left unchecked). The chosen
        candidate's unproven GPUs are always checked; the other unproven ones too, unless
        checking them is not ``affordable`` (it would overrun the probe budget): those are
        left unchecked, and the caller says so in the trace."""
        mine = self.gpus & set(chosen)
        rest = self.gpus - mine
        if affordable:
            return tuple(sorted(self.gpus)), ()
        return tuple(sorted(mine)), tuple(sorted(rest))


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
    """Raise `GpuUnusableError` when ``result`` left a GPU of ``spec`` unusable."""
    if not needs_check(spec, result):
        return
    broken = run_check(spec.framework, spec.devices, env, python=python, timeout_s=timeout_s)
    if broken:
        raise GpuUnusableError(broken, after=f"the hung probe of {spec.candidate} was killed")


def run_check(framework: str, devices: Sequence[int], env: Mapping[str, str], *,
              python: str = sys.executable, timeout_s: float = HEALTH_TIMEOUT_S,
              spawn: proc.Spawn | None = None) -> list[tuple[int, str]]:
    """Check each GPU in one process (a fresh one, or one ``spawn`` starts: a worker forked
    from the deciding process, which never touched a GPU); the broken ones with why."""
    wenv = dict(env)
    existing = env.get("PYTHONPATH", "")
    wenv["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT, existing]) if existing else PACKAGE_ROOT
    with tempfile.TemporaryDirectory(prefix="rs-health-", ignore_cleanup_errors=True) as tmp:
        report = str(Path(tmp) / "health.json")
        argv = (python, "-m", "resilient_strategy.probing.workers.health_worker", "--framework", framework,
                "--devices", ",".join(map(str, devices)), "--report", report,
                "--parent-pid", str(os.getpid()))
        cmd = proc.WorkerCommand(argv=argv, env=wenv, cwd=tmp, report_path=report)
        try:
            group = proc.run_group([cmd], timeout_s, spawn=spawn)
        except OSError as exc:
            return [(d, f"the health check could not start: {exc}") for d in devices]
    o = group.outcomes[0]
    return broken_gpus(devices, o.report, group.timed_out, o.returncode)
