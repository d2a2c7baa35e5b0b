"""Fake machines and probe outcomes for users' unit tests and ours (built on
`resilient_strategy.testing.simulation`, the production module that describes machines), and
the decision engine with a prober injected (`Engine`, `Prober`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.call.arguments import Arguments
from ..core.values.facts import Facts
from ..deciding.executor import Engine
from ..probing.base import ProbeFn, Prober
from ..selection import Selection
from .simulation import FakeProber, Outcome, SimulatedProber, gpu, machine

__all__ = ["Arguments", "Engine", "FakeProber", "Outcome", "Prober", "SimulatedProber", "gpu",
           "machine", "simulate"]


def simulate(
    facts: Facts,
    outcomes: Mapping[str, Outcome] | Prober | ProbeFn | None = None,
    *,
    env: Mapping[str, str] | None = None,
    alone: bool = False,
    **kwargs: Any,
) -> Selection:
    """Run ``resilient_strategy()`` for described facts with simulated probe outcomes.

    ``outcomes``: per candidate (see `FakeProber`), or a prober of your own (a `Prober`, or a
    function ``(spec, env) -> ProbeResult``). ``env``: the environment decided on (default the
    facts' own, never ``os.environ``); ``alone``: see `Engine`. The other keywords are
    ``resilient_strategy()``'s. No cache unless asked; nothing is set.
    """
    prober: Prober | ProbeFn = (
        FakeProber(dict(outcomes or {})) if outcomes is None or isinstance(outcomes, Mapping)
        else outcomes)
    kwargs.setdefault("cache", False)
    return Engine(prober, alone=alone).select(
        Arguments.from_kwargs(**kwargs), env=facts.env_map if env is None else env, facts=facts)
