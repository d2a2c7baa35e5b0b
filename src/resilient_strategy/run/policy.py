"""What the supervisor does after an attempt (pure): finish, retry the same strategy, step down
to the next candidate, or stop with an exit code for the scheduler.

- A first failure not pinned on the backend (a stall, a rank that exited without a
  communication-error signature, a node that vanished) is retried once on the same strategy,
  from the last checkpoint.
- A communication error steps down at once, unless it comes after a healthy stretch
  (``fault_window`` optimizer steps or more since the last fault, or since the start): a track
  record earns a retry on the same strategy first.
- Repeats are a fault rate, not "one more step resets it": a second fault on the same strategy
  within ``fault_window`` steps of the one before steps down, whatever its kind.
- A one-device job never blames a backend: a signature there counts as an exit.
- A GPU that failed in hardware (the ``gpu_fault`` cause: an uncorrectable ECC or NVLink
  error, a GPU fallen off the bus, an unspecified launch failure) is the machine's: retried
  once (a new process often recovers), never stepped down (the next strategy would run on the
  same GPU); a repeat stops with `INFRASTRUCTURE`, the node's fault: requeue elsewhere, the
  node excluded under SLURM.
- The script's own faults (an exception, out of memory, diverged ranks) stop with
  `USER_ERROR`: do not requeue.
- A launch fault (a port held, a store unreachable, a name that does not resolve, a library
  that breaks ``import torch``, CUDA initialised too early: the ``launch`` verdict) stops with
  `USAGE`, the configuration's code: every strategy would meet it. So does a fault that recurs
  identically (the same cause and the same quoted error, numbers aside) on a second strategy
  (`recurring`): it follows the job, not a strategy. Neither steps down nor reaches the cache.
- A node cut off from the job's store (multi-node) stops with
  `INFRASTRUCTURE`: the others go on without it.
- A node lost at a relaunch's agreement is dropped: node 0 goes on alone
  (`Action.FEWER_NODES`, decided by the supervisor at the agreement).
- ``max_attempts_without_progress`` attempts in a row that get fewer than
  ``min_progress_steps`` further than the furthest step reached before stop the run (a crash
  loop, also one that creeps a step further each time), whatever the relaunch budget.
- A step-down never lands on a candidate estimated below ``min_throughput`` x the throughput of
  the one that failed, nor moves a GPU job to the CPU unless ``allow_cpu``
  (`floor_refusal`).

`judge` takes the attempts so far and the new verdict; `relaunch` takes the
judgement on to the next attempt (the failure the plan learns on a step-down, with its cause;
the next candidate, from a chooser the caller passes; the floor). The supervisor and the testing
kit's replay (`resilient_strategy.testing.replay`) both run `relaunch`: one ladder.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..records.phases import Timeline

from ..core.call.options import DEFAULT_FAULT_WINDOW
from ..core.knowledge.causes import SCRIPT_CAUSES, what_and_fix
from ..core.measures.estimate import throughput_fraction
from ..core.measures.probe import ERROR, ProbeResult
from ..core.values.candidate import CandidateKey
from ..errors import NoWorkingStrategyError
from ..records.progress import COLLECTIVE, COMM_SETUP
from .exitcodes import ExitCode
from .verdicts import Verdict, VerdictKind, one_line

#: The default throughput floor of a step-down, relative to what failed.
DEFAULT_MIN_THROUGHPUT = 0.25
#: The default crash-loop bound: attempts in a row without progress.
DEFAULT_MAX_ATTEMPTS_WITHOUT_PROGRESS = 3
#: The optimizer steps an attempt must complete beyond the furthest before to count as
#: progress (an attempt that creeps one step further each time is a crash loop).
DEFAULT_MIN_PROGRESS_STEPS = 10
#: The window of the fault rate, in optimizer steps (``--fault-window``): a second fault on one
#: strategy within it steps down; a communication error after this many steps without a fault
#: is retried first.
DEFAULT_FAULT_WINDOW = DEFAULT_FAULT_WINDOW


@dataclass(frozen=True)
class RelaunchPolicy:
    min_throughput: float = DEFAULT_MIN_THROUGHPUT
    allow_cpu: bool = False
    max_attempts_without_progress: int = DEFAULT_MAX_ATTEMPTS_WITHOUT_PROGRESS
    max_relaunches: int | None = None  # None: no count limit (the bounds above still hold)
    min_progress_steps: int = DEFAULT_MIN_PROGRESS_STEPS
    fault_window: int = DEFAULT_FAULT_WINDOW


class Action(Enum):
    FINISH = "finish"
    RETRY = "retry"
    STEP_DOWN = "step_down"
    #: a node did not join the relaunch: the job goes on without it (node 0 alone, with
    #: accumulation keeping the global batch)
    FEWER_NODES = "fewer_nodes"
    #: a node asked to join: the job relaunches across the larger group from the last checkpoint
    MORE_NODES = "more_nodes"
    #: the step was measured and a proven candidate would be clearly faster: stopped at a
    #: checkpoint and relaunched there for a trial (issue 41; `switch_due`, `trial_kept`)
    TRIAL = "trial"
    #: the trial was measured slower than the first: stopped at a checkpoint and relaunched
    #: back on the first candidate
    SWITCH_BACK = "switch_back"
    STOP = "stop"


#: Which rule of `judge` decided (`Judgement.rule`, the word written to records): the
#: training finished; the machine's storage; the script's fault; the launch's; a fault that
#: follows the job (recurring); a node cut off; a node that asked to join; a crash loop; the
#: relaunch limit; a repeat within the fault window with evidence against the strategy's
#: transport (stepped down); a repeat whose evidence clears the transport (stopped, never
#: stepped down); a backend signature after a short stretch (stepped down); one after a healthy
#: stretch (retried); a first fault not pinned on the backend (retried); no candidate left, or
#: only below the floor, on a step-down (stopped by `relaunch`).
RULES = ("finished", "storage", "script", "launch", "recurring", "cut_off", "join",
         "crash_loop", "relaunch_limit", "fault_rate", "not_the_transport", "backend",
         "healthy_retry", "first_fault", "no_candidate", "floor", "")


@dataclass(frozen=True)
class Looped:
    """One attempt of a crash loop, as a stop lists it (`Judgement.loop`)."""

    number: int  # 0 for the first launch
    candidate: str
    kind: str  # its verdict's kind
    cause: str  # its verdict's cause ("" when none)
    stall: str  # its stall's kind ("" for any other verdict)
    step: int

    def to_dict(self) -> dict[str, Any]:
        return {"number": self.number, "candidate": self.candidate, "kind": self.kind,
                "cause": self.cause, "stall": self.stall, "step": self.step}

    def words(self) -> str:
        said = self.stall or self.cause
        return (f"attempt {self.number + 1} {self.kind}{f' ({said})' if said else ''} at step "
                f"{self.step}")


@dataclass(frozen=True)
class Judgement:
    action: Action
    reason: str  # words: why
    exit_code: ExitCode | None = None  # FINISH and STOP only
    #: the rule that decided (`RULES`; "" for the supervisor's own: a switch, fewer nodes)
    rule: str = ""
    #: a crash-loop stop: every attempt of the loop, oldest first (empty otherwise)
    loop: tuple[Looped, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action.value, "reason": self.reason,
                "exit_code": None if self.exit_code is None else int(self.exit_code),
                "rule": self.rule, "loop": [a.to_dict() for a in self.loop]}


@dataclass(frozen=True)
class Attempt:
    """One launch attempt: where it ran, what it came to, and what was done next."""

    number: int  # 0 for the first launch
    candidate: str  # the candidate key
    label: str
    verdict: Verdict
    judgement: Judgement
    resumed_from: int | None = None  # the checkpoint step it resumed from (None: the start)
    #: When each phase began, the supervisor's and each rank's (`phases`).
    times: Timeline | None = None
    #: What rank 0 measured of the step in this attempt (`records.measured.MeasuredNote`'s
    #: dict: the rate and a clearly faster candidate), and what was done with it
    #: (``measured["outcome"]``: `MEASURED_OUTCOMES`); None: not measured.
    measured: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"number": self.number, "candidate": self.candidate, "label": self.label,
                "verdict": self.verdict.to_dict(), **self.judgement.to_dict(),
                "resumed_from": self.resumed_from,
                "times": None if self.times is None else self.times.to_dict(),
                "measured": self.measured}


def effective(verdict: Verdict, world_size: int) -> Verdict:
    """A one-device job has no backend to blame: a communication signature there is an exit."""
    if verdict.kind is VerdictKind.BACKEND and world_size <= 1:
        return replace(verdict, kind=VerdictKind.EXIT)
    return verdict


#: Verdicts that end an attempt with no fault: the supervisor stopped a healthy attempt at a
#: checkpoint (a measured switch, a node that asked to join). Never counted as a fault.
_NO_FAULT = frozenset({VerdictKind.OK, VerdictKind.SWITCH, VerdictKind.JOIN})


def is_fault(verdict: Verdict) -> bool:
    """Whether an attempt ended in a fault (not finished, not stopped healthy at a
    checkpoint for a switch or a join). Pure."""
    return verdict.kind not in _NO_FAULT


def without_progress(history: Sequence[Verdict], min_steps: int = 1) -> int:
    """How many of the last attempts in a row completed fewer than ``min_steps`` optimizer
    steps beyond the furthest completed before each of them (an attempt that failed in step k
    completed k - 1; one stopped healthy at a checkpoint completed its step)."""
    best, idle = 0, 0
    for v in history:
        done = v.step if not is_fault(v) else max(0, v.step - 1)
        if done >= best + max(1, min_steps):
            best, idle = done, 0
        else:
            best, idle = max(best, done), idle + 1
    return idle


def healthy_steps(verdict: Verdict, history: Sequence[Attempt]) -> int:
    """The optimizer steps since the last fault before this one (or since the start)."""
    last = max((a.verdict.step for a in history if is_fault(a.verdict)), default=0)
    return max(0, verdict.step - last)


def faults_in_window(verdict: Verdict, candidate: str, history: Sequence[Attempt],
                     window: int) -> list[Attempt]:
    """The earlier faults on ``candidate`` within ``window`` steps before this one."""
    return [a for a in history if a.candidate == candidate and is_fault(a.verdict)
            and verdict.step - a.verdict.step < window]


def fault_signature(verdict: Verdict) -> str | None:
    """What makes two faults the same fault (pure): a communication error or an exit with a
    rank's own error (an error record, or a cause the signature table placed), by its cause and
    its quoted error with the numbers masked (each rank's port, each attempt's pid). None for
    a fault with nothing quoted to compare (a stall, a bare signal, a lost node)."""
    if verdict.kind not in (VerdictKind.BACKEND, VerdictKind.EXIT):
        return None
    if not verdict.blame and verdict.cause in ("", "crash", "worker_error"):
        return None
    quoted = re.sub(r"\d+", "#", " ".join(verdict.detail.split()))
    return f"{verdict.cause}|{quoted}" if quoted else None


def _backend(key: str) -> str:
    parsed = CandidateKey.read(key)
    return key if parsed is None else parsed.backend


def recurring(verdict: Verdict, candidate: str, history: Sequence[Attempt]) -> Attempt | None:
    """The earlier attempt on another strategy (another backend: NCCL with a remedy, or with
    FSDP, is still NCCL) that failed exactly as ``verdict`` says (`fault_signature`), if any
    (pure): a fault that follows the job from backend to backend is not a backend's."""
    mine = fault_signature(verdict)
    if mine is None:
        return None
    return next((a for a in reversed(history) if _backend(a.candidate) != _backend(candidate)
                 and fault_signature(a.verdict) == mine), None)


