"""Testing kit: describe fake GPUs, hosts, framework versions and probe outcomes, run
``resilient_strategy()`` against them, and assert on the decision, with no GPU.

    from resilient_strategy.testing import machine, simulate

    def test_my_rtx5090_box_falls_back():
        facts = machine(2, name="NVIDIA GeForce RTX 5090", cc=(12, 0), tensorflow="2.15.1",
                        tf_cuda="12.2", torch=None)
        sel = simulate(facts, framework="tensorflow", global_batch_size=128)
        assert sel.backend == "hierarchical_copy"

The described machine is one typed value, `DescribedMachine` (the keys of a machine case's
``"machine"`` object; ``machine(**kw)`` is ``DescribedMachine(**kw).facts()``).
Probe outcomes are given per candidate: ``{"nccl": "timeout", "nccl+NCCL_P2P_DISABLE=1": "ok"}``
(see `FakeProber`); a prober of your own (a `Prober`) goes in the same place, or runs the
whole decision through `Engine` (``Engine(prober).select(Arguments.from_kwargs(...))``).
A supervised job with faults at given steps replays with
`replay` (the attempts, retry or step-down, exit code). Nothing touches ``os.environ``, the cache, or a real GPU.
"""

from __future__ import annotations

from ..core.values.facts import Platform
from .fakes import (
    Arguments,
    Engine,
    FakeProber,
    Outcome,
    Prober,
    SimulatedProber,
    gpu,
    machine,
    simulate,
)
from .replay import MidRunFault, Replay, replay
from .simulation import DescribedMachine

__all__ = ["Arguments", "DescribedMachine", "Engine", "FakeProber", "MidRunFault", "Outcome", "Platform", "Prober",
           "Replay", "SimulatedProber", "gpu", "machine", "replay", "simulate"]
