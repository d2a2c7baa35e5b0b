"""A decision as the deciders hand it on: the final plan (its chosen candidate and trace), every
probe result it used, and two flags. One shape for every decider: one process, the ranks of a
node, the nodes of a job."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..measures.probe import ProbeResult
from ..values.candidate import Candidate
from .plan import Plan


@dataclass(frozen=True)
class Decision:
    """What deciding produced: the final plan (its ``chosen`` candidate and trace), every probe
    result it used, whether a cached result shaped it without a probe now (``from_cache``), and
    whether the chosen collective was proven by a probe (``proven``)."""

    plan: Plan
    results: Mapping[str, ProbeResult]
    from_cache: bool = False
    proven: bool = True

    @property
    def chosen(self) -> Candidate | None:
        return self.plan.chosen