#: The stall kinds whose evidence points at the strategy's transport (`Verdict.stall`): every
#: rank inside communicator setup, or inside one collective every rank entered and some never
#: left. A rank that never arrived, is stopped, busy or asleep in its own code is held up by
#: the script or the machine: another strategy would not help it, and watches it less.
TRANSPORT_STALLS = frozenset({"setup", "collective"})
#: The phases a rank that died without a word was in that are the transport's calls.
_TRANSPORT_PHASES = frozenset({COMM_SETUP, COLLECTIVE})
#: The causes that are the machine's storage (a full disk, an I/O error, a stale handle, a
#: read-only file system): never a strategy's.
STORAGE_CAUSES = frozenset({"no_space", "storage_error"})
#: The causes that are the machine's own (its storage, its GPU failed in hardware): a repeat
#: stops for a requeue elsewhere, never a step-down (the next strategy runs on the same GPUs).
MACHINE_CAUSES = STORAGE_CAUSES | {"gpu_fault"}


def against_transport(verdict: Verdict) -> bool:
    """Whether a fault's evidence points at the strategy's transport, so that a step-down may
    help (pure): a backend signature; a stall of every rank inside communicator setup or one
    collective (`TRANSPORT_STALLS`); a rank that died without a word inside one (`phase`); a
    node lost (the nodes' regrouping at the relaunch decides). Never an error from storage or a
    GPU's hardware (`MACHINE_CAUSES`), a stall whose ranks never arrived, are stopped, busy or asleep in their
    own code, nor an exit outside any collective or communicator setup."""
    if verdict.cause in MACHINE_CAUSES:
        return False
    if verdict.kind in (VerdictKind.BACKEND, VerdictKind.LOST):
        return True
    if verdict.kind is VerdictKind.STALL:
        return verdict.stall in TRANSPORT_STALLS
    return verdict.kind is VerdictKind.EXIT and verdict.phase in _TRANSPORT_PHASES


