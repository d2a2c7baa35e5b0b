"""Fake hooks for the supervisor's attempt loop (`run.loop.run_attempts`): each attempt comes
to the next scripted verdict, the real ladder (`policy.relaunch`) judges it, and a step-down
takes the next rung of a scripted ladder. Every call is kept as data."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from resilient_strategy.core.measures.probe import ProbeResult
from resilient_strategy.core.values.candidate import Candidate
from resilient_strategy.errors import NoWorkingStrategyError
from resilient_strategy.run.loop import Judged, Observed, Watched, ending_of
from resilient_strategy.run.policy import Attempt, Judgement, RelaunchPolicy, Rung, relaunch
from resilient_strategy.run.preempt import Ending
from resilient_strategy.run.verdicts import Verdict


def rung(backend: str, step_seconds: float = 1.0, gpus: int = 2) -> Rung:
    """A torch candidate on ``gpus`` GPUs, as the ladder sees it."""
    c = Candidate("torch", backend, tuple(range(gpus)), num_replicas=gpus)
    return Rung(c.key, c.label, True, backend == "cpu", gpus, step_seconds)


#: The ladder a fake run steps down: NCCL, then gloo (slower, above the default floor).
LADDER = (rung("nccl"), rung("gloo", step_seconds=2.0))


@dataclass
class FakeHooks:
    """`loop.Hooks` over scripted verdicts (one per attempt, in turn; an `Ending` scripted
    instead: the attempt was stopped from outside) and the scripts' restored steps."""

    verdicts: Sequence[Verdict | Ending]
    restored: Sequence[int | None] = ()
    ladder: Sequence[Rung] = LADDER
    policy: RelaunchPolicy = field(default_factory=RelaunchPolicy)
    #: what was done, as data
    started: list[tuple[int, str]] = field(default_factory=list)
    chosen: list[tuple[str, ProbeResult]] = field(default_factory=list)
    relaunched: list[tuple[int, str, str]] = field(default_factory=list)
    finished: list[Judgement] = field(default_factory=list)

    def sits_out(self, choice: Rung, history: Sequence[Attempt]) -> Ending | None:
        return None

    def start_and_watch(self, attempt: int, choice: Rung) -> Watched | Ending:
        self.started.append((attempt, choice.key))
        scripted = self.verdicts[attempt]
        return scripted if isinstance(scripted, Ending) else Watched(scripted)

    def observe(self, attempt: int, choice: Rung, watched: Watched) -> Observed:
        restored = self.restored[attempt] if attempt < len(self.restored) else None
        return Observed(watched.verdict, {}, restored)

    def _choose(self, key: str, failure: ProbeResult) -> Rung:
        self.chosen.append((key, failure))
        left = [r for r in self.ladder if r.key not in {k for k, _ in self.chosen}]
        if not left:
            raise NoWorkingStrategyError("torch", [])
        return left[0]

    def judge(self, attempt: int, choice: Rung, seen: Observed,
              history: Sequence[Attempt]) -> Judged[Rung]:
        judgement, nxt = relaunch(seen.verdict, choice, history, self.policy, self._choose)
        return Judged(judgement, nxt)

    def record(self, attempt: int, choice: Rung, seen: Observed, judged: Judged[Rung]) -> Attempt:
        return Attempt(attempt, choice.key, choice.label, seen.verdict, judged.judgement,
                       seen.resumed)

    def finish(self, history: Sequence[Attempt], judgement: Judgement) -> Ending:
        self.finished.append(judgement)
        return ending_of(history, judgement)

    def announce_relaunch(self, history: Sequence[Attempt], choice: Rung, seen: Observed,
                          judged: Judged[Rung]) -> None:
        assert judged.next is not None
        self.relaunched.append((len(history), judged.judgement.action.value, judged.next.key))
