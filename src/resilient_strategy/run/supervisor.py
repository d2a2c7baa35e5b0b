"""``resilient-strategy run``: decide once, launch the workers the decision needs, watch them, and
relaunch on the next candidate when the backend fails mid-run.

Built on torch's elastic agent (the engine under ``torchrun``): torchrun's own argument parser
and ``config_from_args`` read the node options; a `LocalElasticAgent` subclass starts,
monitors and stops the workers, and adds one check to its monitoring loop: the progress watcher
(`TrainingWatch`, on the shared `resilient_strategy.records.progress` protocol). A stall marks the group UNHEALTHY with no
restart left, which is how the agent itself retires a wedged group; the agent then stops every
worker (SIGTERM, its shutdown timeout, SIGKILL). torchrun's restarts of the same configuration
are off: a relaunch here is on another candidate.

After each attempt `classify_attempt` (pure) reads the stall, the workers' exits, their
error records and their last progress into a typed `Verdict`, and
`judge` (pure) says what follows:

- a first stall, exit or lost node on a strategy is retried once there, from the last
  checkpoint; a repeat (the retry fails the same way before getting past that step), or a
  communication-error signature, steps down: the candidate's mid-run failure is added to the
  plan (and to the decision cache for a signature, never for a rehearsal), and the script is
  relaunched on the next candidate with the same global batch, unless that candidate is below
  the throughput floor (``--min-throughput``, ``--allow-cpu``);
- diverged ranks, an exception in user code, an out-of-memory: reported, not relaunched;
- each fault gets one line here, and its per-rank tracebacks and stacks go to the evidence file
  (`evidence`); the run ends with a summary line and an exit code (`exitcodes`).

The attempts follow one another in `loop.run_attempts` (pure); `_Run` here is its real hooks
(start and watch, observe, judge, record, finish, announce a relaunch).

TensorFlow scripts run as one supervised process (one process drives every GPU there); without
torch, `solo` runs it and `own_parser` reads the command line.

With ``--nnodes N`` (torch) the nodes' supervisors agree on each attempt's decision through a
store at the rendezvous endpoint before any worker starts, watch it for each other's fault
records while the workers run, and relaunch together (`resilient_strategy.run.peers`).
Each attempt begins with a membership round (`resilient_strategy.nodes.membership`): a node
that does not join a relaunch is dropped, and the nodes present regroup into one rendezvous
(action ``fewer_nodes``; node 0 alone when it is the last); a node cut off from the store for
the heartbeat window stops by itself with 75 (``cut_off``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.call.arguments import Arguments, options_from
from ..core.call.options import MIN_STALL_S, Options, RunOptions
from ..core.knowledge.causes import node_cause
from ..core.measures.probe import ERROR, ProbeResult, ProbeSpec
from ..core.values.bounded import parse_json
from ..core.values.candidate import Candidate, CandidateKey
from ..core.values.requeue import this_node
from ..errors import (
    GpuUnusableError,
    MultiNodeError,
    NodeLostError,
    NoSpaceError,
    NoWorkingStrategyError,
    ResilientStrategyError,
    UnsafePathError,
)
from ..machine import env as machine_env
from ..machine import files
from ..probing.base import Prober
from ..records import phases
from ..records.handoff import HandedDecision, binding, restored_step, write_decision
from ..records.measured import MeasuredNote, read_measured
from ..records.rundir import CHECKPOINT_NOTE, RUN_PREFIX, RunDir
from ..records.trainfault import FAULT_VAR, TrainFault, check_rank, parse_fault

if TYPE_CHECKING:
    from ..core.values.facts import Facts
    from .peers import NodeLink, PeerWatch

from . import launch as launch_faults
from . import preempt
from .agent import launch
from .cmdline import node_count, options_from_args, torch_launcher
from .evidence import Evidence
from .exitcodes import ExitCode, interrupted
from .goodput import account
from .loop import Judged, Observed, Watched, ending_of, exit_code, run_attempts
from .policy import (
    Action,
    Attempt,
    Chooser,
    Judgement,
    RelaunchPolicy,
    Rung,
    effective,
    floor_refusal,
    measured_outcome,
    relaunch,
    switch_due,
)
from .verdicts import NODE_NAME, PeerFault, Verdict, VerdictKind, fault_line, merge, one_line

log = logging.getLogger("resilient_strategy")

#: The session directory's prefix (``rs-run-<pid>-...``): a killed run's is swept by the next.


@dataclass(frozen=True)
class Choice:
    """A decision with what the relaunch policy needs of it: the candidate and its estimate."""

    decision: HandedDecision
    candidate: Candidate
    step_seconds: float  # estimated, per global batch (core/measures/estimate.py)
    left: int  # candidates left after this one
    #: multi-node: this node's link for the nodes of this attempt, and the membership round
    #: that named them (`regroup`)
    link: NodeLink | None = None
    change: Any = None
    #: the plan's ranked candidates (a measured switch relaunches on one of them)
    ranked: tuple[Any, ...] = ()


def supervise(opts: RunOptions, env: Mapping[str, str] | None = None) -> int:
    """Run the script to the end: retry a transient fault once on the same strategy, step down
    to the next candidate on a repeat or a backend's signature, stop at the throughput floor.
    Returns the exit status for the command line (`ExitCode`)."""
    return supervise_ending(opts, env).code


def supervise_ending(opts: RunOptions, env: Mapping[str, str] | None = None
                     ) -> preempt.Ending:
    """`supervise`, with the cause that blames this node where the run ended on one
    (`preempt.Ending`: a requeue then excludes the node)."""
    snapshot = machine_env.snapshot(env)
    session: Path | None = None
    preempt.CURRENT = preempt.Preemption(preempt.grace_from(snapshot))
    unhandled = preempt.CURRENT.install()
    try:
        fault = parse_fault(snapshot.get(FAULT_VAR, ""))
        from ..machine.files import sweep_temp_dirs, writing

        # what a killed run left (its workers died with it: see worker.py)
        sweep_temp_dirs(prefixes=(RUN_PREFIX,), min_age_s=0.0)
        with writing(os.path.join(tempfile.gettempdir(), f"{RUN_PREFIX}{os.getpid()}-..."),
                     "the run's directory"):
            session = Path(tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{os.getpid()}-"))
        return _supervise(opts, snapshot, fault, session)
    except GpuUnusableError as exc:  # a GPU of this node no longer works: the node's fault
        _say(str(exc))
        return preempt.Ending(int(ExitCode.INFRASTRUCTURE), "gpu_fault")
    except NoWorkingStrategyError as exc:  # the node's own where a cause says so (its driver)
        _say(str(exc))
        return preempt.Ending(int(ExitCode.INFRASTRUCTURE),
                              node_cause(c.cause for c in exc.causes))
    except (MultiNodeError, NoSpaceError) as exc:
        _say(str(exc))  # this machine (or node set) cannot run it: requeue elsewhere
        return preempt.Ending(int(ExitCode.INFRASTRUCTURE))
    except ResilientStrategyError as exc:
        _say(str(exc))
        return preempt.Ending(int(ExitCode.USAGE))
    except KeyboardInterrupt:  # outside an attempt (deciding, probing): nothing is running
        _say("interrupted")
        return preempt.Ending(int(ExitCode.INTERRUPTED))
    finally:
        unhandled()
        if session is not None:
            shutil.rmtree(session, ignore_errors=True)


def _supervise(opts: RunOptions, snapshot: Mapping[str, str], fault: TrainFault | None,
               session: Path) -> preempt.Ending:
    from ..machine.inspect import detect_facts

    job_start = time.time()  # the job's goodput counts from here (deciding included)
    evidence = Evidence(Path(os.path.abspath(opts.evidence_dir)), session.name)
    failures: dict[str, ProbeResult] = {}  # candidates stepped down from, by key
    facts = detect_facts(snapshot)
    if opts.run_launch.words():
        _say(opts.run_launch.words())
    link = _link(opts, facts)
    if link is not None:
        _say(f"node {link.node} of {link.nodes}: the nodes' supervisors agree through the "
             f"store at {link.where} before any worker starts")
    try:
        choice = _decide(opts, facts, snapshot, failures, session, 0, (), link)
    except MultiNodeError as exc:
        if link is not None:  # the nodes never agreed: say what failed, typed, then stop (75)
            evidence.setup(_setup_failure(exc, link, snapshot))
        raise
    first = choice.decision
    check_rank(fault, max(first.processes * first.nodes, _asked_ranks(opts)))
    _say(_allowance_words(opts, snapshot, choice.decision.framework))
    run = _Run(opts, snapshot, fault, session, job_start, evidence, failures, facts, link,
               team=choice.link or link,
               changes=[choice.change] if choice.change is not None else [])
    return run_attempts(run, choice)


@dataclass
class _Run:
    """The supervisor's hooks of `loop.run_attempts` (`loop.Hooks`), with what the run keeps
    from attempt to attempt: the candidates stepped down from, the notes for the next
    attempt's script, the nodes that relaunch together, the membership changes, and a measured
    switch's trial."""

    opts: RunOptions
    snapshot: Mapping[str, str]
    fault: TrainFault | None
    session: Path
    job_start: float
    evidence: Evidence
    failures: dict[str, ProbeResult]
    facts: Any
    link: NodeLink | None
    #: the nodes that relaunch together (None: node 0 alone)
    team: NodeLink | None
    changes: list[Any]
    notes: list[str] = field(default_factory=list)
    # a measured switch (issue 41 item 4): the first choice and its measured note while a
    # trial of the faster candidate runs; whether this job had its trial
    trial: tuple[Choice, MeasuredNote] | None = None
    tried: bool = False

    @property
    def policy(self) -> RelaunchPolicy:
        o = self.opts
        return RelaunchPolicy(o.min_throughput, o.allow_cpu, o.max_attempts_without_progress,
                              o.max_relaunches, fault_window=o.fault_window)

    def sits_out(self, choice: Choice, history: Sequence[Attempt]) -> preempt.Ending | None:
        """Node 0 trains alone: any other node has nothing to run."""
        link, decision = self.link, choice.decision
        if link is None or not _alone(decision) or link.node == 0:
            return None
        _say(f"node {link.node}: node 0 trains alone on {_label(decision)} (no backend "
             "between the nodes beats one node); this node has nothing to run")
        self.evidence.summary(history)  # what this node saw until then (none: nothing written)
        return preempt.Ending(int(ExitCode.SUCCESS))

    def start_and_watch(self, attempt: int, choice: Choice) -> Watched | preempt.Ending:
        """The attempt's workers started and watched to their end (a launch fault before any
        worker started is a verdict too); an `Ending` when a signal or a preemption stopped it."""
        opts, decision, link, trial = self.opts, choice.decision, self.link, self.trial
        peer = None
        if self.team is not None and not _alone(decision):  # node 0 alone has no peer to hear
            from .peers import PeerWatch

            peer = PeerWatch(self.team, decision.attempt, _store_timeout(opts))
        try:
            if torch_launcher():
                verdict = launch(opts, decision, self.snapshot, self.session, peer,
                                 alone=link is not None and _alone(decision),
                                 switch=preempt.CURRENT.watch(
                                     decision.run_dir,
                                     None if link is not None or not opts.measured_switch
                                     else _switch_watch(decision.run_dir, None if trial is None
                                                        else trial[1].steps_per_s, self.tried),
                                     _checkpoint_in))
            else:  # no torch: our own agent for the one process of a TensorFlow job
                from .solo import launch_one

                verdict = launch_one(opts, decision)
        except Exception as exc:
            if type(exc).__name__ == "SignalException":  # the agent stopped the workers
                signum = int(getattr(exc, "sigval", 15))
                _say(f"stopped by signal {signum}; the workers are stopped")
                return preempt.Ending(interrupted(signum))
            # a launch fault before any worker started (the rendezvous store on a held
            # --master-port): a verdict like any other, never torch's traceback
            raised = launch_faults.raised(launch_faults.chain_of(exc))
            if raised is None:
                raise
            verdict = raised
        finally:
            preempt.CURRENT.attempt_over()
            if peer is not None:
                peer.close()
        if preempt.CURRENT.signum is not None and not verdict.ok:  # stopped for a preemption
            _say(preempt.CURRENT.line())
            return preempt.Ending(int(ExitCode.INFRASTRUCTURE))  # no node's fault
        return Watched(verdict, peer)

    def observe(self, attempt: int, choice: Choice, watched: Watched) -> Observed:
        """The verdict as judged (one device, the port's holder, every node's), the step the
        attempt's own script restored, its measured step; the resume and the fault said."""
        decision, verdict, peer = choice.decision, watched.verdict, watched.peer
        verdict = effective(verdict, choice.candidate.num_replicas)
        if verdict.kind is VerdictKind.LAUNCH:  # named: the port's holder where /proc shows it
            verdict = launch_faults.named(verdict, _holders(verdict))
        gone: dict[int, str] = {}
        if peer is not None:
            verdict = verdict_with_peers(peer, decision.chosen, verdict,
                                         host=_node_name(self.snapshot))
            gone = peer.gone()
        phases.mark(RunDir.of(decision.run_dir).supervisor_phases, phases.VERDICT)
        # a resume is the script's restore, reported by it (never the note an attempt before
        # left: a script may not load it); its steps count on from there
        resumed = restored_step(decision.run_dir)
        if attempt > 0 or resumed is not None:
            _say(_resume_words(attempt, resumed))
        seen = Observed(verdict, gone, resumed, read_measured(decision.run_dir))
        if not verdict.ok and not seen.switched:  # the fault's line first; its evidence below
            _say(fault_line(attempt, _backend(decision.chosen), verdict,
                            _shown_path(self.evidence.path(attempt)),
                            prefix=SAY_PREFIX)[len(SAY_PREFIX):])
        return seen

    def judge(self, attempt: int, choice: Choice, seen: Observed,
              history: Sequence[Attempt]) -> Judged[Choice]:
        """What follows (`policy.relaunch`, the measured switch, a node lost at the relaunch's
        agreement) and the next attempt's choice, decided (None: the run ends)."""
        measured, trial = seen.measured, self.trial
        outcome = measured_outcome(
            "" if measured is None else measured.faster, seen.switched,
            trial_of=None if trial is None else trial[1].steps_per_s,
            trial_steps_per_s=None if trial is None or measured is None
            else measured.steps_per_s, tried=self.tried)
        if measured is not None:
            _say(_measured_words(measured, outcome, None if trial is None else trial[1],
                                 self.tried, self.opts.measured_switch))
        try:
            judgement, nxt = self._next(choice, seen, history)
        except NodeLostError as exc:
            if self.team is None or self.team.node != 0 or exc.node is None:
                raise  # a node other than 0 cannot go on without the store node 0 hosts
            judgement, nxt = self._without(choice, exc.node, str(exc))
        if nxt is not None:
            phases.mark(RunDir.of(choice.decision.run_dir).supervisor_phases, phases.NEXT_READY)
            if nxt.change is not None:
                self.changes.append(nxt.change)
                if nxt.change.line():
                    _say(nxt.change.line())
                if nxt.change.left and judgement.action is Action.RETRY:
                    judgement = Judgement(Action.FEWER_NODES, _fewer_words(nxt.change))
            if self.team is not None:
                self.team = nxt.link or self.team
        return Judged(judgement, nxt, outcome)

    def _next(self, choice: Choice, seen: Observed, history: Sequence[Attempt]
              ) -> tuple[Judgement, Choice | None]:
        """The judgement and the next choice: the measured switch's, else the ladder's (a
        retry: the same candidate again; a step-down: the one the chooser planned)."""
        verdict, decision = seen.verdict, choice.decision
        attempt = decision.attempt + 1
        if seen.switched and seen.measured is not None:  # healthy, stopped at a checkpoint
            judgement, nxt = _switch(choice, seen.measured, self.trial, self.session, attempt,
                                     self.facts, self.snapshot, self.notes)
            self.trial = (choice, seen.measured) if self.trial is None else None
            self.tried = True
            return judgement, nxt
        # a node whose verdict never came gets the heartbeat window to join the relaunch
        silent = (verdict.node,) if (verdict.kind is VerdictKind.LOST
                                     and verdict.node is not None) else ()
        silent = tuple(sorted({*silent, *seen.gone}))
        rehearsed = self.fault is not None and self.fault.backend == _backend(decision.chosen)
        planned: list[Choice] = []
        choose = _chooser(self.opts, self.facts, self.snapshot, self.failures, self.session,
                          attempt, self.notes, self.team, silent, planned)
        # the one ladder the replay runs too: judge, then retry, step down or stop (a node
        # that asked to join: the same rung again, across the larger group)
        judgement, to = relaunch(verdict, _rung(choice), history, self.policy, choose, rehearsed)
        if seen.switched or to is None:
            return judgement, None
        if judgement.action is Action.STEP_DOWN:
            return judgement, planned[-1]
        return judgement, _retry(choice, self.session, attempt, self.team, self.opts,
                                 self.facts, self.snapshot, self.failures, self.notes, silent)

    def _without(self, choice: Choice, lost: int, why: str) -> tuple[Judgement, Choice | None]:
        """Node 0 after a node did not join the relaunch: alone, or stopped."""
        _say(f"node {lost} did not join the relaunch: {one_line(why, 300)}")
        nxt, refusal = _without_lost_node(self.opts, self.facts, self.snapshot, self.failures,
                                          self.session, choice.decision.attempt + 1,
                                          self.notes, choice, lost)
        self.team = None
        if nxt is None:
            return Judgement(Action.STOP, refusal, ExitCode.INFRASTRUCTURE), None
        return Judgement(Action.FEWER_NODES, f"node {lost} did not join the relaunch: it "
                         "is dropped, and node 0 goes on alone with accumulation keeping the "
                         "global batch"), nxt

    def record(self, attempt: int, choice: Choice, seen: Observed,
               judged: Judged[Choice]) -> Attempt:
        """The attempt as recorded; a fault's evidence file written."""
        decision, verdict, measured = choice.decision, seen.verdict, seen.measured
        done = Attempt(attempt, decision.chosen, _label(decision), verdict, judged.judgement,
                       seen.resumed, phases.Timeline.read(decision.run_dir, decision.processes),
                       None if measured is None
                       else {**measured.to_dict(), "outcome": judged.outcome})
        if not verdict.ok and not seen.switched and self.evidence.record(
                done, Path(decision.run_dir), decision.processes) is None:
            _say(f"the evidence of attempt {attempt + 1} could not be written to "
                 f"{self.evidence.path(attempt)}")
        return done

    def finish(self, history: Sequence[Attempt], judgement: Judgement) -> preempt.Ending:
        """The run's end: the summary file and line, the exit code."""
        from .peers import nodes_words

        goodput = account(history, self.job_start, time.time())
        self.evidence.summary(history, [c.to_dict() for c in self.changes], goodput.to_dict(),
                              create=any(a.measured is not None for a in history))
        _say(_summary(history, judgement) + nodes_words(self.changes) + f" {goodput.line()}.")
        here = self.team or self.link  # this node's number in the last attempt's nodes
        return ending_of(history, judgement, None if here is None else here.node)

    def announce_relaunch(self, history: Sequence[Attempt], choice: Choice, seen: Observed,
                          judged: Judged[Choice]) -> None:
        """The relaunch said, and noted for the next attempt's script."""
        verdict, judgement, nxt = seen.verdict, judged.judgement, judged.next
        assert nxt is not None
        ckpt = _last_checkpoint(self.session)
        how = _HOW.get(judgement.action, "stepping down")
        self.notes.append(f"Relaunched ({how}) from the checkpoint at step {verdict.step}: "
                          f"{judgement.reason}." if seen.switched else
                          f"Relaunched ({how}): {_label(choice.decision)} failed mid-run at "
                          f"step {verdict.step} ({verdict.kind.value}: "
                          f"{one_line(verdict.summary, 160)}).")
        limit = f" of {self.opts.max_relaunches}" if self.opts.max_relaunches is not None else ""
        _say(f"relaunch {len(history)}{limit}: {how} on {_label(nxt.decision)} "
             f"({judgement.reason}); "
             + (f"the last checkpoint noted is at step {ckpt[0]} ({ckpt[1]})" if ckpt
                else "the last checkpoint is noted on the node of rank 0"
                if self.link is not None and self.link.node != 0
                else "no checkpoint was noted")
             + ": a resume is announced once the script has restored one")


