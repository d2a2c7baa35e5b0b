"""The launcher of this process (`core.values.launcher.launcher_from`), with SLURM's own node
list expansion: ``scontrol show hostnames LIST`` where scontrol is on the PATH, under a deadline
(new session, SIGTERM, a bounded wait, SIGKILL), else the pure parser of the bracket syntax.
The environment is a ``Mapping`` handed in (`machine.env.snapshot`): nothing here reads
``os.environ``."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping

from ..core.values.launcher import HostlistError, Launcher, expand_hostlist, launcher_from

#: scontrol answers from its own configuration, with no word to slurmctld; a loaded login node
#: may still be slow to start it.
SCONTROL_TIMEOUT_S = 10.0


def scontrol_hostnames(nodelist: str, env: Mapping[str, str],
                       timeout_s: float = SCONTROL_TIMEOUT_S) -> tuple[str, ...] | None:
    """``scontrol show hostnames`` of ``nodelist``; None where scontrol is missing, fails or
    does not answer within ``timeout_s``."""
    exe = shutil.which("scontrol", path=env.get("PATH"))
    if exe is None:
        return None
    try:
        proc = subprocess.Popen([exe, "show", "hostnames", nodelist], env=dict(env),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=True, text=True)
    except OSError:
        return None
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(proc)
        return None
    if proc.returncode != 0:
        return None
    hosts = tuple(line.strip() for line in out.splitlines() if line.strip())
    return hosts or None


def _stop(proc: subprocess.Popen[str]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.communicate(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def detect_launcher(env: Mapping[str, str]) -> Launcher:
    """Who started this process, its environment being ``env``."""

    def expand(nodelist: str) -> tuple[str, ...]:
        hosts = scontrol_hostnames(nodelist, env)
        if hosts is not None:
            return hosts
        return expand_hostlist(nodelist)  # raises HostlistError: a note in the launcher

    return launcher_from(env, expand)


def _scontrol(argv: list[str], env: Mapping[str, str],
              timeout_s: float) -> subprocess.CompletedProcess[str] | None:
    """``scontrol ARGV`` under a deadline (new session, SIGTERM, SIGKILL); None where scontrol
    is missing or does not answer in time."""
    exe = shutil.which("scontrol", path=env.get("PATH"))
    if exe is None:
        return None
    try:
        proc = subprocess.Popen([exe, *argv], env=dict(env), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, text=True)
    except OSError:
        return None
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(proc)
        return None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


#: requeue asks slurmctld (show job too): a busy controller answers in seconds, not at once
SCONTROL_CTLD_TIMEOUT_S = 30.0


def show_job(job_id: str, env: Mapping[str, str],
             timeout_s: float = SCONTROL_CTLD_TIMEOUT_S) -> str | None:
    """``scontrol -o show job JOB``'s one line, None where it fails or does not answer."""
    done = _scontrol(["-o", "show", "job", job_id], env, timeout_s)
    if done is None or done.returncode != 0 or not done.stdout.strip():
        return None
    return done.stdout.strip()


def requeue(job_id: str, env: Mapping[str, str],
            timeout_s: float = SCONTROL_CTLD_TIMEOUT_S) -> str | None:
    """``scontrol requeue JOB``: None when done, else what went wrong in one line."""
    done = _scontrol(["requeue", job_id], env, timeout_s)
    if done is None:
        return f"scontrol requeue {job_id}: scontrol missing or silent for {timeout_s:.0f} s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return f"scontrol requeue {job_id}: {last[:200]}"
    return None


def exclude_nodes(job_id: str, nodes: str, env: Mapping[str, str],
                  timeout_s: float = SCONTROL_CTLD_TIMEOUT_S) -> str | None:
    """``scontrol update JobId=JOB ExcNodeList=NODES`` (the whole list: SLURM replaces it):
    None when done, else what went wrong in one line. SLURM takes it only while the job is
    pending (after `requeue`)."""
    done = _scontrol(["update", f"JobId={job_id}", f"ExcNodeList={nodes}"], env, timeout_s)
    if done is None:
        return (f"scontrol update JobId={job_id} ExcNodeList={nodes}: scontrol missing or "
                f"silent for {timeout_s:.0f} s")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return f"scontrol update JobId={job_id} ExcNodeList={nodes}: {last[:200]}"
    return None


__all__ = ["HostlistError", "Launcher", "detect_launcher", "exclude_nodes", "requeue",
           "scontrol_hostnames", "show_job"]
