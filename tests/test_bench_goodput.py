"""benchmarks/bench_goodput.py's accounting from outside (pure: a hand-written step log, no
process): each step that counts is counted once, the fault's badput splits into detection and
stop, restart and lost work, and a job that never got back says so. Also the cold-start
benchmark's phases (benchmarks/bench_coldstart.py) add up to the launch's wall time."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bg = _load("bench_goodput")
bc = _load("bench_coldstart")


def _job(tmp: Path, lines: list[tuple[int, float, int]]) -> object:
    job = bg.Job(argparse.Namespace(), "torchrun", tmp)
    job.marks.mkdir(parents=True)
    (job.marks / "steps.log").write_text("".join(f"{s} {t} {p}\n" for s, t, p in lines))
    job.started = 0.0
    return job


def test_a_resumed_job_counts_each_step_once_and_splits_the_fault(tmp_path: Path) -> None:
    # attempt 1 (pid 1): steps 1..17 one second apart from t=10; killed at 27.5; its workers
    # gone at 28; attempt 2 (pid 2) resumes from the checkpoint at 10: step 11 at 40, then
    # one second each, step 17 (the fault's) again at 46, the last (20) at 49
    first = [(s, 9.0 + s, 1) for s in range(1, 18)]
    second = [(s, 29.0 + s, 2) for s in range(11, 21)]
    job = _job(tmp_path, first + second)
    res = bg.Result("torchrun", "kill", wall_s=50.0)
    job._account(res, fault_at=27.5, stopped_at=28.0)
    assert res.steps == 20 and res.fault_step == 17
    # 20 steps count, each once, at the first attempt's median step time (1 s); as they ran:
    # steps 1..10 of attempt 1 and 11..20 of attempt 2, their first steps at that time
    assert res.step_s == pytest.approx(1.0)
    assert res.productive_s == pytest.approx(20.0) and res.counted_s == pytest.approx(20.0)
    assert (res.stopped_s, res.restarted_s, res.recovered_s) == pytest.approx((0.5, 12.5, 18.5))
    assert res.badput() == "18.5"
    assert res.goodput == pytest.approx(20.0 / 50.0)


def test_a_job_that_never_came_back_is_lost_or_capped(tmp_path: Path) -> None:
    job = _job(tmp_path, [(s, 9.0 + s, 1) for s in range(1, 18)])
    lost = bg.Result("unsupervised", "kill", wall_s=30.0)
    job._account(lost, fault_at=27.5, stopped_at=28.0)
    assert lost.recovered_s is None and lost.badput() == "job lost"
    hung = bg.Result("torchrun", "stop", wall_s=82.5, capped=True, after_s=45.0)
    job._account(hung, fault_at=27.5, stopped_at=None)
    assert hung.stopped_s is None and hung.after_s == pytest.approx(45.0)  # the bench's stop
    assert hung.badput() == "> 45" and hung.productive_s == pytest.approx(17.0)


def test_steps_slowed_after_a_step_down_count_at_the_healthy_step_time(tmp_path: Path) -> None:
    # attempt 2 runs its steps 3 s each (one process, accumulating): the productive time
    # counts them at the healthy 1 s; as run they took longer
    first = [(s, 9.0 + s, 1) for s in range(1, 18)]
    second = [(s, 40.0 + 3 * (s - 11), 2) for s in range(11, 21)]
    res = bg.Result("library", "comm", wall_s=80.0)
    _job(tmp_path, first + second)._account(res, fault_at=27.5, stopped_at=28.0)
    assert res.productive_s == pytest.approx(20.0)
    assert res.counted_s == pytest.approx(10.0 + 3.0 * 9 + 1.0)


def test_the_cold_start_phases_add_up_to_the_wall_time() -> None:
    run = {"wall_s": 6.0, "marks": {"script": 1.2, "import": 1.3, "decided": 3.3, "torch": 4.2,
                                    "group": 4.3, "checked": 4.35, "ended": 4.4}}
    phases = dict(bc.phases_of(run))
    assert sum(phases.values()) == pytest.approx(6.0)
    assert phases["decision"] == pytest.approx(2.0)
    hand = dict(bc.phases_of({"wall_s": 4.0, "marks": {"script": 1.2, "torch": 2.5,
                                                       "group": 2.6, "checked": 2.7,
                                                       "ended": 2.8}}))
    assert "decision" not in hand and sum(hand.values()) == pytest.approx(4.0)
