"""Goodput accounting (issue 33, item 1): pure, from hand-written attempts with their phase
marks, then from a real supervised job on CPU with a real SIGKILL of one rank."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import deadline

from resilient_strategy.records import phases
from resilient_strategy.records.phases import Timeline
from resilient_strategy.run.exitcodes import ExitCode
from resilient_strategy.run.goodput import account
from resilient_strategy.run.policy import Action, Attempt, Judgement
from resilient_strategy.run.verdicts import Verdict, VerdictKind

ROOT = Path(__file__).resolve().parents[1]


def _attempt(number: int, start: float, first: float, fault: float, stopped: float,
             verdict: Verdict, resumed_from: int | None, action: Action,
             stalls: tuple[float, float] | None = None) -> Attempt:
    sup = {phases.AGENT_STARTED: start, phases.WORKERS_STARTED: start + 1.0,
           phases.WORKERS_STOPPED: stopped, phases.VERDICT: stopped + 0.5}
    if not verdict.ok:
        sup[phases.FAULT_SEEN] = fault
    ranks: tuple[dict[str, float], ...] = (
        {phases.FIRST_STEP: first - 0.2}, {phases.FIRST_STEP: first})
    if stalls is not None:  # each rank's checkpoint stall since its first step
        ranks = tuple({**r, phases.CHECKPOINT_STALL: s} for r, s in zip(ranks, stalls, strict=True))
    return Attempt(number, "torch:nccl:0,1", "NCCL on GPUs 0,1", verdict,
                   Judgement(action, "x", ExitCode.SUCCESS if verdict.ok else None),
                   resumed_from, Timeline(sup, ranks))


def _two_attempts(fault: Verdict, stalls: tuple[float, float] | None = None) -> list[Attempt]:
    # attempt 1: agent at 100, first step done at 110, the fault seen at 150 in step 41 (40 steps
    # done, 39 after the first-step mark: 1 s each less the detection), workers stopped at 152;
    # attempt 2 resumes from the checkpoint at step 35 (5 steps done again), runs to the end
    return [
        _attempt(0, 100.0, 110.0, 150.0, 152.0, fault, None, Action.RETRY, stalls),
        _attempt(1, 160.0, 170.0, 0.0, 200.0, Verdict(VerdictKind.OK, "finished", 64), 35,
                 Action.FINISH, stalls),
    ]


def test_the_parts_add_up_to_the_wall_time_and_name_the_lost_work() -> None:
    exit_ = Verdict(VerdictKind.EXIT, "rank 1 was killed", 41, ranks=(1,))
    g = account(_two_attempts(exit_), job_start=95.0, job_end=201.0)
    assert math.isclose(sum(g.parts().values()), g.wall_s) and g.wall_s == 106.0
    assert g.decide_s == 5.0  # the supervisor's start to the first agent
    assert g.restart_s == pytest.approx(160.0 - 152.5)  # verdict to the next agent
    first, second = g.attempts
    assert (first.steps, first.wasted_steps) == (40, 5)
    assert first.step_s == pytest.approx(40.0 / 39)
    assert first.wasted_progress_s == pytest.approx(5 * 40.0 / 39)
    assert first.detection_s == 0.0 and first.stop_s == pytest.approx(152.5 - 150.0)
    assert (second.steps, second.wasted_steps) == (29, 0)
    assert g.startup_s == pytest.approx(10.0 + 10.0)
    assert g.interruptions == 1
    assert g.to_dict()["goodput"] == round(g.productive_s / g.wall_s, 4)


def test_a_stall_counts_its_wait_as_detection_not_as_productive_time() -> None:
    stall = Verdict(VerdictKind.STALL, "stalled", 41, "timeout", ranks=(1,), detect_s=15.0)
    exit_ = Verdict(VerdictKind.EXIT, "rank 1 was killed", 41, ranks=(1,))
    stalled, exited = (account(_two_attempts(v), 95.0, 201.0) for v in (stall, exit_))
    assert stalled.detection_s == 15.0
    assert stalled.attempts[0].step_s == pytest.approx((40.0 - 15.0) / 39)
    assert stalled.productive_s < exited.productive_s
    assert math.isclose(sum(stalled.parts().values()), stalled.wall_s)


def test_checkpoint_stalls_are_a_part_of_their_own_counted_once() -> None:
    """The ranks' checkpoint stalls (the largest rank's: the others wait for it) leave the
    productive time and the step time, so the lost work is counted at the steps' own time and
    no second of a save is counted twice; the parts still add up to the wall time."""
    exit_ = Verdict(VerdictKind.EXIT, "rank 1 was killed", 41, ranks=(1,))
    plain = account(_two_attempts(exit_), job_start=95.0, job_end=201.0)
    stalled = account(_two_attempts(exit_, stalls=(3.0, 1.0)), job_start=95.0, job_end=201.0)
    assert plain.checkpoint_stall_s == 0.0 and "checkpoint_stall_s" in plain.parts()
    first, second = stalled.attempts
    assert (first.checkpoint_stall_s, second.checkpoint_stall_s) == (3.0, 3.0)
    assert stalled.checkpoint_stall_s == 6.0
    assert first.step_s == pytest.approx((40.0 - 3.0) / 39)
    assert first.wasted_progress_s == pytest.approx(5 * (40.0 - 3.0) / 39)
    for one in stalled.attempts:  # first step to the fault (or the last step), split once
        both = next(p for p in plain.attempts if p.number == one.number)
        assert one.productive_s + one.checkpoint_stall_s + one.wasted_progress_s \
            == pytest.approx(both.productive_s + both.wasted_progress_s)
    assert math.isclose(sum(stalled.parts().values()), stalled.wall_s)
    assert stalled.wall_s == plain.wall_s and stalled.goodput < plain.goodput
    assert stalled.to_dict()["checkpoint_stall_s"] == 6.0
    assert stalled.to_dict()["attempts"][0]["checkpoint_stall_s"] == 3.0


def test_a_stall_beyond_the_running_time_is_capped_at_it() -> None:
    exit_ = Verdict(VerdictKind.STALL, "stalled", 41, "timeout", ranks=(1,), detect_s=15.0)
    g = account(_two_attempts(exit_, stalls=(500.0, 0.0)), job_start=95.0, job_end=201.0)
    first = g.attempts[0]
    assert first.checkpoint_stall_s == pytest.approx(40.0 - 15.0)  # the running time less
    assert first.productive_s == 0.0 and first.wasted_progress_s == 0.0  # the detection
    assert all(v >= 0 for v in g.parts().values())
    assert math.isclose(sum(g.parts().values()), g.wall_s) and g.wall_s == 106.0


def test_an_attempt_that_never_stepped_is_all_start_up_and_one_without_marks_is_skipped() -> None:
    never = _attempt(0, 100.0, 0.0, 130.0, 131.0,
                     Verdict(VerdictKind.EXIT, "died at import", 1), None, Action.RETRY)
    never = Attempt(never.number, never.candidate, never.label, never.verdict, never.judgement,
                    None, Timeline(never.times.supervisor if never.times else {}, ({}, {})))
    unmarked = Attempt(1, "k", "l", Verdict(VerdictKind.OK, "finished", 3),
                       Judgement(Action.FINISH, "x", ExitCode.SUCCESS), None, None)
    g = account([never, unmarked], 100.0, 140.0)
    assert (g.startup_s, g.productive_s) == (30.0, 0.0)
    assert len(g.attempts) == 1 and math.isclose(sum(g.parts().values()), g.wall_s)


def test_marks_from_another_clock_never_give_a_negative_part() -> None:
    exit_ = Verdict(VerdictKind.EXIT, "x", 41)
    g = account(_two_attempts(exit_), job_start=150.0, job_end=120.0)  # an end before the start
    assert all(v >= 0 for v in g.parts().values()) and 0.0 <= g.goodput <= 1.0


@pytest.mark.slow
@pytest.mark.torch
def test_a_real_sigkill_is_accounted_and_the_summary_ends_with_the_goodput(
        tmp_path: Path) -> None:
    """A real supervised job (gloo, 2 ranks, CPU), rank 1 SIGKILLed at step 12: the job resumes
    from its checkpoint at step 10, attempts.json's goodput adds up to its wall time and says
    the steps done again, and the summary line ends with the job's goodput."""
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("bench_realfaults",
                                                  ROOT / "benchmarks" / "bench_realfaults.py")
    assert spec is not None and spec.loader is not None
    rf = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_realfaults", rf)
    spec.loader.exec_module(rf)
    import argparse

    args = argparse.Namespace(src=str(ROOT / "src"), step_s=0.05, steps=30, cache=tmp_path / "c",
                              backend="gloo", run_args=[], deadline=300.0)
    run = rf.Run(args, tmp_path, {})
    run.start()
    assert run.wait_step(1, 12), "the run never reached the step"
    for pid in run.rank_pids(1):
        os.kill(pid, signal.SIGKILL)
    row = run.finish(rf.Row("sigkill"), None)
    out = (tmp_path / "output.txt").read_text()
    assert row.exit_code == 0, out[-3000:]
    [record] = (tmp_path / "resilient-strategy-evidence").glob("*/attempts.json")
    data = json.loads(record.read_text())
    g = data["goodput"]
    parts = [v for k, v in g.items() if k.endswith("_s") and k != "wall_s"]
    assert sum(parts) == pytest.approx(g["wall_s"], abs=0.01)
    assert g["interruptions"] == 1 and 0 < g["goodput"] < 1
    first = g["attempts"][0]
    # rank 0 saved asynchronously at steps 5 and 10, after its first step and before the kill
    assert first["checkpoint_stall_s"] > 0 and g["checkpoint_stall_s"] >= first["checkpoint_stall_s"]
    resumed = data["attempts"][1]["resumed_from"]
    assert first["wasted_steps"] == max(0, data["attempts"][0]["verdict"]["step"] - 1 - resumed)
    assert row.goodput is not None and row.goodput == pytest.approx(100 * g["goodput"], abs=0.06)


