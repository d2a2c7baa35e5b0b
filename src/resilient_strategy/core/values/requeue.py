"""Whether a finished ``resilient-strategy run`` asks SLURM to requeue its batch job: pure, from
the exit code, the environment and what ``scontrol show job`` said of the job.

Requeued only when all hold: the exit code is 75 (`run/exitcodes`: "requeue elsewhere"); the
process is the batch script of a SLURM job (``SLURM_JOB_ID`` set, no ``SLURM_STEP_ID``), or
task 0 of a step; the job is requeueable as SLURM itself says (``Requeue=1``: ``sbatch
--requeue``, or the site's ``JobRequeue=1`` default; ``--no-requeue`` gives ``Requeue=0``);
and it has been requeued fewer than `MAX_RESTARTS` times (``Restarts=``). A job that cannot be
shown (scontrol missing, failing, silent) is never requeued: the job did not visibly ask.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

#: The exit code that asks for a requeue (`ExitCode.INFRASTRUCTURE`; not imported from run/,
#: a floor above).
REQUEUE_EXIT = 75
#: Requeues of one job by this library at most (``Restarts=`` in ``scontrol show job``): a
#: fault that follows the job from node to node is not retried forever.
MAX_RESTARTS = 3


@dataclass(frozen=True)
class RequeueDecision:
    """What to do with the SLURM job once the run ends: ``requeue`` it (``job_id``) or not,
    and why, in a few words (None: not a SLURM batch job, nothing to say)."""

    requeue: bool
    job_id: str | None
    reason: str | None


def parse_show_job(text: str) -> dict[str, str]:
    """``scontrol -o show job J``'s ``Key=Value`` words as a mapping (values with spaces, such
    as ``Command=``, are cut at the first space; the keys read here have none)."""
    out: dict[str, str] = {}
    for word in text.split():
        key, eq, value = word.partition("=")
        if eq and key and key not in out:
            out[key] = value
    return out


def batch_job(env: Mapping[str, str]) -> str | None:
    """The SLURM job this process may requeue (its batch script, or task 0 of a step), else
    None."""
    job = env.get("SLURM_JOB_ID", "").strip()
    if not job.isdigit():
        return None
    if env.get("SLURM_STEP_ID") is not None and env.get("SLURM_PROCID", "0") != "0":
        return None  # one task of the step speaks for the job
    return job


def requeue_decision(exit_code: int, env: Mapping[str, str],
                     job: Mapping[str, str] | None) -> RequeueDecision:
    """Requeue the job or not (see the module docstring). ``job``: `parse_show_job` of the
    job, None when it could not be shown."""
    job_id = batch_job(env)
    if job_id is None:
        return RequeueDecision(False, None, None)
    if exit_code != REQUEUE_EXIT:
        return RequeueDecision(False, job_id, None)  # 0 done; 1, 2: a retry fails the same way
    if job is None:
        return RequeueDecision(False, job_id, f"SLURM job {job_id} could not be shown "
                               "(scontrol show job): not requeued")
    if job.get("Requeue") != "1":
        return RequeueDecision(False, job_id, f"SLURM job {job_id} is not requeueable "
                               "(Requeue=0: submit with sbatch --requeue): not requeued")
    restarts = job.get("Restarts", "0")
    if restarts.isdigit() and int(restarts) >= MAX_RESTARTS:
        return RequeueDecision(False, job_id, f"SLURM job {job_id} was requeued {restarts} "
                               f"times already (at most {MAX_RESTARTS}): not requeued")
    return RequeueDecision(True, job_id, f"SLURM job {job_id} requeued (exit 75; "
                           f"restart {int(restarts) + 1 if restarts.isdigit() else 1} of at "
                           f"most {MAX_RESTARTS})")
