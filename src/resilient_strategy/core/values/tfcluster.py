"""``TF_CONFIG``, read as TensorFlow's ``MultiWorkerMirroredStrategy`` reads it. Pure.

``TF_CONFIG`` is JSON: ``{"cluster": {"chief": [...], "worker": ["host:port", ...]},
"task": {"type": "worker", "index": 1}}``. `parse_tf_config` turns it into a frozen
`TfCluster`, bounded in size (`MAX_TF_CONFIG_BYTES`) and depth (`MAX_DEPTH`):
anything else is an `InvalidOptionError` naming ``TF_CONFIG``.

The rules are TensorFlow's own (``tensorflow/python/distribute/multi_worker_util.py``,
``_validate_cluster_spec``, ``worker_count``, ``id_in_cluster``): the jobs are ``chief``,
``worker``, ``evaluator`` and ``ps``; at most one chief and one evaluator; the chief counts as a
worker and comes first (its id is 0, worker ``i`` is ``i + len(chief)``); an evaluator sits in a
cluster of its own (it evaluates beside the training, outside its collectives).

What this library makes of them:

- a ``chief``/``worker`` task of a cluster with 2 or more of them: a multi-worker job
  (``TfCluster.multi_worker``), planned as ``MultiWorkerMirroredStrategy`` across the workers;
- an ``evaluator`` task, or a cluster of one worker: *not* multi-worker; the task plans its own
  devices alone, as ``MultiWorkerMirroredStrategy`` itself would treat it;
- a ``ps`` job anywhere in the cluster: an error. A parameter-server cluster trains with
  ``ParameterServerStrategy`` (its workers talk to parameter servers, not to each other), which
  this library neither proves nor builds; planning the tasks as mirrored replicas would ignore the
  cluster the user described.

No ``os`` here (the planner's modules may use it):
`resilient_strategy.core.call.arguments.options_from` passes the variable's text from the
environment snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import FileFormatError, InvalidOptionError
from .bounded import parse_json

__all__ = ["MAX_TF_CONFIG_BYTES", "TfCluster", "parse_tf_config"]

#: Far above an honest TF_CONFIG (a thousand workers' addresses take ~30 KB).
MAX_TF_CONFIG_BYTES = 1 << 20
#: TF_CONFIG nests 3 deep ({"cluster": {"worker": [...]}}); this leaves room, nothing more.
MAX_DEPTH = 8
#: At most this many tasks per job.
MAX_TASKS = 1 << 16
MAX_ADDRESS_CHARS = 1024
JOBS = ("chief", "worker", "evaluator", "ps")
VAR = "TF_CONFIG"


@dataclass(frozen=True)
class TfCluster:
    """This task's place in a ``TF_CONFIG`` cluster.

    ``workers`` are the training tasks' addresses in collective order (the chief first, then the
    workers); ``task_type`` / ``task_index`` are this task's as TF_CONFIG names them.
    """

    workers: tuple[str, ...]
    task_type: str
    task_index: int
    evaluators: tuple[str, ...] = ()
    chief: bool = False  # the cluster has a chief task (first in ``workers``)

    @property
    def num_workers(self) -> int:
        """Tasks that train together (chief + workers)."""
        return len(self.workers)

    @property
    def worker_rank(self) -> int | None:
        """This task's id in the collective (chief 0, worker i after the chief); None for an
        evaluator, which is not part of it."""
        if self.task_type == "chief":
            return 0
        if self.task_type == "worker":
            return self.task_index + (1 if self.chief else 0)
        return None

    @property
    def multi_worker(self) -> bool:
        """Whether this task trains with others (a chief/worker task of 2+ training tasks)."""
        return self.worker_rank is not None and self.num_workers > 1

    @property
    def task(self) -> str:
        """``type:index``, as TensorFlow names the task."""
        return f"{self.task_type}:{self.task_index}"

    @property
    def address(self) -> str:
        """This task's own address."""
        rank = self.worker_rank
        if rank is not None:
            return self.workers[rank]
        return self.evaluators[self.task_index] if self.task_index < len(self.evaluators) else ""

    def to_dict(self) -> dict[str, Any]:
        return {"workers": list(self.workers), "task_type": self.task_type,
                "task_index": self.task_index, "worker_rank": self.worker_rank,
                "num_workers": self.num_workers, "chief": self.chief,
                "multi_worker": self.multi_worker}


def _bad(why: str) -> InvalidOptionError:
    return InvalidOptionError(f"{VAR}: {why}", VAR)