def judge(verdict: Verdict, candidate: str, history: Sequence[Attempt],
          policy: RelaunchPolicy) -> Judgement:
    """What to do after an attempt on ``candidate`` came to ``verdict`` (already
    `effective`), the attempts before it being ``history``."""
    return (_settled(verdict, candidate, history) or _bounded(verdict, candidate, history, policy)
            or _ladder(verdict, candidate, history, policy))


def _settled(verdict: Verdict, candidate: str, history: Sequence[Attempt]) -> Judgement | None:
    """A verdict that decides by itself: finished, the machine's full disk, the script's, the
    launch's, a fault that follows the job, a node cut off, a node asking to join."""
    if verdict.ok:
        return Judgement(Action.FINISH, "the training finished", ExitCode.SUCCESS, "finished")
    if verdict.cause == "no_space":  # the machine's, neither the script's nor a strategy's
        return Judgement(Action.STOP, "a disk the run writes to is full: the machine's fault, "
                         "not the script's nor a strategy's (free space or requeue elsewhere)",
                         ExitCode.INFRASTRUCTURE, "storage")
    if verdict.users:
        return Judgement(Action.STOP, "the script's own fault: another attempt or strategy "
                         f"would fail the same way{_fix(verdict.cause)}", ExitCode.USER_ERROR,
                         "script")
    if verdict.kind is VerdictKind.LAUNCH:
        said = f"{verdict.detail} (" if verdict.detail else "a launch fault ("
        return Judgement(Action.STOP, f"{said}the launch's, not a strategy's: every strategy "
                         "would meet it; no step-down, do not requeue)", ExitCode.USAGE, "launch")
    again = recurring(verdict, candidate, history)
    if again is not None:
        return Judgement(Action.STOP, f"the same fault as on {again.label} (attempt "
                         f"{again.number + 1}): it follows the job from strategy to strategy, "
                         "so it is the launch's or the environment's, not a strategy's (no "
                         "further step-down; fix it and run again, do not requeue)",
                         ExitCode.USAGE, "recurring")
    if verdict.kind is VerdictKind.CUT_OFF:
        return Judgement(Action.STOP, "this node is cut off from the job's store: the other "
                         "nodes go on without it (requeue it elsewhere)", ExitCode.INFRASTRUCTURE,
                         "cut_off")
    if verdict.kind is VerdictKind.JOIN:
        return Judgement(Action.MORE_NODES, "a node asked to join: relaunched across the larger "
                         "group from the last checkpoint", rule="join")
    return None