#: How a relaunch goes on, by its action (any other: a step-down).
_HOW = {Action.RETRY: "retrying", Action.FEWER_NODES: "going on with fewer nodes",
        Action.MORE_NODES: "taking a node back",
        Action.TRIAL: "trying the candidate measured faster",
        Action.SWITCH_BACK: "going back to the candidate measured faster"}


def _switch_watch(run_dir: str, trial_of: float | None, tried: bool
                  ) -> Callable[[], int | None]:
    """What the agent asks in its monitoring loop (`agent.launch`'s ``switch``): the step of the
    checkpoint to stop this attempt at for a measured switch, or None (`switch_due`: a first
    attempt measured slower than a proven candidate, or a trial measured slower than the
    first, once a checkpoint is noted at or after the measurement)."""

    def due() -> int | None:
        note = read_measured(run_dir)
        if note is None:
            return None
        ckpt = _checkpoint_in(Path(run_dir))
        at = None if ckpt is None else ckpt[0]
        if switch_due(note.faster, note.at_step, at, trial_of=trial_of,
                      trial_steps_per_s=note.steps_per_s, tried=tried):
            return at
        return None

    return due


def _checkpoint_in(run_dir: Path) -> tuple[int, str] | None:
    """The checkpoint noted in one attempt's directory (step, path), None when none is."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, UnsafePathError):
        note = RunDir(run_dir).checkpoint_note
        data = parse_json(files.read_bytes(note, max_bytes=files.MAX_REPORT_BYTES), str(note),
                          allow_nan=True)
        return int(data["step"]), str(data["path"])
    return None


def _switch(choice: Choice, measured: MeasuredNote, trial: tuple[Choice, MeasuredNote] | None,
            session: Path, attempt: int, facts: Any, env: Mapping[str, str],
            notes: list[str]) -> tuple[Judgement, Choice | None]:
    """After an attempt stopped at a checkpoint for a measured switch: the trial of the faster
    candidate (the same global batch: the same decision, another candidate of its plan), or,
    after a trial measured slower, the first candidate again."""
    if trial is not None:
        first, note = trial
        back_dir = session / f"attempt{attempt}"
        back_dir.mkdir()
        back = replace(first.decision, run_dir=str(back_dir), attempt=attempt,
                       notes=tuple(notes))
        write_decision(RunDir(back_dir).decision, back)
        return (Judgement(Action.SWITCH_BACK, f"{_label(choice.decision)} was measured at "
                          f"{measured.steps_per_s:.3g} steps/s, slower than "
                          f"{_label(first.decision)} at {note.steps_per_s:.3g}: the slower "
                          "one is not kept"), replace(first, decision=back))
    ranked = next((r for r in choice.ranked if r.candidate.key == measured.faster), None)
    if ranked is None:  # pragma: no cover - the note names a candidate of this plan
        raise ResilientStrategyError(f"the measured faster {measured.faster} is not planned")
    cand = ranked.candidate
    run_dir = session / f"attempt{attempt}"
    run_dir.mkdir()
    devices, visible = binding(cand, facts, env)
    decision = replace(
        choice.decision, chosen=cand.key, label=cand.label, run_dir=str(run_dir),
        attempt=attempt, notes=tuple(notes), nodes=1, devices=devices, visible_devices=visible,
        processes=max(1, cand.num_replicas) if choice.decision.framework == "torch" else 1)
    write_decision(RunDir(run_dir).decision, decision)
    nxt = replace(choice, decision=decision, candidate=cand,
                  step_seconds=ranked.estimate.step_seconds)
    return (Judgement(Action.TRIAL, f"{_label(choice.decision)} was measured at "
                      f"{measured.steps_per_s:.3g} steps/s; {cand.label}, proven here, is "
                      f"estimated at {1 / (measured.faster_step_s or measured.step_s):.3g} "
                      "with that compute: a trial of it, the same global batch, resumed from "
                      "the checkpoint; the faster one is kept"), nxt)


def _measured_words(measured: MeasuredNote, outcome: str,
                    first: MeasuredNote | None, tried: bool = False,
                    switch_on: bool = True) -> str:
    """The attempt's measured step and what came of it, in one line (``switch_on``: the
    run's ``--measured-switch``)."""
    rate = (f"measured {measured.steps_per_s:.3g} optimizer steps/s on "
            f"{measured.candidate} (to step {measured.at_step})")
    if outcome == "told" and not switch_on:
        return (f"{rate}; {measured.faster_label or measured.faster}, proven here, would be "
                f"faster (~{1 / (measured.faster_step_s or measured.step_s):.3g} steps/s): not "
                "tried (--no-measured-switch or RESILIENT_STRATEGY_MEASURED_SWITCH=0)")
    if outcome == "told" and tried:
        return (f"{rate}; {measured.faster_label or measured.faster} was tried in this job "
                "and measured slower: not tried again")
    if outcome == "told":
        return (f"{rate}; {measured.faster_label or measured.faster}, proven here, would be "
                f"faster (~{1 / (measured.faster_step_s or measured.step_s):.3g} steps/s), but "
                "no checkpoint was noted after the measurement to resume a trial from: not "
                "relaunched (sel.checkpoint(dir) lets run try it)")
    if first is not None:
        return (f"{rate}, against {first.steps_per_s:.3g} on {first.candidate}: "
                + ("kept (faster)" if outcome == "kept" else "not kept (slower)"))
    return rate + ("; a faster candidate is tried at a checkpoint" if outcome == "tried" else "")


