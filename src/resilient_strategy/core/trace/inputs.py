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