def _fix(cause: str) -> str:
    """The workaround a script's cause names (`SCRIPT_CAUSES`), as a clause ("": none)."""
    if cause not in SCRIPT_CAUSES:
        return ""
    what, fix = what_and_fix(cause)
    return f" ({what}: {fix})" if fix else f" ({what})"


def _bounded(verdict: Verdict, candidate: str, history: Sequence[Attempt],
             policy: RelaunchPolicy) -> Judgement | None:
    """The run's bounds: a crash loop (every attempt of it listed), the relaunch limit."""
    idle = without_progress([*(a.verdict for a in history), verdict], policy.min_progress_steps)
    if idle >= policy.max_attempts_without_progress:
        loop = crash_loop(verdict, candidate, history, idle)
        return Judgement(Action.STOP, f"a crash loop: {idle} attempts in a row got fewer than "
                         f"{policy.min_progress_steps} steps further (the bound is "
                         "--max-attempts-without-progress "
                         f"{policy.max_attempts_without_progress}): "
                         + "; ".join(a.words() for a in loop), ExitCode.INFRASTRUCTURE,
                         "crash_loop", loop)
    if policy.max_relaunches is not None and len(history) >= policy.max_relaunches:
        return Judgement(Action.STOP, f"the relaunch limit ({policy.max_relaunches}) is reached",
                         ExitCode.INFRASTRUCTURE, "relaunch_limit")
    return None