def _holders(verdict: Verdict) -> tuple[Any, ...]:
    """Who holds the port a ``port_in_use`` verdict names (`machine.ports`: ``/proc``)."""
    port = launch_faults.port_in(verdict.summary)
    if verdict.cause != "port_in_use" or port is None:
        return ()
    from ..machine.ports import port_holders

    return port_holders(port)


def _retry(choice: Choice, session: Path, attempt: int, link: NodeLink | None,
           opts: RunOptions, facts: Any, env: Mapping[str, str],
           failures: Mapping[str, ProbeResult], notes: list[str],
           silent: tuple[int, ...] = ()) -> Choice:
    """The same candidate again, in a fresh attempt directory. Across nodes the supervisors
    agree again (the same plan: nothing new failed), which keeps their attempts in step."""
    if link is not None:
        return _decide(opts, facts, env, failures, session, attempt, tuple(notes), link,
                       silent)
    run_dir = session / f"attempt{attempt}"
    run_dir.mkdir()
    decision = replace(choice.decision, run_dir=str(run_dir), attempt=attempt, notes=tuple(notes))
    write_decision(RunDir(run_dir).decision, decision)
    return replace(choice, decision=decision)


def _chooser(opts: RunOptions, facts: Any, env: Mapping[str, str],
             failures: dict[str, ProbeResult], session: Path, attempt: int, notes: list[str],
             link: NodeLink | None, silent: tuple[int, ...],
             planned: list[Choice]) -> Chooser:
    """The ladder's chooser (`relaunch`) for a step-down: the failure added to the plan
    for this session (never to the decision cache: a mid-run failure is unproven), the next
    candidate decided (probed first when it needs a probe; across nodes, agreed), kept in
    ``planned``."""

    def choose(key: str, failure: ProbeResult) -> Rung:
        failures[key] = failure
        planned.append(_decide(opts, facts, env, failures, session, attempt, tuple(notes), link,
                               silent))
        return _rung(planned[-1])

    return choose


