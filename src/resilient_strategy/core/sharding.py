"""The planner's memory steps (pure): shard the multi-device candidates or not, then rule out
what does not fit. The numbers come from :mod:`.memory`; each step returns data and the typed
events that say why, and :mod:`.plan` records them.

1. :func:`shard_chain` (on the static chain): ``sharding="full"`` turns every PyTorch
   multi-process candidate into its sharded form (FSDP2 over the same devices and backend);
   ``"auto"`` does so only when a replica does not fit the smallest usable free memory of its
   devices; ``"none"`` never. TensorFlow candidates are never sharded.
2. :func:`check_memory` (after the batch split, which may narrow the devices): every candidate
   whose need per device exceeds its devices' usable free memory is out, one-device fallbacks
   included. Unknown free memory rules nothing out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from .candidate import Candidate
from .facts import Facts
from .memory import MemoryRow, memory_row, model_memory
from .trace import MemoryChecked, ShardingDecided

if TYPE_CHECKING:
    from .options import Options

__all__ = ["check_memory", "shard_chain", "shardable"]


def shardable(c: Candidate) -> bool:
    """A PyTorch candidate of several processes (FSDP2 runs over its process group)."""
    return c.framework == "torch" and c.backend in ("nccl", "gloo") and c.num_replicas > 1


def shard_chain(cands: Sequence[Candidate], facts: Facts,
                policy: Options) -> tuple[list[Candidate], ShardingDecided | None]:
    """The chain with its multi-process candidates sharded where ``policy.sharding`` says."""
    multi = [c for c in cands if shardable(c)]
    if not multi or policy.sharding == "none":
        return list(cands), None
    if policy.sharding == "full":
        return [replace(c, sharded=True) if shardable(c) else c for c in cands], \
            ShardingDecided("full", True, "asked")
    mem = model_memory(policy)
    if mem is None:  # nothing to decide on, and nothing asked: the trace stays as it was
        return list(cands), None
    rows = [memory_row(c, facts, mem, policy.nodes) for c in multi]
    known = [r for r in rows if r.usable_bytes is not None]
    if not known:
        return list(cands), None  # no free-memory fact: nothing to decide on
    worst = min(known, key=lambda r: r.usable_bytes or 0)
    shard = any(r.fits is False for r in known)
    sharded_need = mem.need(multi[0].num_replicas)
    event = ShardingDecided("auto", shard, "replica_does_not_fit" if shard else "replica_fits",
                            worst.need_bytes, sharded_need, worst.usable_bytes)
    if not shard:
        return list(cands), event
    return [replace(c, sharded=True) if shardable(c) else c for c in cands], event


def check_memory(cands: Sequence[Candidate], facts: Facts,
                 policy: Options) -> tuple[list[MemoryRow], MemoryChecked | None]:
    """The rows of the candidates that do not fit (to be ruled out) and the event with every
    row; nothing when the model's size is unknown."""
    mem = model_memory(policy)
    if mem is None or not cands:
        return [], None
    rows = tuple(memory_row(c, facts, mem, policy.nodes) for c in cands)
    if all(r.free_bytes is None for r in rows):
        return [], None
    event = MemoryChecked(mem.describe(), mem.state_bytes, rows)
    return list(event.does_not_fit), event
