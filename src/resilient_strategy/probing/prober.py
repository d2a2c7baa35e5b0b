"""Run one probe for real: start the workers a spec needs, under its deadline, and parse them.

The environment is the caller's snapshot; nothing here reads ``os.environ``. Workers run in a
fresh private temporary directory (``rs-probe-<pid>-*``), which also holds the reports and the
port of the torch probe's rendezvous store (rank 0 hosts a TCPStore, as a training group's store
is, on a port the kernel picks: nothing to collide with, and it goes with rank 0), and is removed
afterwards, also when a SIGTERM ends this process meanwhile. The first probe of a process sweeps the directories a killed run
of this user left (see `files.sweep_temp_dirs`).

Probes run one at a time. Running independent candidates side by side would disturb each
other's bandwidth figures (the ranking depends on them), and whether a hung NCCL kernel in one
probe disturbs another on the same GPUs can only be measured on GPUs, which has not been done:
until it is, nothing runs concurrently (a later probe saves its framework import by forking
from this process where it is fit, see `forkserver`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from ..core.knowledge.candidate_env import refusal
from ..core.knowledge.signatures import signatures_from_env
from ..core.measures.probe import (
    BUSY_RETRIED,
    ERROR,
    HOST_BUSY,
    TIMEOUT,
    ProbeResult,
    ProbeSpec,
    parse_probe,
    phase_times,
)
from ..errors import InvalidOptionError
from ..machine import files
from ..vocab import PROCESS_GROUP_BACKENDS
from . import health, proc
from .base import Prober
from .cost import (
    busy_retry_timeout,
    got_share,
    health_check_seconds,
    host_busy,
    judged_by_progress,
    stall_policy,
)
from .forkserver import Starter, forks_here

log = logging.getLogger("resilient_strategy")

#: The directory that holds the ``resilient_strategy`` package, for the workers' PYTHONPATH.
PACKAGE_ROOT = health.PACKAGE_ROOT
#: Extra seconds on the workers' own collective timeout, so that the runner's deadline fires first.
WORKER_TIMEOUT_MARGIN_S = 30.0
#: The longest deadline a busy probe's retry gets (`cost.busy_retry_timeout`), and the
#: ``extra`` key that carries it on a result cut while the host was busy.
MAX_BUSY_RETRY_S = 600.0
RETRY_TIMEOUT = "busy_retry_timeout_s"


def run_probe(spec: ProbeSpec, env: Mapping[str, str], *, python: str = sys.executable,
              health_check: bool = True) -> ProbeResult:
    """Prove ``spec`` on this machine within ``spec.timeout_s``; never raises for a failed probe,
    only `GpuUnusableError` when a hung probe on GPUs, once
    killed, left a GPU that no longer initializes or runs a kernel (see `health`).
    ``health_check=False``: the caller defers that check (`health.Unproven`, the
    decision loop's `DeferredHealthProber`) and must run it before using the GPUs."""
    files.TEMP_SWEEP.once()  # what a killed run of ours left (its pid gone, untouched a while)
    result = _run_once(spec, env, python)
    timeout = busy_retry_deadline(result, spec.workers)
    if timeout is not None:
        # load is not a fault: once more, with a deadline scaled to the CPU it got; the result
        # says the host was busy either way (and a failure so marked is never cached)
        log.info("resilient_strategy: probe %s cut while the host was busy (its workers got "
                 "%s of a CPU): retried with a %.0f s deadline", spec.candidate,
                 dict(result.extra).get(HOST_BUSY), timeout)
        again = _run_once(dataclasses.replace(spec, timeout_s=timeout), env, python)
        result = after_busy_retry(result, again, timeout)
    if health_check:
        health.check_after(spec, result, env, python=python)
    return result


def busy_retry_deadline(result: ProbeResult, workers: int = 1) -> float | None:
    """The deadline a probe cut on a busy host is retried with (`cost.busy_retry_timeout`), None
    when it is not retried: it did not time out, or the host was not busy, or this was the
    retry already, or it spans ``workers`` > 1 (TF_CONFIG workers, nodes: the other workers'
    probes have ended, so a retry here alone would meet no one and read as an error; the
    result still says the host was busy, so it is never cached). Pure."""
    extra = dict(result.extra)
    if (result.status != TIMEOUT or HOST_BUSY not in extra or BUSY_RETRIED in extra
            or workers > 1):
        return None
    try:
        return float(extra[RETRY_TIMEOUT])
    except (KeyError, ValueError):
        return None


def after_busy_retry(first: ProbeResult, again: ProbeResult, timeout_s: float) -> ProbeResult:
    """The retry's result, marked as one (``busy_retried``: its deadline) and as run on a busy
    host (``host_busy``: the retry's own share when it was cut busy too, else the first run's),
    so the trace says so and a failure is never cached. Pure."""
    extra = [(k, v) for k, v in again.extra if k != RETRY_TIMEOUT]
    if HOST_BUSY not in dict(again.extra):
        extra += [(k, v) for k, v in first.extra if k == HOST_BUSY]
    return dataclasses.replace(again, extra=(*extra, (BUSY_RETRIED, f"{timeout_s:g}")))


def _run_once(spec: ProbeSpec, env: Mapping[str, str], python: str) -> ProbeResult:
    """One run of ``spec``'s workers, parsed; a timeout on a busy host (`cost.host_busy`)
    carries ``host_busy`` (the CPU share its workers got) and the deadline a retry gets."""
    # a SIGTERM while the workers run removes this directory too, then terminates the process
    with proc.terminate_as_exception(), files.temp_dir("rs-probe-") as tmp:
        commands = build_commands(spec, env, tmp, python=python, parent_pid=os.getpid())
        try:
            # across TF workers the peers' progress is not seen here: the deadline alone
            # judges (as between torch nodes), so both workers end a failed round alike
            group = proc.run_group(commands, spec.timeout_s,
                                    stall_policy=stall_policy(spec, env)
                                    if judged_by_progress(spec)
                                    else None, spawn=Starter(spec.framework, env, python))
        except OSError as exc:
            return ProbeResult(spec.candidate, ERROR, cause="worker_error",
                               detail=f"could not start the probe worker {python!r}: {exc}")
    result = parse_probe(spec, group.outcomes, group.elapsed_s, group.timed_out, group.stall,
                         signatures_from_env(env, os.pathsep))
    phases = phase_times(group.outcomes, group.started_at)
    if phases:
        result = dataclasses.replace(result, phases=phases)
    if result.status == TIMEOUT and group.share is not None and host_busy(group.share):
        retry = busy_retry_timeout(spec.timeout_s, group.share, MAX_BUSY_RETRY_S)
        result = dataclasses.replace(result, extra=(
            *result.extra, (HOST_BUSY, f"{got_share(group.share):.2f}"),
            (RETRY_TIMEOUT, f"{retry:g}")))
    return result


class RealProber(Prober):
    """The real prober that checks the GPUs of a killed GPU probe at once, itself
    (`run_probe`'s default): for a probe with no later one to defer the check to."""

    starts_processes = True

    def probe(self, spec: ProbeSpec, env: Mapping[str, str]) -> ProbeResult:
        return run_probe(spec, env)


class DeferredHealthProber(Prober):
    """The real prober of a decision that defers the GPU health check (`health.Unproven`):
    a probe runs without it, and the decision loop calls `check_gpus` when a check is due.
    Torch's check is forked from this process where it is fit (``import torch`` done, no GPU
    touched here), so it costs a fork and each GPU's initialisation, not another import."""

    starts_processes = True
    defers_gpu_check = True

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python

    def probe(self, spec: ProbeSpec, env: Mapping[str, str]) -> ProbeResult:
        return run_probe(spec, env, python=self.python, health_check=False)

    def check_gpus(self, framework: str, devices: tuple[int, ...],
                   env: Mapping[str, str]) -> list[tuple[int, str]]:
        """The broken GPUs of ``devices``, each with why (see `health.run_check`)."""
        spawn = Starter(framework, env, self.python)  # forked here where fit, else fresh
        return health.run_check(framework, devices, env, python=self.python, spawn=spawn)

    def check_seconds(self, framework: str, gpus: int, env: Mapping[str, str]) -> float:
        """What a check of ``gpus`` GPUs typically costs after the decision's probes (forked
        here where fit, torch imported by then), by `cost.health_check_seconds`."""
        forked = forks_here(framework, env, self.python)
        return health_check_seconds(framework, gpus, forked=forked, warm=forked)


def worker_env(spec: ProbeSpec, env: Mapping[str, str]) -> dict[str, str]:
    """The workers' environment: ``env``, plus the candidate's variables where ``env`` lacks them,
    plus this package on PYTHONPATH. Everything in ``env`` (NCCL_NVLS_ENABLE, ...) passes as is.
    """
    out = dict(env)
    for name, value in spec.env:
        why = refusal(name, value)
        if why:  # a spec from another process (the job's store): never the loader's or a path
            log.warning("resilient_strategy: probe %s: %s not set: %s", spec.candidate, name,
                        why, extra={"refused_variable": name})
            continue
        out.setdefault(name, value)  # the caller never sends one the user set; if it did, theirs wins
    existing = env.get("PYTHONPATH", "")
    out["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT, existing]) if existing else PACKAGE_ROOT
    if spec.framework == "tensorflow":
        out.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return out


def build_commands(
    spec: ProbeSpec, env: Mapping[str, str], workdir: str, *, python: str, parent_pid: int
) -> list[proc.WorkerCommand]:
    """The worker commands for ``spec``; ``workdir`` (private) holds the rendezvous store's port
    and the reports. Pure."""
    wenv = worker_env(spec, env)
    devices = ",".join(map(str, spec.devices))
    common = ["--backend", spec.backend, "--message-bytes", str(spec.message_bytes),
              "--parent-pid", str(parent_pid)]
    if not spec.train_step:
        common.append("--no-train-step")
    if spec.sharded:
        common.append("--sharded")
    if spec.check_bytes:
        common += ["--check-bytes", ",".join(map(str, spec.check_bytes))]
    work = Path(workdir)

    # cwd is the temporary directory: ``-m`` puts cwd first on sys.path, where a stray
    # torch.py or tensorflow/ in the user's directory would shadow the real package.
    def command(module: str, rank: int, extra: list[str]) -> proc.WorkerCommand:
        report = str(work / f"report-{rank}.json")
        progress = str(work / f"progress-{rank}")
        argv = (python, "-m", f"resilient_strategy.probing.workers.{module}", *common, *extra,
                "--report", report, "--progress", progress)
        return proc.WorkerCommand(argv=argv, env=wenv, cwd=workdir, report_path=report,
                                   progress_path=progress)

    if spec.framework == "torch":
        world = max(1, spec.world_size)
        if spec.devices and spec.backend in PROCESS_GROUP_BACKENDS and len(spec.devices) < world:
            raise InvalidOptionError(
                f"probe {spec.candidate}: {world} ranks need {world} devices, got {devices}")
        return [
            command("torch_worker", rank, [
                "--rank", str(rank), "--world-size", str(world), "--devices", devices,
                "--rendezvous", workdir,
                "--timeout", f"{spec.timeout_s + WORKER_TIMEOUT_MARGIN_S:g}",
            ])
            for rank in range(world)
        ]
    if spec.framework == "tensorflow":
        where = ["--devices", devices]
        if spec.logical_cpus:  # the devices are logical CPUs then
            where += ["--logical-cpus", str(spec.logical_cpus)]
        if spec.workers > 1:  # one process of a probe across the TF_CONFIG workers
            where += ["--workers", str(spec.workers), "--worker-rank", str(spec.worker_rank),
                      "--round-key", spec.candidate, "--budget", f"{spec.timeout_s:g}",
                      "--collective-timeout", f"{spec.timeout_s + WORKER_TIMEOUT_MARGIN_S:g}"]
        return [command("tf_worker", 0, where)]
    raise InvalidOptionError(f"probe {spec.candidate}: unknown framework {spec.framework!r}")