def _rung(choice: Choice) -> Rung:
    """A decision as the ladder sees it (`Rung`)."""
    c = choice.candidate
    return Rung(choice.decision.chosen, _label(choice.decision), bool(c.devices),
                c.backend == "cpu", c.num_replicas, choice.step_seconds)


def _without_lost_node(opts: RunOptions, facts: Any, env: Mapping[str, str],
                       failures: dict[str, ProbeResult], session: Path, attempt: int,
                       notes: list[str], failed: Choice, lost: int
                       ) -> tuple[Choice | None, str]:
    """Node 0's next attempt without the node that did not join the relaunch: every candidate
    that spans the nodes is ruled out for this run (the lost node is named in its result), and
    node 0 plans alone (one replica, accumulation keeping the global batch; no probe across
    nodes, none is left). None and why not when nothing is left or the floor refuses it."""
    from ..deciding.decide import decide

    o, plan_env = _options(opts, facts, env)
    ranked = decide(facts, o, plan_env, _prober, time.monotonic, known=dict(failures)).plan.ranked
    for r in ranked:
        key = r.candidate.key
        if r.candidate.num_replicas > 1 and key not in failures:
            failures[key] = ProbeResult(
                key, ERROR, 0.0, "", f"node {lost} did not join the relaunch after attempt "
                f"{attempt}: the job goes on without it", extra=(("node_lost", str(lost)),))
    try:
        nxt = _decide(opts, facts, env, failures, session, attempt, tuple(notes), None)
    except NoWorkingStrategyError as exc:
        return None, f"no candidate is left on node 0 alone: {one_line(str(exc), 400)}"
    refusal = floor_refusal(
        _label(failed.decision), bool(failed.candidate.devices), failed.step_seconds,
        _label(nxt.decision), nxt.candidate.backend == "cpu",
        nxt.step_seconds, RelaunchPolicy(opts.min_throughput, opts.allow_cpu,
                                         opts.max_attempts_without_progress,
                                         opts.max_relaunches),
        failed.candidate.num_replicas, nxt.candidate.num_replicas)
    if refusal is not None:
        return None, f"not relaunched on node 0 alone: {refusal}"
    return nxt, ""


