"""The supervisor's attempt loop (`run.loop.run_attempts`), driven with fake hooks and the real
ladder (`policy.relaunch`): one case per row of the verdict table in docs/how-to/run.md, each
asserting the actions taken, the candidates attempted and the exit code. Then the supervisor's
own hooks with a scripted launch: the step a relaunch resumes from is the one its own script
restored."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _fake_hooks import LADDER, FakeHooks

from resilient_strategy.core.values.candidate import Candidate
from resilient_strategy.records.handoff import HandedDecision, write_decision
from resilient_strategy.records.rundir import RunDir
from resilient_strategy.run import supervisor
from resilient_strategy.run.evidence import Evidence
from resilient_strategy.run.exitcodes import ExitCode
from resilient_strategy.run.loop import Observed, Watched, ending_of, run_attempts
from resilient_strategy.run.policy import Action, Attempt, Judgement, RelaunchPolicy
from resilient_strategy.run.preempt import Ending
from resilient_strategy.run.verdicts import Verdict
from resilient_strategy.run.verdicts import VerdictKind as K

A, B = LADDER[0].key, LADDER[1].key


def v(kind: K, step: int, **kw: object) -> Verdict:
    return Verdict(kind, f"{kind.value} at step {step}", step, **kw)  # type: ignore[arg-type]


_OK = v(K.OK, 300)
#: (verdicts scripted, in turn) -> (the actions taken, the candidates attempted, exit code,
#: the cause blaming the node); one row per row of the how-to's verdict table (the machine's
#: causes raised inside a collective: even there, a repeat never steps down)
ROWS: dict[str, tuple[list[Verdict], list[str], list[str], int, str | None]] = {
    "ok": ([_OK], ["finish"], [A], 0, None),
    **{f"stall_{kind}_repeat_steps_down": (
        [v(K.STALL, 50, stall=kind), v(K.STALL, 60, stall=kind), _OK],
        ["retry", "step_down", "finish"], [A, A, B], 0, None) for kind in ("collective", "setup")},
    # a repeat whose evidence clears the transport: busy in the script's own code is the
    # script's (1); stopped, never arrived, asleep: the machine's or unknown (75)
    **{f"stall_{kind}_repeat_stops_{code}": (
        [v(K.STALL, 50, stall=kind), v(K.STALL, 60, stall=kind)], ["retry", "stop"], [A, A],
        code, None) for kind, code in (("busy", 1), ("stopped", 75), ("straggler", 75),
                                        ("asleep", 75))},
    "exit_in_a_collective_repeat_steps_down": (
        [v(K.EXIT, 50, phase="collective"), v(K.EXIT, 60, phase="collective"), _OK],
        ["retry", "step_down", "finish"], [A, A, B], 0, None),
    "exit_without_phase_repeat_stops_75": (
        [v(K.EXIT, 50), v(K.EXIT, 60)], ["retry", "stop"], [A, A], 75, None),
    "lost_repeat_steps_down": (
        [v(K.LOST, 50, node=1), v(K.LOST, 60, node=1), _OK],
        ["retry", "step_down", "finish"], [A, A, B], 0, None),
    "join_more_nodes": ([v(K.JOIN, 50), _OK], ["more_nodes", "finish"], [A, A], 0, None),
    "cut_off_stops_75": ([v(K.CUT_OFF, 50)], ["stop"], [A], 75, None),
    "backend_steps_down_at_once": (
        [v(K.BACKEND, 50, cause="nccl_error"), _OK], ["step_down", "finish"], [A, B], 0, None),
    "backend_after_a_healthy_stretch_retried": (
        [v(K.BACKEND, 500, cause="nccl_error"), v(K.OK, 900)], ["retry", "finish"], [A, A], 0,
        None),
    "user_stops_1": ([v(K.USER, 50)], ["stop"], [A], 1, None),
    "oom_stops_1": ([v(K.OOM, 50)], ["stop"], [A], 1, None),
    "gpu_fault_repeat_stops_75_blaming_the_node": (
        [v(K.EXIT, 50, cause="gpu_fault", phase="collective"),
         v(K.EXIT, 60, cause="gpu_fault", phase="collective")],
        ["retry", "stop"], [A, A], 75, "gpu_fault"),
    # the same fault recorded by node 1 (this node stopped for it): stopped alike, never this
    # node's to be excluded for
    "gpu_fault_of_another_node_repeat_stops_75_blaming_none": (
        [v(K.EXIT, 50, cause="gpu_fault", phase="collective", node=1),
         v(K.EXIT, 60, cause="gpu_fault", phase="collective", node=1)],
        ["retry", "stop"], [A, A], 75, None),
    "no_space_stops_75": ([v(K.EXIT, 50, cause="no_space")], ["stop"], [A], 75, None),
    "storage_error_repeat_stops_75": (
        [v(K.EXIT, 50, cause="storage_error", phase="collective"),
         v(K.EXIT, 60, cause="storage_error", phase="collective")],
        ["retry", "stop"], [A, A], 75, None),
    "launch_stops_2": ([v(K.LAUNCH, 0, cause="port_in_use")], ["stop"], [A], 2, None),
    "same_fault_on_another_backend_stops_2": (
        [v(K.BACKEND, 50, cause="remote_error", detail="peer 3 closed"),
         v(K.BACKEND, 70, cause="remote_error", detail="peer 5 closed")],
        ["step_down", "stop"], [A, B], 2, None),
    "diverged_stops_1": ([v(K.DIVERGED, 50)], ["stop"], [A], 1, None),
}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_each_verdict_of_the_table_through_the_loop(row: str) -> None:
    verdicts, actions, attempted, code, blamed = ROWS[row]
    hooks = FakeHooks(verdicts)
    ending = run_attempts(hooks, LADDER[0])
    assert [k for _, k in hooks.started] == attempted
    assert [j.action.value for j in hooks.finished] == [actions[-1]]
    assert [a for _, a, _ in hooks.relaunched] == actions[:-1]
    assert (ending.code, ending.node_fault) == (code, blamed)


def test_the_loop_records_each_attempt_and_relaunches_on_the_judged_rung() -> None:
    hooks = FakeHooks([v(K.BACKEND, 50, cause="nccl_error"), _OK], restored=[None, 40])
    assert run_attempts(hooks, LADDER[0]).code == 0
    # the step-down told the ladder what failed, with its cause (the plan's mid-run failure)
    assert [(k, f.cause, dict(f.extra)["mid_run"]) for k, f in hooks.chosen] == [
        (A, "nccl_error", "50")]
    assert hooks.relaunched == [(1, "step_down", B)]


def test_nothing_left_to_step_down_to_stops_75() -> None:
    hooks = FakeHooks([v(K.BACKEND, 50, cause="nccl_error")], ladder=LADDER[:1])
    assert (run_attempts(hooks, LADDER[0]).code, hooks.finished[0].rule) == (75, "no_candidate")


def test_a_crash_loop_stops_75_whatever_the_kind() -> None:
    """Two attempts in a row that got fewer than 10 steps further (the bound set to 2): the
    second stops the run before the fault rate is asked."""
    hooks = FakeHooks([v(K.STALL, 5, stall="collective"), v(K.BACKEND, 8, cause="nccl_error")],
                      policy=RelaunchPolicy(max_attempts_without_progress=2))
    ending = run_attempts(hooks, LADDER[0])
    assert (ending.code, hooks.finished[0].rule) == (75, "crash_loop")
    assert [a for _, a, _ in hooks.relaunched] == ["retry"]


def test_an_attempt_stopped_from_outside_ends_the_run_as_it_says() -> None:
    hooks = FakeHooks([v(K.EXIT, 50), Ending(130)])
    assert run_attempts(hooks, LADDER[0]) == Ending(130)
    assert (hooks.finished, [a for _, a, _ in hooks.relaunched]) == ([], ["retry"])


def test_across_nodes_only_this_nodes_own_fault_blames_it() -> None:
    """The merged verdict names the node whose record it is, this node's own number too: a GPU
    fault recorded by this node (0) blames it; node 1's, which node 0 stopped for, does not."""
    def stop(on: int) -> list[Attempt]:
        verdict = v(K.EXIT, 50, cause="gpu_fault", node=on)
        return [Attempt(0, A, "a", verdict, Judgement(Action.STOP, "x", ExitCode.INFRASTRUCTURE))]

    stopped = Judgement(Action.STOP, "x", ExitCode.INFRASTRUCTURE)
    assert ending_of(stop(0), stopped, node=0) == Ending(75, "gpu_fault")
    assert ending_of(stop(1), stopped, node=0) == Ending(75, None)
    assert ending_of(stop(1), stopped, node=1) == Ending(75, "gpu_fault")


