"""Memory: what one device must hold for a candidate, against what its devices have free. Pure.

The model's state is its parameters, their gradients and the optimizer's state (AdamW keeps two
fp32 moments per trainable parameter: ``optimizer_state_factor=2`` times the gradient bytes, the
default; SGD with momentum is 1, plain SGD 0). A replica (DDP, one device, MirroredStrategy)
holds all of it on every device. Sharded over ``n`` devices (FSDP2's ``fully_shard``) each
device holds ``1/n`` of it, plus the unsharded parameters of the units it gathers at once: the
one computing, the one prefetched, and the unsharded gradients of one unit before their
reduce-scatter (`TRANSIENT_UNITS` units; a unit is one ``fully_shard`` call, by default one
of the model's repeated blocks, see `call.model.repeated_blocks`).

Offloaded (FSDP2's ``CPUOffloadPolicy``, ``offload="auto"``), the sharded state lives in host
memory: a GPU holds only the `TRANSIENT_UNITS` units it gathers at once, and the host holds
every local process's shard of the state (the whole state, on one node). Both must fit.

Activations are not counted (they follow the batch, which the user sets): a device's free memory
is used only up to ``1 - MEMORY_HEADROOM``, the rest left for activations, the CUDA context and
the allocator's fragmentation. These are estimates, and the trace says so with every number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..values.candidate import Candidate
from ..values.facts import Facts
from ..values.human import human_bytes

if TYPE_CHECKING:
    from ..call.options import Options

__all__ = [
    "ASSUMED_UNITS", "MEMORY_HEADROOM", "TRANSIENT_UNITS", "MemoryRow", "ModelMemory",
    "host_row", "memory_row", "model_memory", "offload_rows",
]

#: Share of a device's free memory left for activations, the CUDA context and fragmentation.
MEMORY_HEADROOM = 0.10
#: Units of parameters gathered at once under sharding (computing, prefetched, one unit's
#: unsharded gradients before the reduce-scatter).
TRANSIENT_UNITS = 3
#: Without a model to look at (``param_bytes=`` only), a unit is taken as 1/8 of the parameters.
ASSUMED_UNITS = 8


@dataclass(frozen=True)
class ModelMemory:
    """The model's state, in bytes (see the module docstring)."""

    param_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    unit_bytes: int  # parameters of the largest sharding unit
    optimizer_state_factor: float = 2.0
    unit_assumed: bool = False  # the unit size is ASSUMED_UNITS' guess, not the model's

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.gradient_bytes + self.optimizer_bytes

    def need(self, shards: int) -> int:
        """Bytes one device holds when the state is sharded over ``shards`` devices (1:
        replicated)."""
        if shards <= 1:
            return self.state_bytes
        return -(-self.state_bytes // shards) + TRANSIENT_UNITS * min(self.unit_bytes,
                                                                      self.param_bytes)

    def offloaded_need(self) -> int:
        """Bytes one GPU holds when the state is offloaded to the host: the units it gathers."""
        return TRANSIENT_UNITS * min(self.unit_bytes, self.param_bytes)

    def describe(self) -> str:
        unit = (f"; a sharding unit of {human_bytes(self.unit_bytes)}"
                + (f" assumed (1/{ASSUMED_UNITS} of the parameters)" if self.unit_assumed else ""))
        return (f"parameters {human_bytes(self.param_bytes)} + gradients "
                f"{human_bytes(self.gradient_bytes)} + optimizer state "
                f"{human_bytes(self.optimizer_bytes)} (x{self.optimizer_state_factor:g})" + unit)


