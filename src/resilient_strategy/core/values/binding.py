"""Which GPU each local rank of a node trains on, from the GPUs each one sees. Pure.

A scheduler binds GPUs per task: SLURM's ``--gpus-per-task=1`` gives task 0
``CUDA_VISIBLE_DEVICES=0`` and task 1 ``1`` (by index), or, with cgroup device confinement,
``0`` to both, each a different physical GPU; ``--gpus-per-task=2`` gives each two; a MIG slice
per task names it by ``MIG-<uuid>``; torchrun shows every rank every GPU. What is the same GPU
is told by its UUID, never by an ordinal (ordinals are each process's own numbering).

The rule (`bind`): where every rank sees the same GPUs, rank i trains on the i-th (torchrun);
else, where each rank's first GPU is its own, each trains on its first (one or several per
task); else each rank gets one of the GPUs it sees, none taken twice, lower ordinals first (a
binding that differs between ranks). A rank left with none, because the ranks see fewer
distinct GPUs than there are ranks, is ``unbound``: two processes would share one physical GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

BindingKind = Literal["shared", "per_process", "mixed"]


@dataclass(frozen=True)
class Binding:
    """The GPUs each local rank sees (``seen``: UUIDs, in its own CUDA order; only the first of
    a MIG list, since a CUDA process enumerates one MIG instance) and the one it trains on
    (``trains_on``: a UUID, "" for an unbound rank; ``ordinals``: its CUDA ordinal in that
    rank's own numbering, -1 unbound)."""

    kind: BindingKind
    seen: tuple[tuple[str, ...], ...]
    trains_on: tuple[str, ...]
    ordinals: tuple[int, ...]

    @property
    def unbound(self) -> tuple[int, ...]:
        """The local ranks left without a GPU of their own."""
        return tuple(i for i, u in enumerate(self.trains_on) if not u)

    @property
    def shared(self) -> dict[str, tuple[int, ...]]:
        """UUID -> the local ranks that see it, for the GPUs two or more ranks see."""
        out: dict[str, list[int]] = {}
        for rank, uuids in enumerate(self.seen):
            for u in uuids:
                out.setdefault(u, []).append(rank)
        return {u: tuple(r) for u, r in out.items() if len(r) > 1}


def usable(uuids: Sequence[str]) -> tuple[str, ...]:
    """The GPUs one process can train on of those it sees: every one, or the first of a MIG
    list (CUDA enumerates one MIG instance per process)."""
    if uuids and uuids[0].startswith("MIG-"):
        return (uuids[0],)
    return tuple(uuids)


def bind(seen: Sequence[Sequence[str]]) -> Binding:
    """Each local rank's GPU, from ``seen``: per local rank (in order), the UUIDs it sees."""
    lists = tuple(usable(s) for s in seen)
    n = len(lists)
    if n and all(s == lists[0] for s in lists):
        picks = [i if i < len(lists[0]) else -1 for i in range(n)]
        return _binding("shared", lists, picks)
    firsts = [s[0] for s in lists if s]
    if len(firsts) == n and len(set(firsts)) == n:
        return _binding("per_process", lists, [0] * n)
    return _binding("mixed", lists, _match(lists))


def _binding(kind: BindingKind, lists: tuple[tuple[str, ...], ...],
             picks: Sequence[int]) -> Binding:
    return Binding(kind, lists, tuple(lists[r][o] if o >= 0 else "" for r, o in enumerate(picks)),
                   tuple(picks))


def _match(lists: tuple[tuple[str, ...], ...]) -> list[int]:
    """A GPU per rank, none twice (augmenting paths; lower ranks and ordinals first); -1 for a
    rank no assignment reaches."""
    owner: dict[str, int] = {}
    pick = [-1] * len(lists)

    def place(rank: int, tried: set[str]) -> bool:
        for ordinal, u in enumerate(lists[rank]):
            if u in tried:
                continue
            tried.add(u)
            if u not in owner or place(owner[u], tried):
                owner[u] = rank
                pick[rank] = ordinal
                return True
        return False

    for rank in range(len(lists)):
        place(rank, set())
    return pick
