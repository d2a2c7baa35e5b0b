"""The progress protocol: records round-trip, and the watcher judges each kind of stall (pure,
on a fake clock, from records written by the real writer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient_strategy.records.progress import (
    COLLECTIVE,
    COMM_READY,
    COMM_SETUP,
    DEVICE_READY,
    FINISHED,
    IMPORTED,
    PROGRESS_VAR,
    STARTED,
    ProgressWriter,
    Record,
    StallPolicy,
    StallWatcher,
    read_record,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def group(tmp_path: Path, n: int, clock: Clock, policy: StallPolicy | None = None,
          ) -> tuple[list[ProgressWriter], StallWatcher]:
    paths = [str(tmp_path / f"p{r}") for r in range(n)]
    watcher = StallWatcher(paths, policy or StallPolicy(), clock=clock)
    writers = [ProgressWriter(p, clock=clock) for p in paths]
    return writers, watcher


def ready(writers: list[ProgressWriter]) -> None:
    for w in writers:
        for phase in (IMPORTED, DEVICE_READY, COMM_SETUP, COMM_READY):
            w.phase(phase)


def test_a_record_round_trips_and_a_torn_one_is_ignored(tmp_path: Path) -> None:
    rec = Record(7, COLLECTIVE, 3, 1 << 20, 12.5, 2.0, 0.25)
    data = rec.encode()
    assert len(data) == 128
    assert Record.decode(data) == rec
    assert Record.decode(data[:40] + Record(8, COLLECTIVE, 4).encode()[40:]) is None
    assert Record.decode(b"") is None
    assert read_record(str(tmp_path / "missing")) is None


def test_the_writer_overwrites_one_record_and_measures_the_collective(
        tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "p"
    w = ProgressWriter(str(path), clock=clock)
    assert read_record(str(path)) == Record(1, STARTED, t=clock.t)
    w.enter(1, 8 << 20)
    clock.t += 0.5
    w.leave(1, 8 << 20)
    rec = read_record(str(path))
    assert rec is not None and (rec.seq, rec.phase, rec.k, rec.took_s) == (
        3, "collective_done", 1, 0.5)
    assert path.stat().st_size == 128
    with pytest.raises(ValueError):
        w.phase("lunch")


def test_a_writer_without_a_path_does_nothing(tmp_path: Path) -> None:
    w = ProgressWriter.from_env({})
    assert not w.enabled
    w.enter(1)
    w.leave(1)
    w.close()
    on = ProgressWriter.from_env({PROGRESS_VAR: str(tmp_path / "p")})
    assert on.enabled and read_record(str(tmp_path / "p")) is not None


def test_importing_is_never_judged(tmp_path: Path, clock: Clock) -> None:
    writers, watcher = group(tmp_path, 2, clock)
    writers[0].phase(IMPORTED)
    writers[0].phase(DEVICE_READY)
    writers[0].phase(COMM_SETUP)
    for _ in range(100):  # rank 1 still imports its framework: only the outer deadline counts
        clock.t += 1.0
        assert watcher.poll() is None


def test_a_rank_that_never_enters_setup_is_a_straggler(tmp_path: Path, clock: Clock) -> None:
    writers, watcher = group(tmp_path, 2, clock)
    writers[0].phase(COMM_SETUP)
    writers[1].phase(DEVICE_READY)
    assert watcher.poll() is None
    clock.t += 2.9
    assert watcher.poll() is None
    clock.t += 0.2
    stall = watcher.poll()
    assert stall is not None
    assert (stall.kind, stall.phase, stall.ranks) == ("straggler", COMM_SETUP, (1,))


def test_setup_that_never_completes_is_a_hang(tmp_path: Path, clock: Clock) -> None:
    policy = StallPolicy(setup_grace_s=10.0)
    writers, watcher = group(tmp_path, 2, clock, policy)
    writers[0].phase(COMM_SETUP)
    watcher.poll()
    clock.t += 5.0  # the last rank arrives: the grace counts from here
    writers[1].phase(COMM_SETUP)
    watcher.poll()
    clock.t += 9.9
    assert watcher.poll() is None
    clock.t += 0.2
    stall = watcher.poll()
    assert stall is not None and (stall.kind, stall.ranks) == ("setup", (0, 1))
    writers[0].phase(COMM_READY)  # one rank gets through: the other is still stuck
    stall = watcher.poll()
    assert stall is not None and stall.ranks == (1,)


def test_a_rank_that_never_arrives_at_a_collective(tmp_path: Path, clock: Clock) -> None:
    writers, watcher = group(tmp_path, 3, clock)
    ready(writers)
    watcher.poll()
    writers[0].enter(1, 4096)
    writers[2].enter(1, 4096)
    watcher.poll()
    clock.t += 3.1
    stall = watcher.poll()
    assert stall is not None
    assert (stall.kind, stall.k, stall.ranks) == ("straggler", 1, (1,))
    assert stall.positions == ("0: collective 1", "1: comm_ready", "2: collective 1")


def test_a_straggler_that_still_moves_is_given_time(tmp_path: Path, clock: Clock) -> None:
    writers, watcher = group(tmp_path, 2, clock)
    ready(writers)
    writers[0].enter(1)
    watcher.poll()
    clock.t += 2.0
    writers[1].step(7)  # still working towards the collective
    watcher.poll()
    clock.t += 2.0
    assert watcher.poll() is None


def test_a_collective_that_never_completes_gets_a_grace_from_its_size(
        tmp_path: Path, clock: Clock) -> None:
    policy = StallPolicy()
    writers, watcher = group(tmp_path, 2, clock, policy)
    ready(writers)
    nbytes = 100 << 20
    for w in writers:
        w.enter(1, nbytes)
    watcher.poll()
    limit = policy.collective_grace(1, nbytes)
    assert limit > policy.collective_base_s + policy.first_collective_extra_s  # size counts
    clock.t += limit - 0.1
    assert watcher.poll() is None
    clock.t += 0.2
    stall = watcher.poll()
    assert stall is not None and (stall.kind, stall.k, stall.ranks) == ("collective", 1, (0, 1))
    assert stall.limit_s == pytest.approx(limit, abs=1e-3)


def test_the_grace_follows_the_slowest_measured_transfer(tmp_path: Path, clock: Clock) -> None:
    policy = StallPolicy()
    writers, watcher = group(tmp_path, 2, clock, policy)
    ready(writers)
    nbytes = 16 << 20
    for w in writers:
        w.enter(1, nbytes)
    clock.t += 2.0  # a very slow link: 2 s for 16 MiB
    for w in writers:
        w.leave(1, nbytes)
    watcher.poll()
    assert watcher.s_per_byte == pytest.approx(2.0 / nbytes)
    for w in writers:
        w.enter(2, nbytes)
    watcher.poll()
    clock.t += policy.collective_base_s + policy.safety * 2.0 - 0.1
    assert watcher.poll() is None  # the floor alone would have cut it already
    assert policy.collective_grace(2, nbytes) < policy.collective_base_s + policy.safety * 2.0


def test_a_declared_allowance_extends_the_grace(tmp_path: Path, clock: Clock) -> None:
    writers, watcher = group(tmp_path, 1, clock)
    ready(writers)
    writers[0].enter(1, 0, allow_s=20.0)
    watcher.poll()
    clock.t += 20.0
    assert watcher.poll() is None
    clock.t += 10.0
    stall = watcher.poll()
    assert stall is not None and stall.kind == "collective"


def test_quiet_ready_ranks_only_when_asked(tmp_path: Path, clock: Clock) -> None:
    writers, loose = group(tmp_path, 2, clock)
    strict = StallWatcher(loose.paths, StallPolicy(quiet_s=5.0), clock=clock)
    ready(writers)
    for w in writers:
        w.enter(1)
        w.leave(1)
    loose.poll()
    strict.poll()
    clock.t += 6.0
    assert loose.poll() is None  # training between steps: silence is no stall by default
    stall = strict.poll()
    assert stall is not None and (stall.kind, stall.ranks) == ("quiet", (0, 1))
    for w in writers:
        w.phase(FINISHED)
    clock.t += 60.0
    assert strict.poll() is None  # finished ranks are never judged


def test_healthy_collectives_in_sequence_are_never_judged(tmp_path: Path, clock: Clock) -> None:
    writers, watcher = group(tmp_path, 4, clock, StallPolicy(quiet_s=3.0))
    ready(writers)
    for k in range(1, 50):
        for w in writers:
            w.enter(k, 1 << 20)
        clock.t += 0.5
        assert watcher.poll() is None
        for w in writers:
            w.leave(k, 1 << 20)
        clock.t += 0.5
        assert watcher.poll() is None


def test_a_rank_seen_past_a_collective_has_left_it(tmp_path: Path, clock: Clock) -> None:
    """Records overwrite each other between polls: a rank whose "left k" record the watcher
    never saw, because its "step done" record replaced it, has still left collective k."""
    writers, watcher = group(tmp_path, 2, clock)
    ready(writers)
    for w in writers:
        w.enter(1, 1 << 20)
    assert watcher.poll() is None  # both seen inside collective 1
    for w in writers:
        w.leave(1, 1 << 20)
        w.step(1)  # overwrites "left 1" before the next poll
    clock.t += 600.0  # a long evaluation in user code: nobody waits in a collective
    assert watcher.poll() is None


def test_a_finished_rank_is_not_waiting_in_its_last_collective(tmp_path: Path,
                                                               clock: Clock) -> None:
    writers, watcher = group(tmp_path, 2, clock)
    ready(writers)
    for w in writers:
        w.enter(1, 1 << 20)
    assert watcher.poll() is None
    for w in writers:
        w.leave(1, 1 << 20)
        w.phase(FINISHED)  # the watcher never sees "left 1"
    clock.t += 600.0
    assert watcher.poll() is None