def _setup_failure(exc: MultiNodeError, link: NodeLink, env: Mapping[str, str]
                   ) -> dict[str, object]:
    """What ended a multi-node run before its first attempt, typed (``attempts.json``'s
    ``setup``): the error, the node that went silent (``node``, None: the store itself), how
    (``deadline``, ``heartbeat``, ``store``), this node, the store's address, and this node's
    kernel route to it (``route`` None: none, or a route that rejects it, ``route_how`` says)."""
    from ..machine.route_lookup import route_to_master

    iface, how = route_to_master(link.env(env, 0))
    return {"error": type(exc).__name__, "node": getattr(exc, "node", None),
            "how": getattr(exc, "how", None), "this_node": link.node,
            "store": f"{link.host}:{link.port}", "route": iface, "route_how": how,
            "summary": str(exc), "exit_code": int(ExitCode.INFRASTRUCTURE)}


def _fewer_words(change: Any) -> str:
    """Why the job goes on with fewer nodes (a membership round dropped some)."""
    left = ", ".join(f"node {n} ({how.replace('_', ' ')})" for n, how in change.left)
    return (f"{left} did not join the relaunch: the job goes on with node(s) "
            f"{', '.join(map(str, change.members))}, re-planned for them, the global batch kept")


def _summary(history: Sequence[Attempt], judgement: Judgement) -> str:
    """The run in one line: each attempt's verdict and what followed, then the exit code."""
    steps = []
    for a in history:
        what = "finished" if a.verdict.ok else f"{a.verdict.kind.value} at step {a.verdict.step}"
        if a.measured is not None:  # the measured rate (issue 41: both, after a trial)
            what += f" (measured {float(a.measured['steps_per_s']):.3g} steps/s)"
        steps.append(f"{a.label}: {what} -> {a.judgement.action.value.replace('_', ' ')}")
    code = exit_code(judgement)
    return (f"summary: {len(history)} attempt(s): " + "; ".join(steps)
            + f". {judgement.reason}. Exit {int(code)} ({code.name})")