def test_a_finished_attempt_is_productive_until_its_last_step_not_its_exit() -> None:
    """The script's work after its last optimizer step (a final save, the teardown, the exit)
    is not training: with every rank's last-step mark it counts as the attempt's ending."""
    ok = Verdict(VerdictKind.OK, "finished", 64)
    plain = _attempt(0, 100.0, 110.0, 0.0, 200.0, ok, None, Action.FINISH)
    assert plain.times is not None
    ranks = tuple({**r, phases.LAST_STEP: 180.0 + i} for i, r in enumerate(plain.times.ranks))
    marked = Attempt(plain.number, plain.candidate, plain.label, ok, plain.judgement, None,
                     Timeline(plain.times.supervisor, ranks))
    before, after = account([plain], 95.0, 201.0), account([marked], 95.0, 201.0)
    assert before.productive_s == pytest.approx(90.0)  # first step to the workers' exit
    assert after.productive_s == pytest.approx(71.0)  # to the slowest rank's last step
    assert after.stop_s == pytest.approx(200.5 - 181.0)
    assert math.isclose(sum(after.parts().values()), after.wall_s)


_SAVING = """
import json, os, sys
import resilient_strategy
sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=16)
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.utils.data.TensorDataset(torch.randn(512, 64), torch.randint(0, 4, (512,)))
loader = torch.utils.data.DataLoader(data, batch_size=sel.batch_size, drop_last=True)
ckpt = sel.checkpoint(sys.argv[1], every_steps=2, asynchronous=sys.argv[2] == "async")
model, opt, loader = sel.prepare(model, opt, loader)
while sel.optimizer_steps < 16:
    sel.set_epoch(0)
    for x, y in loader:
        with sel.accumulate(model):
            sel.backward(torch.nn.functional.cross_entropy(model(x), y))
        sel.step(opt)
        if sel.optimizer_steps >= 16:
            break
with open(os.path.join(sys.argv[3], f"saves{os.getpid()}.json"), "w") as fh:
    json.dump({"stall_s": ckpt.stall_s, "modes": [r.mode for r in ckpt.saves]}, fh)
sel.shutdown()
"""


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_real_job_that_saves_checkpoints_accounts_their_stalls(tmp_path: Path,
                                                                  mode: str) -> None:
    """A real supervised job (one CPU process) saves a checkpoint every 2 steps, exits once at
    step 9 (a rehearsed transient exit) and resumes: attempts.json's split has the checkpoint
    part, > 0 in both attempts, the finished attempt's the checkpointer's own measure (it saved
    only between its first and last step), and the parts still add up to the wall time."""
    pytest.importorskip("torch")
    script, saves = tmp_path / "train.py", tmp_path / "saves"
    script.write_text(textwrap.dedent(_SAVING))
    (tmp_path / "tmp").mkdir()
    saves.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}
    env.update({"PYTHONPATH": str(ROOT / "src"), "TMPDIR": str(tmp_path / "tmp"),
                "CUDA_VISIBLE_DEVICES": "", "RESILIENT_STRATEGY_CACHE_DIR": str(tmp_path / "c"),
                "RESILIENT_STRATEGY_TRAIN_FAULT": "exit:0:cpu:9:1"})
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node", "1",
         str(script), str(tmp_path / "ckpt"), mode, str(saves)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=deadline(300))
    assert proc.returncode == ExitCode.SUCCESS, proc.stderr[-3000:]
    [record] = (tmp_path / "resilient-strategy-evidence").glob("*/attempts.json")
    data = json.loads(record.read_text())
    g = data["goodput"]
    assert sum(v for k, v in g.items() if k.endswith("_s") and k != "wall_s") \
        == pytest.approx(g["wall_s"], abs=0.01)
    first, last = g["attempts"]
    assert first["checkpoint_stall_s"] > 0 and last["checkpoint_stall_s"] > 0
    assert g["checkpoint_stall_s"] == pytest.approx(
        first["checkpoint_stall_s"] + last["checkpoint_stall_s"], abs=0.002)
    for one in g["attempts"]:
        assert sum(v for k, v in one.items() if k.endswith("_s") and k not in (
            "wall_s", "step_s")) == pytest.approx(one["wall_s"])
    [finished] = [json.loads(f.read_text()) for f in saves.iterdir()]  # the last attempt's
    assert set(finished["modes"]) == {mode}
    noted = data["attempts"][1]["times"]["ranks"][0][phases.CHECKPOINT_STALL]
    assert noted == pytest.approx(finished["stall_s"])
    assert last["checkpoint_stall_s"] == pytest.approx(noted)
