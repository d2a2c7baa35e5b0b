"""Replay a supervised job (``resilient-strategy run``) against a described machine with faults
at given steps, with no process: the same decision (the executor's ``decide`` with simulated
probes), the same verdicts, the same relaunch policy (`resilient_strategy.run.policy`) and
throughput floor as the supervisor, attempt by attempt.

    from resilient_strategy.testing import machine
    from resilient_strategy.testing.replay import MidRunFault, replay

    def test_a_transient_exit_on_one_gpu_stays_on_the_gpu():
        job = replay(machine(1, cc=(9, 0)), [MidRunFault("exit", "single_device", 60,
                                                           launches=1)])
        assert [a.judgement.action.value for a in job.attempts] == ["retry", "finish"]
        assert job.exit_code == 0

What a process would have done is described, not run: a fault fires on its rank when the
attempt's candidate trains on its backend and reaches its step (from the checkpoint the attempt
resumed from); checkpoints are taken every ``checkpoint_every`` optimizer steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.arguments import options_from
from ..core.candidate import Candidate
from ..core.estimate import estimate
from ..core.facts import Facts
from ..core.options import Options
from ..core.probe import ERROR, ProbeResult
from ..deciding.decide import decide
from ..errors import InvalidOptionError, NoWorkingStrategyError
from ..records.trainfault import KINDS
from ..run.exitcodes import ExitCode
from ..run.policy import (
    Action,
    Attempt,
    Judgement,
    RelaunchPolicy,
    effective,
    floor_refusal,
    judge,
)
from ..run.verdicts import Verdict, VerdictKind, classify_error
from ..vocab import BACKENDS
from .simulation import Outcome, SimulatedProber

#: The error a rehearsed "error" fault raises when no text is given.
REHEARSED = "resilient_strategy.records.trainfault.RehearsedCommunicationError"


@dataclass(frozen=True)
class MidRunFault:
    """A fault of one rank at one optimizer step while training on ``backend``: "hang" (stuck
    in the step's all-reduce), "exit" (leaves without a word), "error" (raises ``error_type``
    with ``message``: a communication error by default, classified as the supervisor does).
    ``launches``: in the first that many launch attempts only (None: every one)."""

    kind: str
    backend: str
    step: int
    rank: int = 0
    launches: int | None = None
    error_type: str = REHEARSED
    message: str = "rehearsed communication error (a collective failed)"

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.backend not in BACKENDS or self.step < 1 or \
                self.rank < 0 or (self.launches is not None and self.launches < 1):
            raise InvalidOptionError(f"not a mid-run fault: {self!r}")

    def fires(self, candidate: Candidate, attempt: int, after_step: int, steps: int) -> bool:
        return (candidate.backend == self.backend and self.rank < candidate.num_replicas
                and (self.launches is None or attempt < self.launches)
                and after_step < self.step <= steps)

    def verdict(self) -> Verdict:
        where = f"collective {self.step}"
        if self.kind == "hang":
            return Verdict(VerdictKind.STALL, f"rank {self.rank} stuck in {where}", self.step,
                           "timeout", ranks=(self.rank,), where=where)
        if self.kind == "exit":
            return Verdict(VerdictKind.EXIT, f"rank {self.rank} exited in {where}", self.step,
                           "crash", ranks=(self.rank,), where=where)
        kind = {"comm": VerdictKind.BACKEND, "oom": VerdictKind.OOM}.get(
            classify_error([self.error_type], self.message), VerdictKind.USER)
        name = self.error_type.rsplit(".", 1)[-1]
        return Verdict(kind, f"rank {self.rank}: {name}: {self.message}", self.step,
                       "crash" if kind is VerdictKind.BACKEND else "", ranks=(self.rank,),
                       where=where)


@dataclass(frozen=True)
class Replay:
    """The attempts of a replayed job, and the exit code ``resilient-strategy run`` would return."""

    attempts: tuple[Attempt, ...]
    exit_code: ExitCode
    candidates: tuple[Candidate, ...] = field(default=())  # each attempt's, in order

    @property
    def backends(self) -> list[str]:
        return [c.backend for c in self.candidates]

    @property
    def actions(self) -> list[str]:
        return [a.judgement.action.value for a in self.attempts]


def replay(facts: Facts, faults: Sequence[MidRunFault], *, framework: str = "torch",
           steps: int = 100, checkpoint_every: int = 10, global_batch_size: int = 256,
           gradient_bytes: int | None = None, probes: Mapping[str, Outcome] | None = None,
           nproc: int | None = None, policy: RelaunchPolicy | None = None) -> Replay:
    """Replay a job of ``steps`` optimizer steps under the supervisor on ``facts`` (see the
    module's docstring). ``probes``: simulated probe outcomes (``{"nccl": "timeout"}``)."""
    policy = policy or RelaunchPolicy()
    prober = SimulatedProber(outcomes=dict(probes or {}))
    opts, env = _options(facts, framework, global_batch_size, gradient_bytes, nproc)
    failures: dict[str, ProbeResult] = {}
    history: list[Attempt] = []
    used: list[Candidate] = []
    chosen, results = _choose(facts, opts, env, prober, failures)
    resumed = 0
    for number in range(10_000):
        fault = min((f for f in faults if f.fires(chosen, number, resumed, steps)),
                    key=lambda f: f.step, default=None)
        verdict = (Verdict(VerdictKind.OK, "finished", steps) if fault is None
                   else effective(fault.verdict(), chosen.num_replicas))
        judgement = judge(verdict, chosen.key, history, policy)
        nxt: Candidate | None = None
        if judgement.action is Action.RETRY:
            nxt = chosen
        elif judgement.action is Action.STEP_DOWN:
            failures[chosen.key] = ProbeResult(chosen.key, ERROR, 0.0, "",
                                               f"failed mid-run at step {verdict.step}",
                                               extra=(("mid_run", str(verdict.step)),))
            try:
                nxt, results = _choose(facts, opts, env, prober, failures)
            except NoWorkingStrategyError as exc:
                judgement = Judgement(Action.STOP, f"no candidate is left: {exc}",
                                      ExitCode.INFRASTRUCTURE)
            else:
                then = estimate(chosen, facts, results.get(chosen.key), opts).step_seconds
                now = estimate(nxt, facts, results.get(nxt.key), opts).step_seconds
                refusal = floor_refusal(chosen.label, bool(chosen.devices), then, nxt.label,
                                        nxt.backend == "cpu", now, policy)
                if refusal is not None:
                    nxt, judgement = None, Judgement(Action.STOP, f"not relaunched: {refusal}",
                                                     ExitCode.INFRASTRUCTURE)
        history.append(Attempt(number, chosen.key, chosen.label, verdict, judgement,
                               resumed or None))
        used.append(chosen)
        if nxt is None:
            code = judgement.exit_code if judgement.exit_code is not None \
                else ExitCode.INFRASTRUCTURE
            return Replay(tuple(history), code, tuple(used))
        resumed = (verdict.step - 1) // checkpoint_every * checkpoint_every
        chosen = nxt
    raise AssertionError("unreachable: the policy bounds the attempts")  # pragma: no cover


def _options(facts: Facts, framework: str, global_batch_size: int, gradient_bytes: int | None,
             nproc: int | None) -> tuple[Options, dict[str, str]]:
    """The supervisor's planning options (as run/supervisor.py builds them), no cache."""
    n = nproc if nproc is not None else max(1, len(facts.gpus))
    env: dict[str, str] = {}
    if framework == "torch":
        env = {"WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "RANK": "0", "LOCAL_RANK": "0"}
    opts = options_from(
        facts, env, framework=framework, global_batch_size=global_batch_size, devices=None,
        probe=None, timeout=None, prefer=None, dry_run=False, model=None,
        gradient_bytes=gradient_bytes, sample_seconds=None, max_per_replica_batch=None,
        rules=(), disable_rules=(), cache=False, cache_dir=None, cache_ttl=None,
        precision="auto", logical_cpus=0)
    return opts, env


def _choose(facts: Facts, opts: Options, env: Mapping[str, str], prober: Any,
            failures: Mapping[str, ProbeResult]) -> tuple[Candidate, dict[str, ProbeResult]]:
    made = decide(facts, opts, env, prober, prober.clock, None, known=failures)
    if made.plan.chosen is None:
        raise NoWorkingStrategyError(opts.framework, [])
    return made.plan.chosen, {**made.results, **failures}