def crash_loop(verdict: Verdict, candidate: str, history: Sequence[Attempt],
               idle: int) -> tuple[Looped, ...]:
    """The last ``idle`` attempts (the new one on ``candidate`` last), as a crash-loop stop
    lists them. Pure."""
    seen = [(a.number, a.candidate, a.verdict) for a in history]
    seen.append((len(history), candidate, verdict))
    return tuple(Looped(n, c, v.kind.value, v.cause, v.stall, v.step)
                 for n, c, v in seen[-idle:] if idle > 0)


def _ladder(verdict: Verdict, candidate: str, history: Sequence[Attempt],
            policy: RelaunchPolicy) -> Judgement:
    """Retry, step down or stop: a repeat within the fault window steps down only on evidence
    against the transport (`against_transport`), else stops; a backend signature steps down
    unless it comes after a healthy stretch; any other first fault is retried."""
    recent = faults_in_window(verdict, candidate, history, policy.fault_window)
    if recent:
        before = recent[-1].verdict
        said = (f"a second fault ({_kind(verdict)} after {_kind(before)} at step {before.step}) "
                f"on this strategy within {policy.fault_window} steps")
        if not against_transport(verdict):
            return _cleared(verdict, said)
        return Judgement(Action.STEP_DOWN, said, rule="fault_rate")
    if verdict.pinned:
        healthy = healthy_steps(verdict, history)
        if healthy < policy.fault_window:
            return Judgement(Action.STEP_DOWN, "a communication error pins it on the backend "
                             f"({healthy} steps since the last fault or the start)",
                             rule="backend")
        return Judgement(Action.RETRY, f"a communication error after {healthy} healthy steps: "
                         "retried once on this strategy from the last checkpoint before any "
                         "step-down", rule="healthy_retry")
    return Judgement(Action.RETRY, f"a first {_kind(verdict)} on this strategy is not pinned "
                     "on the backend: retried once from the last checkpoint", rule="first_fault")