def test_an_ending_without_an_exit_code_is_infrastructure() -> None:
    assert ending_of([], Judgement(Action.STOP, "x")) == Ending(75, None)


# ----- the supervisor's own hooks: what a relaunch resumes from --------------------------------

@dataclass
class _Scripted(supervisor._Run):
    """The real hooks with the launch scripted: each attempt's script restores a step (its
    restore note), notes a checkpoint (its checkpoint note), and comes to a verdict."""

    script: Sequence[tuple[int | None, int, Verdict]] = ()
    resumes: list[tuple[int, int | None]] = field(default_factory=list)

    def start_and_watch(self, attempt: int, choice: supervisor.Choice) -> Watched | Ending:
        restored, noted, verdict = self.script[attempt]
        run = RunDir(Path(choice.decision.run_dir))
        if restored is not None:
            run.restore_note.write_text(json.dumps({"step": restored}))
        run.checkpoint_note.write_text(json.dumps({"step": noted, "path": f"ckpt/{noted}"}))
        return Watched(verdict)


def _real_hooks(tmp_path: Path, script: Sequence[tuple[int | None, int, Verdict]]
                ) -> tuple[_Scripted, supervisor.Choice]:
    session = tmp_path / "session"
    (session / "attempt0").mkdir(parents=True)
    cand = Candidate("torch", "nccl", (0, 1), num_replicas=2)
    decision = HandedDecision("torch", cand.key, {}, str(session / "attempt0"), label=cand.label,
                              processes=2)
    write_decision(RunDir(session / "attempt0").decision, decision)
    opts = supervisor.RunOptions("train.py", evidence_dir=str(tmp_path / "evidence"))
    hooks = _Scripted(opts, {}, None, session, time.time(),
                      Evidence(tmp_path / "evidence", session.name), {}, None, None,
                      team=None, changes=[], script=script)
    return hooks, supervisor.Choice(decision, cand, 1.0, 1)