def model_memory(policy: Options) -> ModelMemory | None:
    """The model's state from the options (None when neither ``param_bytes``, ``gradient_bytes``
    nor ``model=`` said how large it is): gradients default to the parameters (all trainable),
    the parameters to the gradients."""
    params = policy.param_bytes or policy.gradient_bytes
    if params is None:
        return None
    grads = policy.gradient_bytes or params
    unit = policy.shard_unit_bytes
    return ModelMemory(
        param_bytes=params, gradient_bytes=grads,
        optimizer_bytes=int(grads * policy.optimizer_state_factor),
        unit_bytes=unit if unit else max(1, params // ASSUMED_UNITS),
        optimizer_state_factor=policy.optimizer_state_factor, unit_assumed=not unit,
    )


@dataclass(frozen=True)
class MemoryRow:
    """One candidate's need per device against its devices' free memory (the smallest among
    them: that device decides). ``free_bytes`` None: unknown (not ruled out)."""

    candidate: Candidate
    need_bytes: int
    free_bytes: int | None
    usable_bytes: int | None  # free_bytes less the headroom
    shards: int  # devices the state is sharded over (1: replicated)
    where: str  # "GPU 2", "host"

    @property
    def fits(self) -> bool | None:
        return None if self.usable_bytes is None else self.need_bytes <= self.usable_bytes

    def text(self) -> str:
        how = f"sharded x{self.shards}" if self.shards > 1 else "replicated"
        if self.candidate.offload:
            how = ("state offloaded to the host" if self.where == "host"
                   else f"{how}, state offloaded to the host")
        head = f"{self.candidate.label} ({how}) needs {human_bytes(self.need_bytes)} per device"
        if self.free_bytes is None:
            return head + f", free memory of {self.where} unknown"
        verdict = "fits" if self.fits else "does not fit"
        return head + (f", {self.where} has {human_bytes(self.free_bytes)} free "
                       f"({human_bytes(self.usable_bytes or 0)} usable): {verdict}")


def shards_of(c: Candidate) -> int:
    return c.num_replicas if c.sharded else 1


def memory_row(c: Candidate, facts: Facts, mem: ModelMemory, nodes: int = 1) -> MemoryRow:
    """What ``c`` needs per device and what its devices have (pure). Offloaded: its GPUs' row
    (`offload_rows` adds the host's)."""
    shards = shards_of(c)
    need = mem.offloaded_need() if c.offload else mem.need(shards)
    if c.devices and c.backend != "cpu":
        by_index = {g.index: g for g in facts.gpus}
        known = [(by_index[d].memory_free_bytes, d) for d in c.devices
                 if d in by_index and by_index[d].memory_free_bytes is not None]
        if not known:
            return MemoryRow(c, need, None, None, shards, _gpus(c.devices))
        free, device = min((f or 0, d) for f, d in known)
        return MemoryRow(c, need, free, int(free * (1 - MEMORY_HEADROOM)), shards, f"GPU {device}")
    # on the CPU: the processes of this node share the host's memory
    per_host = max(1, c.num_replicas // max(1, nodes)) if c.backend != "cpu" else 1
    host = facts.host.memory_available_bytes
    need *= per_host
    if host is None:
        return MemoryRow(c, need, None, None, shards, "host")
    return MemoryRow(c, need, host, int(host * (1 - MEMORY_HEADROOM)), shards, "host")


def host_row(c: Candidate, facts: Facts, mem: ModelMemory, nodes: int = 1) -> MemoryRow:
    """What the host holds for an offloaded candidate: every local process's shard."""
    shards = shards_of(c)
    local = max(1, c.num_replicas // max(1, nodes))
    need = -(-mem.state_bytes // shards) * local
    host = facts.host.memory_available_bytes
    usable = None if host is None else int(host * (1 - MEMORY_HEADROOM))
    return MemoryRow(c, need, host, usable, shards, "host")


def offload_rows(c: Candidate, facts: Facts, mem: ModelMemory,
                 nodes: int = 1) -> tuple[MemoryRow, MemoryRow]:
    """An offloaded candidate's two rows: its GPUs (the gathered units) and the host (the
    state). It fits where neither says it does not."""
    return memory_row(c, facts, mem, nodes), host_row(c, facts, mem, nodes)


def _gpus(devices: Sequence[int]) -> str:
    return f"GPU{'s' if len(devices) > 1 else ''} {','.join(map(str, devices))}"