def _kind(verdict: Verdict) -> str:
    return verdict.kind.value + (f" ({verdict.stall})" if verdict.stall else "")


def _cleared(verdict: Verdict, said: str) -> Judgement:
    """A repeat whose evidence clears the transport: stopped, never stepped down (another
    strategy would not help, and would watch the job less): a rank busy in the script's own
    code is the script's (`USER_ERROR`); asleep, stopped, never arrived, storage, an exit
    outside any collective are the machine's or unknown (`INFRASTRUCTURE`: requeue)."""
    script = verdict.kind is VerdictKind.STALL and verdict.stall == "busy"
    whose = ("the script's own code keeps its rank busy" if script
             else "the machine's storage" if verdict.cause in STORAGE_CAUSES
             else "a GPU of this machine failed in hardware" if verdict.cause == "gpu_fault"
             else "the evidence points at the script or the machine")
    return Judgement(Action.STOP, f"{said}, and nothing in it points at the transport "
                     f"({whose}): not stepped down, where it would be watched less",
                     ExitCode.USER_ERROR if script else ExitCode.INFRASTRUCTURE,
                     "not_the_transport")


def floor_refusal(failed_label: str, failed_gpu: bool, failed_step_s: float, next_label: str,
                  next_cpu: bool, next_step_s: float, policy: RelaunchPolicy,
                  failed_replicas: int = 0, next_replicas: int = 0) -> str | None:
    """Why a step-down from what failed to the next candidate is refused (None: allowed): a GPU
    job onto the CPU without ``allow_cpu``, or an estimated throughput below the floor. GPUs to
    GPUs, the throughput is at most the ratio of the replicas that compute
    (`throughput_fraction`: 8 GPUs to 1 is at most
    1/8). The reason names the option that allows it."""
    gpus_to_gpus = failed_gpu and not next_cpu
    fraction = throughput_fraction(failed_step_s, next_step_s,
                                   failed_replicas if gpus_to_gpus else 0,
                                   next_replicas if gpus_to_gpus else 0)
    would = (f"it would have relaunched on {next_label}, estimated at "
             f"{max(fraction, 0.001):.1%} of the throughput of {failed_label}")
    if failed_gpu and next_cpu:
        if policy.allow_cpu:
            return None
        return f"{would}: a GPU job moves to the CPU only with --allow-cpu"
    if fraction < policy.min_throughput:
        return (f"{would}, below the floor of --min-throughput {policy.min_throughput:g} (pass "
                f"--min-throughput {_allowing(fraction)} to allow it)")
    return None


def _allowing(fraction: float) -> str:
    """A floor (two decimals, rounded down) that lets ``fraction`` through."""
    return f"{max(0.0, int(fraction * 100) / 100):g}"


@dataclass(frozen=True)
class Rung:
    """A candidate as the ladder sees it: its key and label, whether it runs on GPUs or on the
    CPU, its replicas and its estimated seconds per global batch."""

    key: str
    label: str
    gpu: bool
    cpu: bool
    replicas: int
    step_seconds: float


def mid_run_failure(key: str, verdict: Verdict, rehearsed: bool = False) -> ProbeResult:
    """What the plan learns of a candidate that failed mid-run and is stepped down from: a probe
    cause only for a communication error (the cause its signature placed, so the planner's
    remedies for it are tried next, e.g. NCCL with P2P off), the step, whether it was a
    rehearsal (never cached)."""
    return ProbeResult(
        key, ERROR, 0.0, (verdict.cause or "crash") if verdict.pinned else "",
        f"failed mid-run at step {verdict.step}: {one_line(verdict.summary, 500)}",
        extra=(("mid_run", str(verdict.step)),) + ((("rehearsal", "1"),) if rehearsed else ()))


#: What a chooser gets: the candidate that failed and its failure. It returns the next rung,
#: or raises `NoWorkingStrategyError` when none is left.
Chooser = Callable[[str, ProbeResult], Rung]


