"""The planner's memory steps (pure): shard the multi-device candidates or not, then rule out
what does not fit. The numbers come from `memory`; each step returns data and the typed
events that say why, and `plan` records them.

1. `shard_chain` (on the static chain): ``sharding="full"`` turns every PyTorch
   multi-process candidate into its sharded form (FSDP2 over the same devices and backend);
   ``"auto"`` does so only when a replica does not fit the smallest usable free memory of its
   devices; ``"none"`` never. TensorFlow candidates are never sharded.
2. `check_memory` (after the batch split, which may narrow the devices): every candidate
   whose need per device exceeds its devices' usable free memory is out, one-device fallbacks
   included. Unknown free memory rules nothing out.
3. `fewer_devices` (after the probe results): once every FSDP candidate over all the GPUs
   is out (its probe failed, or it does not fit), FSDP over the largest subset of them that fits
   and splits the global batch, on the GPUs with the most free memory; larger subsets that do
   not fit are ruled out with their numbers. One node only (a subset across nodes would leave
   some nodes' GPUs idle in a way the launcher cannot see).
4. `offloaded` (last): once no candidate that keeps the state on the GPUs is left, the
   candidates memory ruled out come back with their state in host memory (FSDP2's
   ``CPUOffloadPolicy``) where their GPUs and the host hold it, only with ``offload="auto"``;
   with ``"none"`` the event says whether one would have fitted (the error's advice).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ...vocab import PROCESS_GROUP_BACKENDS
from ..measures.estimate import offload_seconds
from ..measures.memory import MemoryRow, memory_row, model_memory, offload_rows
from ..trace.fitting import FewerDevices, MemoryChecked, OffloadConsidered, ShardingDecided
from ..values.candidate import Candidate
from ..values.facts import Facts

if TYPE_CHECKING:
    from ..call.options import Options

__all__ = ["check_memory", "fewer_devices", "offloaded", "shard_chain", "shardable"]


def shardable(c: Candidate) -> bool:
    """A PyTorch candidate of several processes (FSDP2 runs over its process group)."""
    return c.framework == "torch" and c.backend in PROCESS_GROUP_BACKENDS and c.num_replicas > 1


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


def fewer_devices(chain: Sequence[Candidate], left: Sequence[Candidate], facts: Facts,
                  policy: Options) -> tuple[list[Candidate], list[MemoryRow], FewerDevices | None]:
    """FSDP over the largest subset of the GPUs that fits, once no FSDP candidate over all of
    them is ``left`` (``chain``: the candidates after rules and the batch split, before memory
    and results). Returns the subset's candidates (one per backend of the chain, batch split
    still to do), the rows of larger subsets that do not fit (to be ruled out) and the event."""
    mem = model_memory(policy)
    wide = [c for c in chain if c.sharded and c.devices and c.num_replicas > 1
            and c.origin == "chain"]
    if mem is None or not wide or policy.nodes > 1:
        return [], [], None
    n = max(c.num_replicas for c in wide)
    wide = [c for c in wide if c.num_replicas == n]
    if n < 3 or any(c.sharded and c.num_replicas == n and c.devices for c in left):
        return [], [], None
    free = {g.index: g.memory_free_bytes for g in facts.gpus}
    # the GPUs with the most free memory first (unknown: last), then by index
    order = sorted(wide[0].devices, key=lambda d: (-(free.get(d) or -1), d))
    g = policy.global_batch_size
    rows: list[MemoryRow] = []
    unsplit: list[int] = []
    for k in range(n - 1, 1, -1):
        if (g % k) if g is not None else (n % k):  # accumulation keeps the global batch
            unsplit.append(k)
            continue
        devices = tuple(sorted(order[:k]))
        subset = [replace(c, devices=devices, num_replicas=k) for c in wide]
        row = memory_row(subset[0], facts, mem, policy.nodes)
        rows.append(row)
        if row.fits is not False:
            out = subset if g is not None else [replace(c, accumulation_steps=n // k)
                                                for c in subset]
            return out, _each_backend(rows[:-1], wide), FewerDevices(n, tuple(rows),
                                                                     tuple(unsplit))
    if not rows:
        return [], [], None
    return [], _each_backend(rows, wide), FewerDevices(n, tuple(rows), tuple(unsplit))


def _each_backend(rows: Sequence[MemoryRow], wide: Sequence[Candidate]) -> list[MemoryRow]:
    """Each row once per backend of the chain (FSDP over NCCL and over gloo on those GPUs)."""
    return [replace(r, candidate=replace(c, devices=r.candidate.devices,
                                         num_replicas=r.candidate.num_replicas))
            for r in rows for c in wide]


def offloaded(out_for_memory: Sequence[Candidate], left: Sequence[Candidate], facts: Facts,
              policy: Options) -> tuple[list[Candidate], list[MemoryRow], OffloadConsidered | None]:
    """The candidates memory ruled out (``out_for_memory``), their state offloaded to the host,
    once no GPU candidate is ``left``: those that fit (``offload="auto"`` only), the rows of
    those that do not (to be ruled out), and the event (also under ``"none"``, saying whether
    one would have fitted)."""
    mem = model_memory(policy)
    if (mem is None or policy.framework != "torch" or policy.nodes > 1
            or any(c.devices and c.backend != "cpu" for c in left)):
        return [], [], None
    seen: set[str] = set()
    options: list[Candidate] = []
    for c in out_for_memory:
        if not c.devices or c.backend == "cpu" or c.offload:
            continue
        if c.backend == "single_device":
            c = replace(c, sharded=True)  # FSDP2 over a group of one process
        elif not c.sharded:
            continue
        c = replace(c, offload=True)
        if c.key not in seen:
            seen.add(c.key)
            options.append(c)
    widest = max((c.num_replicas for c in options), default=1)
    options = [c for c in options if c.num_replicas in (1, widest)]
    if not options:
        return [], [], None
    rows = tuple(offload_rows(c, facts, mem, policy.nodes) for c in options)
    if policy.offload != "auto":
        return [], [], OffloadConsidered(policy.offload, rows)
    fit = [gpu.candidate for gpu, host in rows if gpu.fits is not False and host.fits is not False]
    too_big = [next(r for r in pair if r.fits is False) for pair in rows
               if pair[0].candidate not in fit]
    costs = tuple((c, *offload_seconds(c, policy, policy.nodes)) for c in fit)
    return fit, too_big, OffloadConsidered("auto", rows, costs)