def _allowance_words(opts: RunOptions, env: Mapping[str, str], framework: str = "torch") -> str:
    """The stall allowance and the busy ceiling in force, how to change them, and the
    training's timeouts set from them (torch's heartbeat for a PyTorch job only)."""
    from ..core.call.options import DEFAULT_PROCESS_GROUP_TIMEOUT
    from .watch import (
        AUTO_STALL_CAP_S,
        DEFAULT_BUSY_S,
        HEARTBEAT_VAR,
        PG_TIMEOUT_VAR,
        STALL_STEPS,
        WARMUP_STEPS,
        torch_timeouts,
    )

    allowance = (f"{opts.stall_timeout_s:g} s (--stall-timeout)" if opts.stall_timeout_s
                 else f"max({MIN_STALL_S:g} s, {STALL_STEPS} x the p99 step time after "
                      f"{WARMUP_STEPS} warm-up steps), at most {AUTO_STALL_CAP_S:g} s "
                      "(--stall-timeout to fix it)")
    busy = opts.busy_timeout_s if opts.busy_timeout_s is not None else DEFAULT_BUSY_S
    words = (f"stall allowance {allowance}; a rank busy in its own code may keep the others "
             f"waiting {busy:g} s (--busy-timeout)")
    if not torch_launcher():
        return words
    set_ = torch_timeouts(opts.stall_timeout_s, env, DEFAULT_PROCESS_GROUP_TIMEOUT, busy,
                          framework)
    torch_words = ", ".join(f"{k}={v}" for k, v in set_.items())
    names = (PG_TIMEOUT_VAR, HEARTBEAT_VAR) if framework == "torch" else (PG_TIMEOUT_VAR,)
    kept = [k for k in names if k not in set_]
    whose = "torch's timeouts" if framework == "torch" else "the timeouts"
    return (f"{words}; {whose} just above them: {torch_words or 'none set'}"
            + (f" (yours kept: {', '.join(kept)})" if kept else ""))


SAY_PREFIX = "resilient-strategy run: "


def _say(text: str) -> None:
    print(f"{SAY_PREFIX}{text}", file=sys.stderr, flush=True)


def _asked_ranks(opts: RunOptions) -> int:
    """The ranks the command line asks for (``--nproc-per-node`` x nodes; 0 for "auto")."""
    return opts.nproc * node_count(opts) if opts.nproc else 0


def _shown_path(path: Path) -> str:
    """``path`` as the shorter of its absolute form and its form relative to the working
    directory (the fault's line has ~200 characters)."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive
        return str(path)
    return rel if len(rel) < len(str(path)) else str(path)


def _backend(key: str) -> str:
    """A candidate key's backend (``torch:nccl/fsdp:0,1`` -> ``nccl``)."""
    parsed = CandidateKey.read(key)
    return key if parsed is None else parsed.backend


