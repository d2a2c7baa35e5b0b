"""The prober's interface: what the decision loop asks of whoever proves a candidate.

`Prober` is an abstract base with default methods (as resolvelib's ``AbstractProvider``):
a prober says how to prove one candidate (`Prober.probe`) and inherits the rest, so the
decision loop calls every ability directly, never after asking whether it is there. The real
probers (`probing.prober.DeferredHealthProber`, the decision's default) and the testing kit's
``SimulatedProber`` are its subclasses; a plain function ``(spec, env) -> ProbeResult`` becomes
one through `as_prober`. It is injected through a public object,
``resilient_strategy.testing.Engine``; nothing imports a framework or starts a process here.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import ClassVar

from ..core.measures.probe import ProbeResult, ProbeSpec

__all__ = ["ProbeFn", "Prober", "as_prober"]

#: A prober as a plain function: a spec and the environment to probe in -> what it proved.
ProbeFn = Callable[[ProbeSpec, Mapping[str, str]], ProbeResult]


class Prober(ABC):
    """Proves candidates for the decision loop (``deciding.decide.decide``).

    Override `probe`; the defaults of the rest describe a prober that runs nothing of its own
    beside the probe: no deferred GPU health check, the wall clock, real outcomes.
    """

    #: The outcomes are described, not measured (the trace and the Selection say so).
    simulated: ClassVar[bool] = False
    #: The prober starts real workers: the decision warns when the probe timeout is below what
    #: a worker needs to start here, and puts a failure on a full temp directory.
    starts_processes: ClassVar[bool] = False
    #: The probes run without the GPU health check after a killed GPU probe: the decision
    #: calls `check_gpus` when one is due (`probing.health.Unproven`), else never.
    defers_gpu_check: ClassVar[bool] = False

    @abstractmethod
    def probe(self, spec: ProbeSpec, env: Mapping[str, str]) -> ProbeResult:
        """Prove ``spec``'s candidate in ``env``, within ``spec.timeout_s``."""

    def __call__(self, spec: ProbeSpec, env: Mapping[str, str]) -> ProbeResult:
        return self.probe(spec, env)

    def check_gpus(self, framework: str, devices: tuple[int, ...],
                   env: Mapping[str, str]) -> list[tuple[int, str]]:
        """The broken GPUs of ``devices``, each with why (called only where
        `defers_gpu_check`); by default none."""
        return []

    def check_seconds(self, framework: str, gpus: int, env: Mapping[str, str]) -> float:
        """What a GPU health check of ``gpus`` GPUs typically costs (weighed against the probe
        budget left); by default the typical figure of a GPU machine, forked from the deciding
        process, torch imported (`probing.cost.health_check_seconds`)."""
        from .cost import health_check_seconds

        return health_check_seconds(framework, gpus, forked=True, warm=True)

    def clock(self) -> float:
        """The decision's monotonic clock (the probe budget is spent on it); by default the
        wall clock's."""
        return time.monotonic()


class _FunctionProber(Prober):
    """A plain function ``(spec, env) -> ProbeResult`` as a `Prober` with every default."""

    def __init__(self, fn: ProbeFn) -> None:
        self.fn = fn

    def probe(self, spec: ProbeSpec, env: Mapping[str, str]) -> ProbeResult:
        return self.fn(spec, env)


def as_prober(prober: Prober | ProbeFn) -> Prober:
    """``prober`` itself when it is a `Prober`, else the plain function as one."""
    return prober if isinstance(prober, Prober) else _FunctionProber(prober)
