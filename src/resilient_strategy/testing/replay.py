"""Replay a supervised job (``resilient-strategy run``) against a described machine with faults
at given steps, with no process: the same decision (the executor's ``decide`` with simulated
probes), the same classifier (`resilient_strategy.run.verdicts.classify_attempt`, fed
the records the supervisor would have read: a stall, an exit, an error record with its class
chain and frames), and the supervisor's own ladder (`resilient_strategy.run.policy.relaunch`:
the relaunch policy, the failure's cause kept on a step-down, the throughput floor), attempt
by attempt.

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

from ..core.call.arguments import Arguments, CacheArgs, ModelArgs, TrainingArgs, options_from
from ..core.call.options import Options
from ..core.measures.estimate import estimate
from ..core.measures.probe import ProbeResult
from ..core.values.candidate import Candidate
from ..core.values.facts import Facts
from ..deciding.decide import decide
from ..errors import InvalidOptionError, NoWorkingStrategyError
from ..records.progress import COLLECTIVE, STEP_DONE, Record, Stall
from ..records.trainfault import KINDS
from ..run.exitcodes import ExitCode
from ..run.policy import (
    Attempt,
    RelaunchPolicy,
    Rung,
    effective,
    relaunch,
)
from ..run.verdicts import RankExit, Verdict, VerdictKind, classify_attempt
from ..vocab import BACKENDS
from .simulation import Outcome, SimulatedProber

#: The error a rehearsed "error" fault raises when no text is given.
REHEARSED = "resilient_strategy.records.trainfault.RehearsedCommunicationError"


#: What a replayed fault can be: the rehearsal's kinds ("hang": stuck inside the step's
#: all-reduce, "exit": leaves without a word inside it, "error": raises), and "stopped" (a stopped
#: process: its peers wait in the collective it holds up), "never_arrived" (the others wait in a
#: collective it never enters), "slow" (late to the collective by ``seconds``: a fault only past
#: the stall allowance), "busy" (burning CPU in the script's own code past the busy ceiling while
#: the others wait), "asleep" (asleep in the script's own code: a lock, storage that stopped
#: answering; among peers the watch names it a straggler), "exit_outside" (leaves without a word after its step, outside any collective),
#: "lost_node" (another node's supervisor vanished).
REPLAY_KINDS = (*KINDS, "stopped", "never_arrived", "slow", "busy", "asleep", "exit_outside",
                "lost_node")
#: The stall kind the watch names for each replayed hold-up (`records.progress.Stall.kind`).
_STALLS = {"hang": "collective", "stopped": "stopped", "never_arrived": "straggler",
           "slow": "straggler", "busy": "busy", "asleep": "straggler"}
#: Where a replayed "error" was raised: "collective" (inside the step's marked all-reduce, as
#: the rehearsal raises it), "distributed" (in a torch.distributed frame), "script" (in the
#: script's own code, outside any collective).
RAISED_IN = ("collective", "distributed", "script")
_FRAMES = {
    "collective": ({"module": "__main__", "function": "<module>"},
                   {"module": "torch.autograd.graph", "function": "_engine_run_backward",
                    "library": True}),
    "distributed": ({"module": "__main__", "function": "<module>"},
                    {"module": "torch.distributed.distributed_c10d", "function": "all_reduce",
                     "library": True}),
    "script": ({"module": "__main__", "function": "<module>"},),
}


@dataclass(frozen=True)
class MidRunFault:
    """A fault of one rank at one optimizer step while training on ``backend`` (a kind of
    `REPLAY_KINDS`). An "error" raises the class chain ``chain`` (each exception's MRO
    names, the exception first; default: ``error_type`` alone) with ``message``, raised
    ``raised_in`` (`RAISED_IN`), or is the error record a worker wrote (``record``, e.g.
    `from_record` of an evidence file's copy): classified as the supervisor does. For
    "lost_node", ``rank`` is the node that vanished. ``launches``: in the first that many launch
    attempts only (None: every one). ``exitcode`` (negative: the signal that killed it, e.g. -6
    for the SIGABRT of NCCL's watchdog) and ``stderr`` (the end of what the rank printed) are
    what an "exit" or "error" rank left behind besides its error record (an "exit": none)."""

    kind: str
    backend: str
    step: int
    rank: int = 0
    launches: int | None = None
    error_type: str = REHEARSED
    message: str = "rehearsed communication error (a collective failed)"
    chain: tuple[tuple[str, ...], ...] = ()
    raised_in: str = "collective"
    seconds: float = 0.0
    record: Mapping[str, Any] | None = None
    exitcode: int = 1
    stderr: str = ""

    def __post_init__(self) -> None:
        if self.kind not in REPLAY_KINDS or self.backend not in BACKENDS or self.step < 1 or \
                self.rank < 0 or (self.launches is not None and self.launches < 1) or \
                self.raised_in not in RAISED_IN or self.seconds < 0 or self.exitcode == 0:
            raise InvalidOptionError(f"not a mid-run fault: {self!r}")

    @classmethod
    def from_record(cls, record: Mapping[str, Any], backend: str, step: int | None = None,
                    rank: int | None = None, launches: int | None = None) -> MidRunFault:
        """The fault a worker's error record (``rank<N>.error.json``) describes, replayed on
        ``backend`` at its step (or ``step``)."""
        at = step if step is not None else int(record.get("step") or 0) + 1
        return cls("error", backend, at, int(record.get("rank", 0)) if rank is None else rank,
                   launches, record=dict(record))

    def fires(self, candidate: Candidate, attempt: int, after_step: int, steps: int) -> bool:
        return (candidate.backend == self.backend and self.rank < candidate.num_replicas
                and (self.launches is None or attempt < self.launches)
                and after_step < self.step <= steps)

    def _error(self) -> dict[str, Any]:
        if self.record is not None:
            return dict(self.record)
        chain = self.chain or ((self.error_type,),)
        frames = [dict({"file": "train.py", "line": 1}, **f) for f in _FRAMES[self.raised_in]]
        return {"rank": self.rank, "types": list(chain[0]), "message": self.message,
                "step": self.step - 1, "in_collective": self.raised_in == "collective",
                "chain": [{"types": list(t), "message": self.message, "frames": frames}
                          for t in chain]}

    def verdict(self, allowance_s: float = 60.0) -> Verdict | None:
        """What the supervisor's classifier (`classify_attempt`) makes of it, from the records it would have read; None: no fault
        (a slow rank within the allowance)."""
        here = Record(seq=3, phase=COLLECTIVE, k=self.step, t=0.0)
        others = f"others: collective {self.step}"
        if self.kind == "lost_node":
            return Verdict(VerdictKind.LOST, f"node {self.rank}'s supervisor vanished",
                           self.step, "crash", node=self.rank, where=f"node {self.rank}")
        if self.kind == "slow" and self.seconds <= allowance_s:
            return None
        if self.kind in _STALLS:
            inside = self.kind in ("hang", "stopped")
            at = f"collective {self.step}" if inside else f"after step {self.step - 1}"
            return classify_attempt(Stall(_STALLS[self.kind], COLLECTIVE, self.step, (self.rank,),
                                          allowance_s, allowance_s, (f"{self.rank}: {at}",
                                                                     others)), [])
        if self.kind in ("exit", "exit_outside"):
            rec = here if self.kind == "exit" else Record(seq=3, phase=STEP_DONE, k=self.step,
                                                          t=0.0)
            return classify_attempt(None, [RankExit(self.rank, self.exitcode, None, rec,
                                                    self.stderr)])
        error = self._error()
        where = Record(seq=3, phase=str(error.get("phase") or COLLECTIVE), k=self.step, t=0.0)
        return classify_attempt(None, [RankExit(self.rank, self.exitcode, error, where,
                                                self.stderr)])


@dataclass(frozen=True)
class Replay:
    """The attempts of a replayed job, and the exit code ``resilient-strategy run`` would return."""

    attempts: tuple[Attempt, ...]
    exit_code: ExitCode
    candidates: tuple[Candidate, ...] = field(default=())  # each attempt's, in order
    #: what the plan learned of each candidate stepped down from (its cause kept)
    failures: Mapping[str, ProbeResult] = field(default_factory=dict)

    @property
    def backends(self) -> list[str]:
        return [c.backend for c in self.candidates]

    @property
    def actions(self) -> list[str]:
        return [a.judgement.action.value for a in self.attempts]


def replay(facts: Facts, faults: Sequence[MidRunFault], *, framework: str = "torch",
           steps: int = 100, checkpoint_every: int = 10, global_batch_size: int = 256,
           gradient_bytes: int | None = None, probes: Mapping[str, Outcome] | None = None,
           nproc: int | None = None, policy: RelaunchPolicy | None = None,
           stall_timeout_s: float = 60.0) -> Replay:
    """Replay a job of ``steps`` optimizer steps under the supervisor on ``facts`` (see the
    module's docstring). ``probes``: simulated probe outcomes (``{"nccl": "timeout"}``);
    ``stall_timeout_s``: the allowance a slow rank is judged by."""
    policy = policy or RelaunchPolicy()
    prober = SimulatedProber(outcomes=dict(probes or {}))
    opts, env = _options(facts, framework, global_batch_size, gradient_bytes, nproc)
    failures: dict[str, ProbeResult] = {}
    history: list[Attempt] = []
    used: list[Candidate] = []
    chosen, results = _choose(facts, opts, env, prober, failures)
    planned: dict[str, Candidate] = {chosen.key: chosen}

    def rung(c: Candidate) -> Rung:
        return Rung(c.key, c.label, bool(c.devices), c.backend == "cpu", c.num_replicas,
                    estimate(c, facts, results.get(c.key), opts).step_seconds)

    def choose(key: str, failure: ProbeResult) -> Rung:
        nonlocal results
        failures[key] = failure
        nxt, results = _choose(facts, opts, env, prober, failures)
        planned[nxt.key] = nxt
        return rung(nxt)

    resumed = 0
    for number in range(10_000):
        fired = sorted((f for f in faults if f.fires(chosen, number, resumed, steps)),
                       key=lambda f: f.step)
        verdict = next((v for f in fired if (v := f.verdict(stall_timeout_s)) is not None),
                       Verdict(VerdictKind.OK, "finished", steps))
        verdict = effective(verdict, chosen.num_replicas)
        # the supervisor's own ladder (run/policy.relaunch): judge, retry, step down, stop
        judgement, to = relaunch(verdict, rung(chosen), history, policy, choose)
        history.append(Attempt(number, chosen.key, chosen.label, verdict, judgement,
                               resumed or None))
        used.append(chosen)
        if to is None:
            code = judgement.exit_code if judgement.exit_code is not None \
                else ExitCode.INFRASTRUCTURE
            return Replay(tuple(history), code, tuple(used), dict(failures))
        resumed = (verdict.step - 1) // checkpoint_every * checkpoint_every
        chosen = planned[to.key]
    raise AssertionError("unreachable: the policy bounds the attempts")  # pragma: no cover


def _options(facts: Facts, framework: str, global_batch_size: int, gradient_bytes: int | None,
             nproc: int | None) -> tuple[Options, dict[str, str]]:
    """The supervisor's planning options (as run/supervisor.py builds them), no cache."""
    n = nproc if nproc is not None else max(1, len(facts.gpus))
    env: dict[str, str] = {}
    if framework == "torch":
        env = {"WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "RANK": "0", "LOCAL_RANK": "0"}
    opts = options_from(facts, env, Arguments(
        training=TrainingArgs(framework=framework, global_batch_size=global_batch_size),
        model=ModelArgs(gradient_bytes=gradient_bytes), cache=CacheArgs(cache=False)))
    return opts, env


def _choose(facts: Facts, opts: Options, env: Mapping[str, str], prober: SimulatedProber,
            failures: Mapping[str, ProbeResult]) -> tuple[Candidate, dict[str, ProbeResult]]:
    made = decide(facts, opts, env, prober, prober.clock, None, known=failures)
    if made.plan.chosen is None:
        raise NoWorkingStrategyError(opts.framework, [])
    return made.plan.chosen, {**made.results, **failures}