def relaunch(verdict: Verdict, failed: Rung, history: Sequence[Attempt], policy: RelaunchPolicy,
             choose: Chooser, rehearsed: bool = False) -> tuple[Judgement, Rung | None]:
    """The judgement on an attempt and where the next one runs (None: no next attempt): the
    same rung for a retry; for a step-down, the rung ``choose`` plans without the failed one
    (told its `mid_run_failure`), unless none is left or the floor refuses it
    (`floor_refusal`), which stop with `INFRASTRUCTURE`. Pure apart from
    what ``choose`` does."""
    judgement = judge(verdict, failed.key, history, policy)
    if judgement.action in (Action.RETRY, Action.MORE_NODES):
        return judgement, failed
    if judgement.action is not Action.STEP_DOWN:
        return judgement, None
    try:
        nxt = choose(failed.key, mid_run_failure(failed.key, verdict, rehearsed))
    except NoWorkingStrategyError as exc:
        return Judgement(Action.STOP, f"no candidate is left: {one_line(str(exc), 400)}",
                         ExitCode.INFRASTRUCTURE, "no_candidate"), None
    refusal = floor_refusal(failed.label, failed.gpu, failed.step_seconds, nxt.label, nxt.cpu,
                            nxt.step_seconds, policy, failed.replicas, nxt.replicas)
    if refusal is not None:
        return Judgement(Action.STOP, f"not relaunched: {refusal}", ExitCode.INFRASTRUCTURE,
                         "floor"), None
    return judgement, nxt


#: What was done with an attempt's measured step (``Attempt.measured["outcome"]``):
#: ``tried`` (a clearly faster candidate named: stopped at a checkpoint for a trial of it),
#: ``told`` (one named, but the job has no checkpoint to resume a trial from, or its trial was
#: had: said, not relaunched), ``kept`` (a trial measured faster than the first: kept),
#: ``switched_back`` (a trial measured slower: relaunched back), ``measured`` (nothing faster).
MEASURED_OUTCOMES = ("tried", "told", "kept", "switched_back", "measured")


def trial_kept(first_steps_per_s: float, trial_steps_per_s: float) -> bool:
    """Whether a trial measured at ``trial_steps_per_s`` optimizer steps a second (the same
    global batch) is kept over the first candidate measured at ``first_steps_per_s`` (pure):
    only when it is measured faster; never a slower or an equal one."""
    return trial_steps_per_s > first_steps_per_s


def switch_due(faster: str, measured_at: int, checkpoint_step: int | None, *,
               trial_of: float | None, trial_steps_per_s: float | None,
               tried: bool) -> bool:
    """Whether the supervisor stops the running attempt now (pure), at the first checkpoint
    noted at or after the measured window (``checkpoint_step`` >= ``measured_at``; None: no
    checkpoint yet, or none at all):

    - a first attempt (``trial_of`` None) whose measured step named a clearly ``faster``
      candidate, when no trial was had in this job (``tried``): stopped for the trial;
    - a trial (``trial_of``: the first attempt's measured steps a second) measured
      (``trial_steps_per_s``) and not `trial_kept`: stopped to go back.

    Never without a checkpoint at or past the measurement (the relaunch resumes exactly
    there)."""
    if checkpoint_step is None or checkpoint_step < measured_at:
        return False
    if trial_of is None:
        return bool(faster) and not tried
    return trial_steps_per_s is not None and not trial_kept(trial_of, trial_steps_per_s)


def measured_outcome(faster: str, checkpointed: bool, *, trial_of: float | None,
                     trial_steps_per_s: float | None, tried: bool) -> str:
    """What an attempt's measured step comes to in the end (pure; `MEASURED_OUTCOMES`),
    given whether the job noted a checkpoint."""
    if trial_of is not None and trial_steps_per_s is not None:
        return "kept" if trial_kept(trial_of, trial_steps_per_s) else "switched_back"
    if not faster:
        return "measured"
    return "tried" if checkpointed and not tried else "told"