def _label(decision: HandedDecision) -> str:
    return decision.label or decision.chosen


def _options(opts: RunOptions, facts: Facts, env: Mapping[str, str], rank: int = 0,
             nnodes: int | None = None) -> tuple[Options, dict[str, str]]:
    """The options of one decision of this run (the first, and each relaunch's): run's own
    (`Arguments.from_run`) in the environment of the launch it plans."""
    nproc = opts.nproc if opts.nproc is not None else max(1, len(facts.gpus))
    nnodes = node_count(opts) if nnodes is None else nnodes
    plan_env = dict(env)
    fw = opts.framework
    if fw in (None, "torch"):
        plan_env.update({"WORLD_SIZE": str(nproc * nnodes), "LOCAL_WORLD_SIZE": str(nproc),
                         "RANK": str(rank), "LOCAL_RANK": "0"})
    for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
        if fw == "tensorflow":
            plan_env.pop(k, None)
    return options_from(facts, plan_env, Arguments.from_run(opts)), plan_env


def _link(opts: RunOptions, facts: Any) -> NodeLink | None:
    """This node's supervisor in a multi-node run (torch), else None."""
    if opts.framework == "tensorflow" or opts.torchrun is None:
        return None
    from .peers import NodeLink

    nproc = opts.nproc if opts.nproc is not None else max(1, len(facts.gpus))
    return NodeLink.from_torchrun(opts.torchrun, nproc)


def _alone(decision: HandedDecision) -> bool:
    """Node 0 trains alone (one replica, accumulation keeping the global batch)."""
    return decision.nodes == 1


def _store_timeout(opts: RunOptions | None) -> float:
    return max(10.0, (opts.probe_timeout_s or 0.0) if opts is not None else 0.0)


def _node_name(env: Mapping[str, str]) -> str:
    """This node's name as the scheduler knows it (``SLURMD_NODENAME``), sent with its verdict so
    that a requeue by node 0 can exclude this node for its own fault; "" when none or not a
    node name (`verdicts.NODE_NAME`)."""
    name = this_node(env, None) or ""
    return name if NODE_NAME.fullmatch(name) else ""


def verdict_with_peers(peer: PeerWatch, chosen: str, verdict: Verdict, host: str = "") -> Verdict:
    """Every node's verdict on the attempt, merged the same way on every node (so that all
    retry, step down or stop together): this node's is recorded for the others (``host``: this
    node's name, `_node_name`), theirs are awaited (a node whose record never comes is lost)."""
    peer.record(PeerFault(peer.link.node, chosen, replace(verdict, host=host or verdict.host)))
    if verdict.kind is VerdictKind.CUT_OFF:
        return verdict  # nothing will come from the others: this node stops
    merged = merge(peer.await_all(_store_timeout(opts=None)))
    if verdict.ok and (merged is None or merged.kind in (VerdictKind.LOST,
                                                         VerdictKind.CUT_OFF)):
        # every rank of this node wrote "finished" after its last step, so the silent node
        # took part to the end: the job is done (the node that hosts the store takes it along
        # when it exits first, and its record can no longer be read)
        return verdict
    cut = peer.cut_off()
    if cut is not None:  # this node lost the store for the heartbeat window: it stops
        return cut.verdict
    if merged is None:
        return verdict
    if merged.kind is VerdictKind.CUT_OFF and merged.node != peer.link.node:
        # another node cut off from the store: a node lost, here (the others go on)
        return replace(merged, kind=VerdictKind.LOST)
    return merged


def _decide(opts: RunOptions, facts: Any, env: Mapping[str, str],
            failures: Mapping[str, ProbeResult], session: Path, attempt: int,
            notes: tuple[str, ...], link: NodeLink | None = None,
            silent: tuple[int, ...] = (), gone: Mapping[int, str] | None = None) -> Choice:
    """Plan (probing as needed, the cache first), without the candidates that failed mid-run.
    With several nodes, a membership round names the nodes of this attempt (``silent``: nodes
    whose verdict never came; ``gone``: how each node known gone was seen), then they agree
    through the rendezvous endpoint's store (`peers`). A fallback is announced as the
    script would announce it."""
    import functools

    from ..deciding.decide import decide
    from ..deciding.notices import progress_line_for

    change = None
    if link is not None:  # the membership round: who is in this attempt
        from .peers import regroup

        o, _ = _options(opts, facts, env)
        margin = max(10.0, o.timeout_s / 2)
        link, change = regroup(link, attempt, {**{n: "no_verdict" for n in silent},
                                               **(gone or {})}, o.timeout_s + margin, margin)
        attempt = change.attempt  # a node that comes back joins the job's next attempt
        silent = tuple(link.present.index(n) for n in silent if n in link.present)
        if len(link.present) == 1:  # node 0 alone: no one to agree with
            o, plan_env = _options(opts, facts, env, nnodes=1)
            made = decide(facts, o, plan_env, _prober, time.monotonic, progress_line_for(o),
                          startup_check=True, known=failures)
            return _choice(opts, facts, env, failures, session, attempt, notes, None, o, made,
                           dict(made.results), link, change)
    if link is None:
        o, plan_env = _options(opts, facts, env)
    else:
        o, plan_env = _options(opts, facts, link.env(env, attempt), link.position * link.nproc,
                               nnodes=len(link.present))
    if link is None:
        made = decide(facts, o, plan_env, _prober, time.monotonic, progress_line_for(o),
                      startup_check=True, known=failures)
        results = dict(made.results)
    else:
        from ..nodes.manynodes import agreed_decision

        made = agreed_decision(
            facts, o, plan_env, _prober, time.monotonic,
            functools.partial(decide, progress=progress_line_for(o), startup_check=True,
                              known=dict(failures)), silent=silent)
        results = {**made.results, **failures}
    return _choice(opts, facts, env, failures, session, attempt, notes, link, o, made, results,
                   link, change)


