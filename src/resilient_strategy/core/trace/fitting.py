"""What memory did to the chain: sharding decided, the memory checked, FSDP over fewer devices,
CPU offload considered."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..measures.memory import MemoryRow
from ..values.candidate import Candidate
from ..values.human import human_bytes, human_duration
from .event import Event


@dataclass(frozen=True)
class ShardingDecided(Event):
    """Whether the multi-device candidates shard the model (FSDP2) or replicate it, and why:
    ``mode`` is the ``sharding=`` option; ``reason`` one of "asked" (``"full"``),
    "replica_does_not_fit", "replica_fits"; the bytes a replica needs per device
    against the smallest usable free memory of those devices (None: unknown). Emitted only when
    sharding was asked for or the sizes were known."""

    kind: ClassVar[str] = "sharding"
    mode: str
    sharded: bool
    reason: str
    replica_bytes: int | None = None
    sharded_bytes: int | None = None
    usable_bytes: int | None = None

    def text(self) -> str:
        if self.reason == "asked":
            return "Sharding the model over the replicas (FSDP2), as asked (sharding='full')."
        numbers = (f"a replica needs {human_bytes(self.replica_bytes or 0)} per device, "
                   f"{human_bytes(self.usable_bytes or 0)} is usable")
        if self.sharded:
            return (f"sharding='auto' shards the model (FSDP2): {numbers}; sharded it needs "
                    f"{human_bytes(self.sharded_bytes or 0)}.")
        return f"sharding='auto' replicates: {numbers}."


@dataclass(frozen=True)
class MemoryChecked(Event):
    """The memory each candidate needs per device against its devices' free memory; the
    candidates that do not fit are ruled out (``ruled_out`` events with ``by="memory"``)."""

    kind: ClassVar[str] = "memory_check"
    model: str  # the model's state, in words (memory.ModelMemory.describe)
    state_bytes: int
    rows: tuple[MemoryRow, ...]

    @property
    def does_not_fit(self) -> tuple[MemoryRow, ...]:
        return tuple(r for r in self.rows if r.fits is False)

    def text(self) -> str:
        return (f"Memory per device for {self.model} ({human_bytes(self.state_bytes)} in all): "
                + "; ".join(r.text() for r in self.rows) + ".")


@dataclass(frozen=True)
class FewerDevices(Event):
    """Every FSDP candidate over all ``widest`` GPUs is out (its probe failed, or it does not
    fit): the step-down shards over the largest subset of them that fits. ``rows``: FSDP over
    each subset size tried, largest first, on the GPUs with the most free memory (the last row
    the one chosen when it fits); ``unsplit``: sizes skipped because the global batch does not
    split over them."""

    kind: ClassVar[str] = "fewer_devices"
    widest: int
    rows: tuple[MemoryRow, ...]
    unsplit: tuple[int, ...] = ()

    @property
    def chosen(self) -> Candidate | None:
        last = self.rows[-1] if self.rows else None
        return last.candidate if last is not None and last.fits is not False else None

    def text(self) -> str:
        head = f"FSDP over all {self.widest} GPUs is out; stepping down to FSDP over fewer GPUs"
        skipped = (f" ({', '.join(map(str, self.unsplit))} GPUs skipped: the global batch does "
                   "not split over them)") if self.unsplit else ""
        tried = "; ".join(r.text() for r in self.rows)
        if self.chosen is None:
            return f"{head}{skipped}: no subset fits: {tried}."
        on = ",".join(map(str, self.chosen.devices))
        return (f"{head}{skipped}: {tried}; the step-down is FSDP on GPUs {on} (each backend of "
                "the chain), accumulating to keep the global batch.")


@dataclass(frozen=True)
class OffloadConsidered(Event):
    """No candidate that keeps the model's state on the GPUs is left. ``mode`` "auto": the
    offloaded candidates (FSDP2 ``CPUOffloadPolicy``) are planned where they fit; "none" (the
    user did not allow it): they are not, and ``would_fit`` says whether one would have.
    ``rows``: per candidate, its GPUs' row and the host's; ``costs``: per candidate, the
    estimated seconds per global batch its host copies and CPU optimizer step add."""

    kind: ClassVar[str] = "offload"
    mode: str
    rows: tuple[tuple[MemoryRow, MemoryRow], ...]
    costs: tuple[tuple[Candidate, float, float], ...] = ()

    @property
    def fitting(self) -> tuple[Candidate, ...]:
        return tuple(g.candidate for g, h in self.rows if g.fits is not False and h.fits is not False)

    @property
    def would_fit(self) -> bool:
        return bool(self.fitting)

    def text(self) -> str:
        rows = "; ".join(f"{g.text()}, and {h.text()}" for g, h in self.rows)
        if self.mode != "auto":
            if not self.would_fit:
                return f"Offloading the model's state to host memory would not fit either: {rows}."
            return ("No candidate that keeps the model's state on the GPUs fits; offloading it "
                    f"to host memory would ({rows}), but offload='none' (the default): pass "
                    "offload='auto' to allow it.")
        cost = "; ".join(f"{c.label}: about +{human_duration(copy_s + opt_s)} per global batch "
                         f"(host copies {human_duration(copy_s)}, optimizer step on the CPU "
                         f"{human_duration(opt_s)}, estimated)" for c, copy_s, opt_s in self.costs)
        return ("No candidate that keeps the model's state on the GPUs fits; offload='auto' "
                f"plans it in host memory (FSDP2 CPUOffloadPolicy): {rows}"
                + (f". Its cost: {cost}" if cost else "") + ".")
