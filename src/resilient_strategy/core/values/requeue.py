"""Whether a finished ``resilient-strategy run`` asks SLURM to requeue its batch job: pure, from
the exit code, the environment and what ``scontrol show job`` said of the job.

Requeued only when all hold: the exit code is 75 (`run/exitcodes`: "requeue elsewhere"); the
process is the batch script of a SLURM job (``SLURM_JOB_ID`` set, no ``SLURM_STEP_ID``), or
task 0 of a step; the job is requeueable as SLURM itself says (``Requeue=1``: ``sbatch
--requeue``, or the site's ``JobRequeue=1`` default; ``--no-requeue`` gives ``Requeue=0``);
and it has been requeued fewer than `MAX_RESTARTS` times (``Restarts=``). A job that cannot be
shown (scontrol missing, failing, silent) is never requeued: the job did not visibly ask.

The node excluded (`exclusion`): when the run ended on a fault of this node's own
(``node_fault``: its cause, from `core/knowledge/causes.NODE_CAUSES`, e.g. a GPU lost), the
requeued job gets this node (``SLURMD_NODENAME``, else the job's ``BatchHost``; across nodes,
the node whose own fault it was, by the name it sent: ``node_name``) added to its
``ExcNodeList``, the nodes already there kept (the user's ``--exclude``); never for a fault that
is not the node's, and nothing to add when the node is excluded already. SLURM changes
``ExcNodeList`` only on a pending job ("Job is no longer pending execution" on a running one,
measured on slurm-wlm 22.05), so the update follows the requeue (the requeued job waits for its
``BeginTime`` before it can start again, so the update lands first).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .launcher import HostlistError, expand_hostlist

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
    #: The job's ``ExcNodeList`` to set once it is requeued (None: left as it is), and the node
    #: it adds (the one whose fault ended the run).
    exclude: str | None = None
    node: str | None = None


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


def this_node(env: Mapping[str, str], job: Mapping[str, str] | None) -> str | None:
    """The node this process runs on as SLURM names it: ``SLURMD_NODENAME`` (set for the batch
    script and each task), else the job's ``BatchHost``."""
    name = env.get("SLURMD_NODENAME", "").strip()
    if not name and job is not None:
        name = job.get("BatchHost", "").strip()
    return name if name and name != "(null)" else None


def exclusion(job: Mapping[str, str], node: str,
              expand: Callable[[str], tuple[str, ...]] = expand_hostlist) -> str | None:
    """The ``ExcNodeList`` that adds ``node`` to the job's own (``ExcNodeList=`` of
    `parse_show_job`; ``(null)``: none), the nodes there kept as written; None when ``node`` is
    excluded already. A list that cannot be expanded is kept and added to all the same."""
    before = job.get("ExcNodeList", "").strip()
    if before in ("", "(null)"):
        return node
    try:
        if node in expand(before):
            return None
    except HostlistError:
        pass
    return f"{before},{node}"


def requeue_decision(exit_code: int, env: Mapping[str, str],
                     job: Mapping[str, str] | None,
                     node_fault: str | None = None,
                     node_name: str | None = None) -> RequeueDecision:
    """Requeue the job or not (see the module docstring). ``job``: `parse_show_job` of the
    job, None when it could not be shown. ``node_fault``: the cause that blames this node for
    the run's end (None: the fault is not the node's), which excludes the node; ``node_name``:
    the node it blames when that is another node (None: this one)."""
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
    said = (f"SLURM job {job_id} requeued (exit 75; restart "
            f"{int(restarts) + 1 if restarts.isdigit() else 1} of at most {MAX_RESTARTS})")
    if node_fault is None:
        return RequeueDecision(True, job_id, said)
    node = node_name or this_node(env, job)
    if node is None:
        return RequeueDecision(True, job_id, f"{said}; the fault was this node's "
                               f"({node_fault}), but SLURM names no node here "
                               "(SLURMD_NODENAME, BatchHost): none excluded")
    exclude = exclusion(job, node)
    if exclude is None:
        return RequeueDecision(True, job_id, f"{said}; node {node} ({node_fault}) is "
                               "excluded already", node=node)
    return RequeueDecision(True, job_id, f"{said}, node {node} excluded (its fault: "
                           f"{node_fault}): ExcNodeList={exclude}", exclude, node)