def test_a_relaunch_resumes_from_the_step_its_own_script_restored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempt 3's script restored step 150: that is its resume, never the checkpoint attempt 2
    noted (190), nor the step attempt 2 resumed from (40) or failed at (200)."""
    said: list[tuple[int, int | None]] = []
    words = supervisor._resume_words
    monkeypatch.setattr(supervisor, "_resume_words",
                        lambda attempt, resumed: said.append((attempt, resumed))
                        or words(attempt, resumed))
    hooks, first = _real_hooks(tmp_path, [
        (None, 45, v(K.EXIT, 50)),  # no restore; a checkpoint noted at 45
        (40, 190, v(K.EXIT, 200)),  # restored 40 (not the 45 noted), noted 190
        (150, 290, v(K.OK, 300)),  # restored 150 (not the 190 noted)
    ])
    ending = run_attempts(hooks, first)
    assert ending.code == 0
    assert said == [(1, 40), (2, 150)]
    summary = json.loads((tmp_path / "evidence" / "session" / "attempts.json").read_text())
    assert [a["resumed_from"] for a in summary["attempts"]] == [None, 40, 150]
    assert [a["action"] for a in summary["attempts"]] == ["retry", "retry", "finish"]
    assert [Path(d).name for d in sorted(str(p) for p in (tmp_path / "session").iterdir())] == [
        "attempt0", "attempt1", "attempt2"]


def test_the_real_judge_alone_retries_in_a_fresh_attempt_directory(tmp_path: Path) -> None:
    """One hook driven alone: a first exit is retried on the same candidate, decided into the
    next attempt's own directory; a script's fault has no next attempt."""
    hooks, first = _real_hooks(tmp_path, [])
    judged = hooks.judge(0, first, Observed(v(K.EXIT, 50)), [])
    assert judged.judgement.action is Action.RETRY and judged.next is not None
    assert (judged.next.decision.chosen, judged.next.decision.attempt) == (
        first.decision.chosen, 1)
    assert Path(judged.next.decision.run_dir) == tmp_path / "session" / "attempt1"
    stopped = hooks.judge(1, judged.next, Observed(v(K.USER, 60)), [])
    assert (stopped.judgement.exit_code, stopped.next) == (1, None)
