"""Fake machines and probe outcomes for users' unit tests and ours (built on
`resilient_strategy.testing.simulation`, the production module that describes machines)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.values.facts import Facts
from ..selection import Selection
from .simulation import FakeProber, Outcome, SimulatedProber, gpu, machine

__all__ = ["FakeProber", "Outcome", "SimulatedProber", "gpu", "machine", "simulate"]


def simulate(
    facts: Facts,
    outcomes: Mapping[str, Outcome] | FakeProber | None = None,
    **kwargs: Any,
) -> Selection:
    """Run ``resilient_strategy()`` for described facts with simulated probe outcomes.

    Uses the facts' own env (never ``os.environ``), no cache unless asked, and sets nothing.
    """
    from ..deciding.executor import resilient_strategy

    prober = outcomes if isinstance(outcomes, FakeProber) else FakeProber(dict(outcomes or {}))
    kwargs.setdefault("cache", False)
    kwargs.setdefault("env", facts.env_map)
    return resilient_strategy(facts=facts, _prober=prober, _clock=prober.clock, **kwargs)
