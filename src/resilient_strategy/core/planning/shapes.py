"""The planner's shapes: `Plan` (what `plan` returns), a ranked candidate, a candidate ruled
out, and `Build`, the scratch one `plan` call fills in and never lets escape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..measures.estimate import Estimate
from ..measures.probe import ProbeResult
from ..trace.event import Event, Note, render
from ..trace.ruling import CandidateRuledOut
from ..values.candidate import Candidate

if TYPE_CHECKING:
    pass

@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    estimate: Estimate
    result: ProbeResult | None = None


@dataclass(frozen=True)
class RuledOut:
    candidate: Candidate
    reason: str
    rule: str = ""  # rule id, or "probe"
    result: ProbeResult | None = None  # the failed probe, when a probe ruled it out


@dataclass(frozen=True)
class Plan:
    framework: str
    ranked: tuple[Ranked, ...]  # viable candidates, in the order they are tried
    ruled_out: tuple[RuledOut, ...]
    events: tuple[Event, ...]  # the trace, typed (the `trace` folder)
    warnings: tuple[str, ...]
    rules_fired: tuple[str, ...]
    chosen: Candidate | None = None
    next_probe: Candidate | None = None
    #: The replicas of the widest way to train this job: a one-device fallback keeps its
    #: per-device batch and accumulates up to this many steps (handed to `plan`).
    reference_replicas: int = 1

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        return tuple(r.candidate for r in self.ranked)

    @property
    def trace(self) -> tuple[str, ...]:
        """The events as lines of text."""
        return render(self.events)

    def explain(self) -> str:
        return "\n".join(self.trace)


@dataclass
class Build:
    """Mutable scratch for one plan() call; never escapes it."""

    simulated: bool = False
    events: list[Event] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    ruled_out: list[RuledOut] = field(default_factory=list)
    reference: int = 1  # the widest candidate's replicas, as the batch split used it

    def note(self, topic: str, message: str) -> None:
        self.events.append(Note(topic, message))

    def rule_out(self, c: Candidate, by: str, reason: str, *, rule: str = "", source: str = "",
                 result: ProbeResult | None = None, said: bool = False) -> None:
        self.ruled_out.append(RuledOut(c, reason, rule or ("probe" if by == "probe" else ""),
                                       result))
        self.events.append(CandidateRuledOut(c, by, reason, rule, source, result,
                                             self.simulated, said))