def _choice(opts: RunOptions, facts: Any, env: Mapping[str, str],
            failures: Mapping[str, ProbeResult], session: Path, attempt: int,
            notes: tuple[str, ...], agreed: NodeLink | None, o: Any, made: Any,
            results: dict[str, ProbeResult], link: NodeLink | None, change: Any) -> Choice:
    """The decision file of an attempt from what was decided (``agreed``: across nodes)."""
    from ..core.measures.estimate import estimate
    from ..deciding.decide import failure_cause
    from ..deciding.notices import fallback_warning

    p, from_cache, proven = made.plan, made.from_cache, made.proven
    nodes = node_count(opts) if link is None else len(link.present)
    if p.chosen is None:
        raise NoWorkingStrategyError(o.framework, [failure_cause(r) for r in p.ruled_out])
    if link is None or link.node == 0:
        fell = fallback_warning(p, results, facts, o, p.chosen)
        if fell:  # as deciding/executor.py says it in a script (its workers do not repeat it)
            print(f"resilient_strategy: {fell}", file=sys.stderr, flush=True)
    run_dir = session / f"attempt{attempt}"
    run_dir.mkdir()
    left = sum(1 for r in p.ranked if r.candidate.key != p.chosen.key)
    devices, visible = binding(p.chosen, facts, env) if agreed is None else ((), "")
    if devices:  # FSDP over a subset that is not the first GPUs: its workers see only those
        _say(f"{p.chosen.label}: its {len(devices)} workers are bound to GPUs "
             f"{','.join(map(str, devices))} (CUDA_VISIBLE_DEVICES={visible})")
    decision = HandedDecision(
        framework=o.framework, chosen=p.chosen.key, results=results, run_dir=str(run_dir),
        attempt=attempt, proven=proven, from_cache=from_cache, notes=notes,
        global_batch_size=o.global_batch_size, label=p.chosen.label,
        # torch: one process per replica, split over the nodes; TensorFlow: one drives them all
        processes=max(1, p.chosen.num_replicas // nodes) if o.framework == "torch" else 1,
        nodes=1 if o.framework != "torch" or p.chosen.num_replicas == 1 else nodes,
        node_trace=_node_trace(p.events) if agreed is not None else (),
        reference_replicas=p.reference_replicas, devices=devices, visible_devices=visible,
        launcher="" if opts.run_launch.launcher == "python" else opts.run_launch.launcher,
        launched_by=opts.run_launch.words(), **_memory_planning(opts, o.framework, facts))
    write_decision(RunDir(run_dir).decision, decision)
    step_s = estimate(p.chosen, facts, results.get(p.chosen.key), o).step_seconds
    return Choice(decision, p.chosen, step_s, left, link, change, tuple(p.ranked))


def _memory_planning(opts: RunOptions, framework: str, facts: Any) -> dict[str, Any]:
    """The sharding and offload the decision was planned with, the flags that gave them (the
    workers' scripts must agree: ``deciding.executor.handed_memory``), and the free memory it
    was planned against (the workers plan with it)."""
    if framework != "torch":
        return {}
    flags = tuple(f"--{name} {value}" for name, value in (
        ("sharding", opts.sharding), ("offload", opts.offload)) if value is not None)
    return {"sharding": opts.planned_sharding, "offload": opts.planned_offload, "flags": flags,
            "free_bytes": tuple(g.memory_free_bytes for g in facts.gpus),
            "host_available_bytes": facts.host.memory_available_bytes}


def _node_trace(events: Sequence[Any]) -> tuple[str, ...]:
    """The lines `agreed_decision` added to the trace (the
    trailing ``multi_node`` notes), for the workers' explain()."""
    from ..core.trace.event import Note

    out: list[str] = []
    for e in reversed(events):
        if not (isinstance(e, Note) and e.topic == "multi_node"):
            break
        out.append(e.message)
    return tuple(reversed(out))


class _RunProber(Prober):
    """The real prober, checking a killed GPU probe's GPUs at once (`probing.prober.RealProber`),
    imported when first used."""

    starts_processes = True

    def probe(self, spec: ProbeSpec, env: Mapping[str, str]) -> ProbeResult:
        from ..probing.prober import RealProber

        return RealProber().probe(spec, env)


#: What proves the candidates of this run's decisions.
_prober: Prober = _RunProber()


def _resume_words(attempt: int, resumed: int | None) -> str:
    """What attempt ``attempt`` (0-based) started from, as its workers reported it."""
    if resumed is None:
        return (f"attempt {attempt + 1} started from step 0: its script restored no "
                "checkpoint (none of the library's restores ran, nor sel.resumed_from)")
    return f"attempt {attempt + 1} resumed from the checkpoint at step {resumed}, restored by its script"


def _last_checkpoint(session: Path) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for note in session.glob(f"attempt*/{CHECKPOINT_NOTE}"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, UnsafePathError):
            data = parse_json(files.read_bytes(note, max_bytes=files.MAX_REPORT_BYTES),  # ours,
                              str(note), allow_nan=True)  # bounded, no FIFO, no symlink
            if best is None or int(data["step"]) > best[0]:
                best = (int(data["step"]), str(data["path"]))
    return best


def main(argv: Sequence[str]) -> int:
    try:
        opts = options_from_args(argv)
    except ResilientStrategyError as exc:
        _say(str(exc))
        return int(ExitCode.USAGE)
    if Path(opts.script).is_dir():
        _say(f"{opts.script} is a directory, not a script: name the Python file to run")
        return int(ExitCode.USAGE)
    if not Path(opts.script).is_file():
        _say(f"no such script: {opts.script}")
        return int(ExitCode.USAGE)
    # the agent's own "failed (exitcode: 1)" lines: each fault gets our one line instead
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    return preempt.settle(supervise_ending(replace(opts)), machine_env.snapshot())

