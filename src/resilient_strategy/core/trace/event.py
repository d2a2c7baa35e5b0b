"""The trace of a decision as typed events (in the spirit of resolvelib's reporter).

The planner and the executor emit events; `render` turns them into the lines of
``explain()``, and `Event.to_dict` into the ``events`` of ``to_dict()``/``--json``. Tests
assert on events (their kind and fields), never on the English of a rendered line.

Every event is a frozen value. ``text()`` is one line, or "" for an event that another line
already says (a candidate a rule vetoed is named by that rule's line).

The events themselves stand in this folder by the planner's step: `inputs`, `ruling`,
`fitting`, `choosing`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from ..measures.probe import ProbeResult
from ..values.candidate import Candidate


def _plain(value: Any) -> Any:
    if isinstance(value, Candidate):
        return {"key": value.key, "label": value.label}
    if isinstance(value, ProbeResult):
        return value.to_dict()
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class Event:
    """One thing the decision did or found."""

    kind: ClassVar[str] = "event"

    def text(self) -> str:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        out.update({f.name: _plain(getattr(self, f.name)) for f in fields(self)})
        out["text"] = self.text()
        return out


@dataclass(frozen=True)
class Note(Event):
    """A finding that changes what is considered, named by ``topic``:

    ``no_gpu_facts``, ``visible_devices``, ``nvml_unread``, ``devices_asked``, ``logical_cpus``,
    ``cpu_only_build``, ``rocm_build``, ``too_few_gpus``, ``multi_node``, ``one_process``,
    ``no_global_batch``,
    ``batch_not_split``, ``batch_shrinks_replicas``, ``prefer_impossible``, ``fault_injection``
    (the cache is neither read nor written for a rehearsal), ``within_noise`` (measured speeds
    within their measured noise kept the chain's order), ``multi_worker`` (a TF_CONFIG job's
    ladder), ``alone_after_workers`` (worker 0's own MirroredStrategy moved after the strategies
    across the workers), ``handed_memory`` (a worker of ``resilient-strategy run`` takes the
    supervisor's sharding / offload), ``bound_devices`` (a worker bound to a subset of the GPUs:
    which ones), ``gpus_unchecked`` (GPUs a killed probe may have broken, unused by the choice,
    whose deferred health check did not fit the probe budget: how to check them),
    ``retried_after_check`` (a probe whose failure is no verdict by itself, NCCL out of GPU
    memory while setting up: its GPUs checked, then probed once more, and what that gave),
    ``mig_one_slice`` (more local processes than the MIG instances they see: rank 0 on one
    slice with accumulation, the others exit), ``run_launcher`` (a worker of
    ``resilient-strategy run`` started by srun: the node options read from SLURM),
    ``batch_implausible`` (a per-device micro-batch of more than a million samples: a
    dataset's size passed as the global batch, most likely), ``agreement_moved`` (the cache
    directory could not take the file local rank 0 shares its decision through: full,
    read-only or not writable; shared through this user's own directory instead).
    """

    kind: ClassVar[str] = "note"
    topic: str
    message: str

    def text(self) -> str:
        return self.message


def render(events: Sequence[Event]) -> tuple[str, ...]:
    """The lines of the trace: one per event that says something new."""
    return tuple(t for t in (e.text() for e in events) if t)
