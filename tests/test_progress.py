"""The progress protocol: records written by a rank, read and judged by one watcher."""

from __future__ import annotations

from pathlib import Path

from resilient_strategy.progress import (
    COLLECTIVE,
    COMPUTE,
    DONE,
    OUTSIDE,
    STARTING,
    ProgressWriter,
    StallWatch,
    classify_stall,
    default_stall_timeout,
    progress_path,
    read_record,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_round_trip_and_missing(tmp_path: Path) -> None:
    assert read_record(tmp_path / "none") is None
    w = ProgressWriter(tmp_path / "r")
    rec = read_record(tmp_path / "r")
    assert rec is not None and (rec.step, rec.phase, rec.seq % 2) == (0, STARTING, 0)
    w.report(COLLECTIVE, 3)
    rec = read_record(tmp_path / "r")
    assert rec is not None and (rec.step, rec.phase_name) == (3, "collective")
    assert rec.step_time > 0
    seq = rec.seq
    w.report(COLLECTIVE, 3)  # nothing changed: nothing written
    again = read_record(tmp_path / "r")
    assert again is not None and again.seq == seq
    w.close()


def _writers(tmp: Path, n: int) -> list[ProgressWriter]:
    return [ProgressWriter(progress_path(tmp, r)) for r in range(n)]


def test_stall_needs_a_rank_in_a_collective_and_the_timeout(tmp_path: Path) -> None:
    clock = Clock()
    watch = StallWatch(tmp_path, 2, timeout_s=5.0, clock=clock)
    assert watch.poll() is None  # nobody reported: not started
    w = _writers(tmp_path, 2)
    assert watch.poll() is None
    clock.now += 60
    assert watch.poll() is None  # both starting / outside: slow user code is no stall
    w[0].report(COLLECTIVE, 7)
    w[1].report(COLLECTIVE, 7)
    assert watch.poll() is None
    clock.now += 4.9
    assert watch.poll() is None
    clock.now += 0.2
    stall = watch.poll()
    assert stall is not None and stall.kind == "backend" and stall.step == 7
    w[1].report(OUTSIDE, 8)  # progress again: the clock restarts
    assert watch.poll() is None
    clock.now += 5.1
    stall = watch.poll()
    assert stall is not None and stall.kind == "diverged"
    w[0].report(DONE, 8)
    assert watch.poll() is None
    clock.now += 10
    assert watch.poll() is None  # finishing is the agent's to see
    for x in w:
        x.close()


def test_default_timeout_follows_step_times(tmp_path: Path) -> None:
    assert default_stall_timeout([]) == 60.0
    assert default_stall_timeout([0.1, 0.2, 0.3]) == 60.0
    assert default_stall_timeout([5.0, 4.0, 6.0]) == 100.0
    watch = StallWatch(tmp_path, 1, clock=Clock())
    assert watch.current_timeout() == 60.0


def test_classify_stall() -> None:
    from resilient_strategy.progress import Record

    def rec(step: int, phase: int) -> Record:
        return Record(2, step, phase, 1.0)

    assert classify_stall({0: rec(3, COLLECTIVE), 1: rec(3, COLLECTIVE)})[0] == "backend"
    assert classify_stall({0: rec(3, COMPUTE), 1: rec(3, COLLECTIVE)})[0] == "diverged"
    assert classify_stall({0: rec(3, COLLECTIVE), 1: rec(2, COLLECTIVE)})[0] == "diverged"
    assert classify_stall({0: None, 1: rec(3, COLLECTIVE)})[0] == "diverged"
