"""What the decision saw before planning: the framework picked, the machine's facts, a failure
remembered from the cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .event import Event


# ----- facts and settings ------------------------------------------------------------------------
@dataclass(frozen=True)
class FrameworkPicked(Event):
    """Which framework the decision is for, and why."""

    kind: ClassVar[str] = "framework_picked"
    framework: str
    reason: str

    def text(self) -> str:
        return f"{self.reason}."


@dataclass(frozen=True)
class FactsSeen(Event):
    """What the planner saw: usable GPUs and the framework build."""

    kind: ClassVar[str] = "facts_seen"
    gpus: int
    names: tuple[str, ...]
    framework: str
    version: str | None
    cuda: str | None
    nccl: str | None
    #: the NVIDIA driver (rules key on driver.version); in the event and the JSON, while the
    #: line leaves it to the doctor's facts
    driver: str | None = None
    #: the HIP version of a ROCm build (not CPU-only: it runs AMD GPUs); None otherwise
    hip: str | None = None

    def text(self) -> str:
        gpu_text = f"{self.gpus} GPU(s) ({', '.join(self.names)})" if self.gpus else "no GPU"
        build = (f"CUDA {self.cuda}" if self.cuda else f"ROCm build, HIP {self.hip}" if self.hip
                 else "CPU-only build")
        nccl = f", NCCL {self.nccl}" if self.nccl else ""
        return (f"Saw {gpu_text}; {self.framework} {self.version or 'not installed'} "
                f"({build}{nccl}).")


@dataclass(frozen=True)
class CachedFailure(Event):
    """A failure the cache remembers for ``candidate`` (``status``), seen in ``seen`` runs in a
    row: ``trusted`` (seen twice or more, or probing is off) or probed again (seen once: it may
    have been an overloaded machine)."""

    kind: ClassVar[str] = "cached_failure"
    candidate: str
    status: str
    seen: int
    trusted: bool

    def text(self) -> str:
        if not self.trusted:
            return (f"Cached failure of {self.candidate} ({self.status}) seen in one run only: "
                    "probing it again (one failure may be an overloaded machine).")
        return (f"Cached failure of {self.candidate} ({self.status}) trusted: seen in "
                f"{self.seen} run(s) in a row" + ("." if self.seen >= 2 else
                                                   ", and probing is off."))


@dataclass(frozen=True)
class LauncherSeen(Event):
    """Who started this process (`core.values.launcher.Launcher`: ``python``, ``torchrun``,
    ``environment`` (the user's own RANK / WORLD_SIZE), ``slurm`` (an srun task),
    ``slurm-batch``), where it sits in the job, and the variables derived for the framework from
    the launcher's own (``derived``: SLURM's ranks and rendezvous under torchrun's names; none
    the user set)."""

    kind: ClassVar[str] = "launcher_seen"
    launcher: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int | None
    master_addr: str | None = None
    master_port: int | None = None
    derived: tuple[str, ...] = ()
    job_id: str | None = None

    def text(self) -> str:
        where = (f"rank {self.rank} of {self.world_size} (local rank {self.local_rank}"
                 f"{'' if self.local_world_size is None else f' of {self.local_world_size}'})")
        meet = (f", rendezvous {self.master_addr}:{self.master_port}"
                if self.master_addr and self.master_port and self.world_size > 1 else "")
        made = f"; set for the framework: {', '.join(self.derived)}" if self.derived else ""
        job = f" job {self.job_id}" if self.job_id else ""
        return f"Launcher: {self.launcher}{job}, {where}{meet}{made}."


@dataclass(frozen=True)
class GpusBound(Event):
    """The GPUs each local rank of this node was bound to (by UUID, as each rank sees them) and
    the one each trains on: ``binding`` ``shared`` (every rank sees the same GPUs: rank i takes
    the i-th), ``per_process`` (each rank its own: it takes its first), ``mixed``; ``trains_on``
    per local rank, ``ordinal`` this rank's own CUDA ordinal of it."""

    kind: ClassVar[str] = "gpus_bound"
    binding: str
    seen: tuple[tuple[str, ...], ...]
    trains_on: tuple[str, ...]
    ordinal: int

    def text(self) -> str:
        each = ", ".join(f"local rank {i}: {u}" for i, u in enumerate(self.trains_on))
        return f"GPUs as bound ({self.binding}): {each}."