def _addresses(job: str, value: Any) -> tuple[str, ...]:
    """A job's task addresses: a list, or an object {"0": addr, "1": addr, ...} with dense ids."""
    items: Sequence[Any]
    if isinstance(value, list):
        items = value
    elif isinstance(value, Mapping):
        try:
            ids = sorted(int(k) for k in value)
        except (TypeError, ValueError):
            raise _bad(f"cluster.{job}: task ids must be integers, not {sorted(value)!r}") from None
        if ids != list(range(len(ids))):
            raise _bad(f"cluster.{job}: task ids {ids} leave gaps; every task from 0 to "
                       f"{len(ids) - 1} must be listed (sparse clusters are not supported)")
        by_id = {int(k): v for k, v in value.items()}
        items = [by_id[i] for i in ids]
    else:
        raise _bad(f"cluster.{job}: expected a list of \"host:port\" addresses, not {value!r}"[:300])
    if len(items) > MAX_TASKS:
        raise _bad(f"cluster.{job}: {len(items)} tasks, more than {MAX_TASKS}")
    out = []
    for i, addr in enumerate(items):
        if not isinstance(addr, str) or not addr.strip() or len(addr) > MAX_ADDRESS_CHARS:
            raise _bad(f"cluster.{job}[{i}]: expected a \"host:port\" address, not {addr!r}"[:300])
        out.append(addr.strip())
    if len(set(out)) != len(out):
        raise _bad(f"cluster.{job}: the same address is listed twice ({out})"[:300])
    return tuple(out)


def parse_tf_config(text: str | None) -> TfCluster | None:
    """The cluster ``TF_CONFIG`` describes; None when it is unset, empty, or names no cluster
    (TensorFlow then trains locally). Raises `InvalidOptionError` (naming ``TF_CONFIG``)
    for anything TensorFlow would reject or this library cannot plan (a ``ps`` job)."""
    if text is None or not text.strip():
        return None
    if len(text.encode("utf-8", errors="replace")) > MAX_TF_CONFIG_BYTES:
        raise _bad(f"{len(text)} characters, more than the {MAX_TF_CONFIG_BYTES} bytes read")
    try:
        data = parse_json(text, VAR, max_depth=MAX_DEPTH)
    except FileFormatError as exc:
        raise _bad(f"not a JSON object TensorFlow can read: {exc}") from None
    if not isinstance(data, dict):
        raise _bad(f"expected a JSON object, not {type(data).__name__}")
    cluster = data.get("cluster")
    if cluster is None or cluster == {}:
        return None
    if not isinstance(cluster, dict):
        raise _bad(f"cluster: expected an object of jobs, not {cluster!r}"[:300])
    unknown = sorted(set(cluster) - set(JOBS))
    if unknown:
        raise _bad(f"cluster: unknown job(s) {unknown}; TensorFlow knows {list(JOBS)}")
    jobs = {job: _addresses(job, value) for job, value in cluster.items()}
    if jobs.get("ps"):
        raise _bad(
            f"the cluster has a ps job ({len(jobs['ps'])} parameter server(s)): that is "
            "ParameterServerStrategy's cluster, which resilient_strategy neither proves nor "
            "builds. Build ParameterServerStrategy yourself, or describe a cluster of chief/"
            "worker tasks for MultiWorkerMirroredStrategy.")
    for job in ("chief", "evaluator"):
        if len(jobs.get(job, ())) > 1:
            raise _bad(f"cluster.{job}: {len(jobs[job])} tasks; TensorFlow allows at most one")
    task = data.get("task")
    if not isinstance(task, dict):
        raise _bad('task: expected {"type": "worker", "index": N} naming this task, not '
                   f"{task!r}"[:300])
    kind, index = task.get("type"), task.get("index", 0)
    if kind not in ("chief", "worker", "evaluator"):
        raise _bad(f"task.type: expected 'chief', 'worker' or 'evaluator', not {kind!r}"[:300])
    if isinstance(index, str) and index.strip().isdigit():
        index = int(index)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise _bad(f"task.index: expected a task id (0 or more), not {index!r}"[:300])
    tasks = jobs.get(kind, ())
    if kind != "evaluator" and index >= len(tasks):
        raise _bad(f"task {kind}:{index} is not in the cluster (its {kind} job has "
                   f"{len(tasks)} task(s))")
    workers = jobs.get("chief", ()) + jobs.get("worker", ())
    if len(set(workers)) != len(workers):
        raise _bad(f"the chief's address is also a worker's ({workers[0]})")
    return TfCluster(workers=workers, task_type=str(kind), task_index=index,
                     evaluators=jobs.get("evaluator", ()), chief=bool(jobs.get("chief")))
