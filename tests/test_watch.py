"""The supervisor's watch judges by what each rank's process is doing (pure: records written by
the real writer, a fake clock, process readings as data): a stopped rank is named as the one
holding the others up, a rank busy in its own code is left alone until the busy ceiling, a rank
that neither runs nor progresses is a stall naming it; a collective enqueued and never
completed on the device still holds its rank; the default allowance and torch's timeouts."""

from __future__ import annotations

from pathlib import Path

from resilient_strategy.machine.procs import ProcStat
from resilient_strategy.records.flightdump import DumpStatus, RankDump, divergence, parse_dump
from resilient_strategy.records.progress import (
    NOT_FOLLOWED,
    DevicePoller,
    ProgressWriter,
    Record,
    Stall,
    read_record,
)
from resilient_strategy.run.verdicts import VerdictKind, classify_attempt, diverged
from resilient_strategy.run.watch import (
    ASLEEP,
    BUSY,
    DEFAULT_BUSY_S,
    STOPPED,
    Activity,
    TrainingWatch,
    default_stall_timeout,
    stopped_reason,
    torch_timeouts,
)

TICKS = 100.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Procs:
    """Each pid's state and CPU ticks, as the test sets them (the reader's answers)."""

    def __init__(self) -> None:
        self.state: dict[int, str] = {}
        self.ticks: dict[int, int] = {}

    def read(self, pid: int) -> ProcStat | None:
        return ProcStat(pid, self.state.get(pid, "S"), self.ticks.get(pid, 0))


PIDS = {0: 1000, 1: 1001}


def _group(tmp_path: Path, timeout_s: float = 15.0, busy_s: float | None = None
           ) -> tuple[Clock, Procs, list[ProgressWriter], TrainingWatch]:
    clock, procs = Clock(), Procs()
    tmp_path.mkdir(parents=True, exist_ok=True)
    paths = [str(tmp_path / f"r{i}") for i in range(2)]
    writers = [ProgressWriter(p, clock=clock) for p in paths]
    watch = TrainingWatch(paths, timeout_s, clock, busy_s=busy_s,
                          activity=Activity(procs.read, TICKS))
    return clock, procs, writers, watch


def _run(clock: Clock, procs: Procs, watch: TrainingWatch, seconds: float,
         cpu: dict[int, float]) -> Stall | None:
    """Poll every 0.5 s for ``seconds`` while each rank uses ``cpu[rank]`` of a CPU; the first
    stall, or None."""
    for _ in range(int(seconds / 0.5)):
        clock.now += 0.5
        for rank, share in cpu.items():
            procs.ticks[PIDS[rank]] = procs.ticks.get(PIDS[rank], 0) + int(share * 0.5 * TICKS)
        stall = watch.poll(PIDS)
        if stall is not None:
            return stall
    return None


def _straggling(writers: list[ProgressWriter], k: int = 5) -> None:
    """Both ranks finished step k-1; rank 0 is late (in its own code), rank 1 waits in k."""
    for w in writers:
        w.enter(k - 1)
        w.leave(k - 1)
    writers[1].enter(k)


def test_a_stopped_rank_is_named_not_the_one_waiting_for_it(tmp_path: Path) -> None:
    for late in (0, 1):
        clock, procs, writers, watch = _group(tmp_path / str(late))
        for w in writers:
            w.enter(4)
            w.leave(4)
        writers[1 - late].enter(5)  # the other one waits in step 5's all-reduce
        procs.state[PIDS[late]] = "T"
        assert _run(clock, procs, watch, 14.5, {}) is None  # within the allowance
        stall = _run(clock, procs, watch, 2.0, {})
        assert stall is not None
        assert (stall.kind, stall.ranks, stall.k) == (STOPPED, (late,), 5)
        v = classify_attempt(stall, [])
        assert (v.kind, v.ranks, v.transient) == (VerdictKind.STALL, (late,), True)


def test_a_stopped_process_is_said_to_be_unable_to_answer_others_are_not() -> None:
    procs = Procs()
    procs.state.update({1000: "T", 1001: "t", 1002: "S", 1003: "R", 1004: "D", 1005: "Z"})
    reason = stopped_reason({r: 1000 + r for r in range(6)}, procs.read)
    assert [bool(reason(r)) for r in range(6)] == [True, True, False, False, False, False]
    assert reason(9) == ""  # no such rank: nothing said
    assert stopped_reason({0: 1000}, lambda pid: None)(0) == ""  # unreadable: not stopped


def test_a_rank_stopped_inside_the_collective_is_named_too(tmp_path: Path) -> None:
    clock, procs, writers, watch = _group(tmp_path)
    for w in writers:
        w.enter(3)  # both inside: a "collective" stall would name both
    procs.state[PIDS[0]] = "t"  # traced (a debugger)
    stall = _run(clock, procs, watch, 20.0, {})
    assert stall is not None and (stall.kind, stall.ranks) == (STOPPED, (0,))


def test_a_busy_rank_is_left_alone_until_the_busy_ceiling(tmp_path: Path) -> None:
    for busy_s, cpu in ((60.0, 1.0), (30.0, 0.3), (None, 0.5)):
        clock, procs, writers, watch = _group(tmp_path / f"{busy_s}-{cpu}", busy_s=busy_s)
        _straggling(writers)
        ceiling = busy_s if busy_s is not None else DEFAULT_BUSY_S
        assert _run(clock, procs, watch, ceiling - 1.0, {0: cpu, 1: 0.0}) is None
        stall = _run(clock, procs, watch, 3.0, {0: cpu, 1: 0.0})
        assert stall is not None
        assert (stall.kind, stall.ranks, stall.limit_s) == (BUSY, (0,), ceiling)
        assert classify_attempt(stall, []).kind is VerdictKind.STALL


def test_a_busy_rank_that_comes_back_is_no_fault(tmp_path: Path) -> None:
    clock, procs, writers, watch = _group(tmp_path, busy_s=100.0)
    _straggling(writers)
    assert _run(clock, procs, watch, 40.0, {0: 1.0}) is None  # validating: 40 s > 15 s
    writers[0].enter(5)
    writers[0].leave(5)
    writers[1].leave(5)
    # both back in their own code, working (40 s asleep with no progress would be a stall)
    assert _run(clock, procs, watch, 40.0, {0: 1.0, 1: 1.0}) is None


def test_a_rank_that_neither_runs_nor_progresses_is_a_stall_naming_it(tmp_path: Path) -> None:
    for cpu in (0.0, 0.05):  # asleep, or a trickle under the busy share
        clock, procs, writers, watch = _group(tmp_path / str(cpu))
        _straggling(writers)
        assert _run(clock, procs, watch, 14.5, {0: cpu}) is None
        stall = _run(clock, procs, watch, 2.0, {0: cpu})
        assert stall is not None
        assert (stall.kind, stall.ranks) == ("straggler", (0,))
        v = classify_attempt(stall, [])
        assert (v.kind, v.ranks) == (VerdictKind.STALL, (0,))


def test_without_process_readings_the_records_alone_judge(tmp_path: Path) -> None:
    clock, _, writers, watch = _group(tmp_path)
    _straggling(writers)
    assert watch.poll() is None  # the watcher's clock starts when it sees the records
    clock.now += 15.1
    stall = watch.poll()
    assert stall is not None and (stall.kind, stall.ranks) == ("straggler", (0,))


def test_a_collective_left_but_not_completed_on_the_device_still_holds(tmp_path: Path) -> None:
    """NCCL: both ranks left step 5 on the CPU (enqueued); rank 0's device completed it, rank
    1's never did. Without the device the two look done; with it rank 1 waits in 5."""
    clock, procs, writers, watch = _group(tmp_path)
    for w in writers:
        w.follow_device(0)
        for k in (4, 5):
            w.enter(k)
            w.leave(k)
    writers[0].device_done(5)
    writers[1].device_done(4)
    writers[0].enter(6)  # rank 0 goes on; rank 1 spins in a CUDA synchronisation
    assert watch.watcher.poll(clock.now) is None
    assert watch.watcher.done_on_device() == [5, 4]
    assert watch.watcher.device_behind(1) and not watch.watcher.device_behind(0)
    # rank 1's CPU burns (a spinning synchronisation) but it waits on its device: not busy
    stall = _run(clock, procs, watch, 20.0, {0: 0.0, 1: 1.0})
    assert stall is not None and stall.ranks == (1,)
    assert stall.kind == "straggler"


def test_device_progress_records_round_trip_and_old_records_read(tmp_path: Path) -> None:
    path = str(tmp_path / "r0")
    w = ProgressWriter(path)
    w.enter(1)
    w.device_done(1)  # not followed: a no-op
    rec = read_record(path)
    assert rec is not None and rec.dev == NOT_FOLLOWED
    w.follow_device(7)  # a resumed run: steps up to 7 are complete
    w.leave(8)
    rec = read_record(path)
    assert rec is not None and (rec.phase, rec.k, rec.dev) == ("collective_done", 8, 7)
    w.device_done(8)
    w.device_done(3)  # never backwards
    rec = read_record(path)
    assert rec is not None and (rec.phase, rec.k, rec.dev) == ("collective_done", 8, 8)
    old = b"5 collective 3 0 1.000000 0.000 0.000000 5".ljust(127) + b"\n"
    assert Record.decode(old) == Record(5, "collective", 3, 0, 1.0)
    w.close()


class Event:
    """A device event: completes when the test says (or fails, as a lost device does)."""

    def __init__(self, done: list[int], k: int, fail: bool = False) -> None:
        self.done, self.k, self.fail = done, k, fail

    def query(self) -> bool:
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.k in self.done


def test_the_device_poller_writes_what_the_device_completed(tmp_path: Path) -> None:
    path = str(tmp_path / "r0")
    w = ProgressWriter(path)
    done: list[int] = []
    made: list[int] = []

    def make() -> Event:
        made.append(len(made) + 1)
        return Event(done, made[-1])

    poller = DevicePoller(w, make, interval_s=3600.0)  # the test polls by hand
    for k in (1, 2, 3):
        w.leave(k)
        poller.record(k)
    assert poller.poll_once() is True
    rec = read_record(path)
    assert rec is not None and rec.dev == 0  # enqueued, nothing completed on the device
    done.extend([1, 2])
    assert poller.poll_once() is True  # 3 still pending
    rec = read_record(path)
    assert rec is not None and (rec.k, rec.dev) == (3, 2)
    done.append(3)
    assert poller.poll_once() is False
    rec = read_record(path)
    assert rec is not None and rec.dev == 3
    failing = DevicePoller(ProgressWriter(str(tmp_path / "r1")),
                           lambda: Event([], 0, fail=True), interval_s=3600.0)
    failing.record(1)
    assert failing.poll_once() is False and failing.failed is not None
    w.close()


def test_the_default_allowance_is_seconds_and_torchs_timeouts_sit_just_above() -> None:
    assert default_stall_timeout([]) == 15.0
    assert default_stall_timeout([0.05] * 500) == 15.0
    steps = [4.0] * 99 + [10.0]  # p99 is 4.0 (one outlier in a hundred)
    assert default_stall_timeout(steps) == 20.0
    assert default_stall_timeout([4.0] * 98 + [10.0, 10.0]) == 50.0
    got = torch_timeouts(None, {}, 300.0)
    assert got == {"RESILIENT_STRATEGY_PG_TIMEOUT": "660",
                   "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "720"}
    assert torch_timeouts(5.0, {}, 300.0, busy_s=100.0)["RESILIENT_STRATEGY_PG_TIMEOUT"] == "300"
    assert torch_timeouts(900.0, {}, 300.0, busy_s=100.0)["RESILIENT_STRATEGY_PG_TIMEOUT"] == "960"


def _rank_dump(rank: int, entries: list[tuple[int, str, list[int]]]) -> RankDump:
    import pickle

    data = pickle.dumps({"version": "2.4", "pg_config": {"0": {"ranks": "[0, 1]"}},
                         "entries": [{"record_id": s, "pg_id": 0, "process_group": ("0", ""),
                                      "collective_seq_id": s, "p2p_seq_id": 0, "op_id": s,
                                      "profiling_name": op, "time_created_ns": s,
                                      "input_sizes": [size], "output_sizes": [size],
                                      "state": "started", "frames": []}
                                     for s, op, size in entries]})
    return RankDump(rank, rank, DumpStatus.DUMPED, dump=parse_dump(data))


def test_diverged_only_when_the_recorders_show_different_collectives() -> None:
    same = [_rank_dump(0, [(1, "gloo:all_reduce", [18]), (2, "gloo:all_reduce", [18])]),
            _rank_dump(1, [(1, "gloo:all_reduce", [18])])]
    assert divergence(same) == ""  # rank 1 never arrived at #2: held up, not diverged
    other_op = [_rank_dump(0, [(1, "gloo:all_reduce", [18]), (2, "gloo:broadcast", [3])]),
                _rank_dump(1, [(1, "gloo:all_reduce", [18]), (2, "gloo:all_reduce", [18])])]
    assert "#2" in divergence(other_op)
    other_size = [_rank_dump(0, [(1, "gloo:all_reduce", [18])]),
                  _rank_dump(1, [(1, "gloo:all_reduce", [4])])]
    assert divergence(other_size) != ""
    v = classify_attempt(Stall("straggler", "collective", 2, (1,), 20.0, 15.0, ()), [])
    d = diverged(v, divergence(other_op))
    assert (d.kind, d.users, d.ranks, d.step) == (VerdictKind.DIVERGED, True, (1,), 2)


def test_readings_of_a_new_process_start_afresh_and_a_stopped_one_is_never_busy() -> None:
    procs = Procs()
    act = Activity(procs.read, TICKS)
    for i in range(12):  # rank 0 burns a CPU for 6 s
        procs.ticks[1000] = i * 50
        act.sample({0: 1000}, 100.0 + i * 0.5)
    assert act.busy(0) and act.cpu_share(0) == 1.0
    act.sample({0: 2000}, 106.5)  # the next attempt's process: one reading, nothing known
    assert act.cpu_share(0) is None and not act.busy(0)
    for i in range(12):
        procs.ticks[3000] = i * 50
        procs.state[3000] = "T" if i > 8 else "R"
        act.sample({0: 3000}, 110.0 + i * 0.5)
    assert act.state(0) is not None and act.state(0).stopped  # type: ignore[union-attr]
    assert not act.busy(0)


# ----- each rank judged by itself, nobody waiting on it (issue 45, item 1) -------------------


def _alone(tmp_path: Path, n: int = 1, trees: dict[int, int] | None = None
           ) -> tuple[Clock, Procs, list[ProgressWriter], TrainingWatch]:
    """``n`` ranks at the default allowance (15 s); ``trees``: each pid's tree ticks as the
    test sets them (None: a tree is its one process)."""
    clock, procs = Clock(), Procs()
    tmp_path.mkdir(parents=True, exist_ok=True)
    paths = [str(tmp_path / f"r{i}") for i in range(n)]
    writers = [ProgressWriter(p, clock=clock) for p in paths]

    def read_tree(pids: object) -> dict[int, int]:
        assert trees is not None
        return {p: trees.get(p, 0) for p in pids}  # type: ignore[attr-defined]

    act = Activity(procs.read, TICKS, read_tree=None if trees is None else read_tree)
    return clock, procs, writers, TrainingWatch(paths, None, clock, activity=act)


def _steps(clock: Clock, procs: Procs, writers: list[ProgressWriter], watch: TrainingWatch,
           steps: range, collective: bool = False) -> None:
    """Every rank does ``steps`` at 0.1 s each, busy (a CPU each), the watch polled after each."""
    for k in steps:
        clock.now += 0.1
        for r, w in enumerate(writers):
            procs.ticks[1000 + r] = procs.ticks.get(1000 + r, 0) + 10
            if collective:
                w.enter(k)
                w.leave(k)
            else:
                w.step(k)
        assert watch.poll({r: 1000 + r for r in range(len(writers))}) is None


def _wait(clock: Clock, procs: Procs, watch: TrainingWatch, seconds: float,
          cpu: dict[int, float], pids: dict[int, int]) -> Stall | None:
    for _ in range(int(seconds / 0.5)):
        clock.now += 0.5
        for pid, share in cpu.items():
            procs.ticks[pid] = procs.ticks.get(pid, 0) + int(share * 0.5 * TICKS)
        stall = watch.poll(pids)
        if stall is not None:
            return stall
    return None


def test_the_only_rank_stopped_between_steps_is_a_stall_at_the_allowance(
        tmp_path: Path) -> None:
    clock, procs, writers, watch = _alone(tmp_path)
    _steps(clock, procs, writers, watch, range(1, 13))
    procs.state[1000] = "T"  # kill -STOP: no peer waits on it, no record ever comes
    assert _wait(clock, procs, watch, 14.5, {}, {0: 1000}) is None
    stall = _wait(clock, procs, watch, 1.5, {}, {0: 1000})
    assert stall is not None
    assert (stall.kind, stall.ranks, stall.k, stall.alone, stall.limit_s) == (
        STOPPED, (0,), 12, True, 15.0)
    v = classify_attempt(stall, [])
    assert (v.kind, v.stall, v.ranks, v.step, v.transient) == (
        VerdictKind.STALL, STOPPED, (0,), 12, True)
    assert v.to_dict()["stall"] == STOPPED
    assert type(v).from_dict(v.to_dict()) == v


def test_a_stop_shorter_than_the_allowance_is_no_fault(tmp_path: Path) -> None:
    clock, procs, writers, watch = _alone(tmp_path)
    _steps(clock, procs, writers, watch, range(1, 13))
    procs.state[1000] = "T"
    assert _wait(clock, procs, watch, 10.0, {}, {0: 1000}) is None
    procs.state[1000] = "R"  # continued: it steps again
    _steps(clock, procs, writers, watch, range(13, 20))
    procs.state[1000] = "T"  # stopped again: the allowance counts afresh
    assert _wait(clock, procs, watch, 14.5, {}, {0: 1000}) is None


def test_the_only_rank_asleep_with_no_progress_is_a_stall_busy_never(tmp_path: Path) -> None:
    clock, procs, writers, watch = _alone(tmp_path / "asleep")
    _steps(clock, procs, writers, watch, range(1, 13))
    assert _wait(clock, procs, watch, 14.0, {}, {0: 1000}) is None
    stall = _wait(clock, procs, watch, 4.0, {}, {0: 1000})
    assert stall is not None and (stall.kind, stall.ranks, stall.alone) == (ASLEEP, (0,), True)
    assert classify_attempt(stall, []).stall == ASLEEP
    for share in (1.0, 0.3, 0.05):  # its own code: validation, a slow loader, a trickle
        clock, procs, writers, watch = _alone(tmp_path / f"busy{share}")
        _steps(clock, procs, writers, watch, range(1, 13))
        assert _wait(clock, procs, watch, 120.0, {1000: share}, {0: 1000}) is None


def test_a_rank_asleep_while_a_process_it_started_works_is_not_a_stall(tmp_path: Path) -> None:
    trees: dict[int, int] = {}
    clock, procs, writers, watch = _alone(tmp_path, trees=trees)
    _steps(clock, procs, writers, watch, range(1, 13))
    for _ in range(240):  # 120 s: the main process waits on its DataLoader worker's batch
        clock.now += 0.5
        trees[1000] = trees.get(1000, 0) + 50  # the worker burns a CPU
        assert watch.poll({0: 1000}) is None
    for _ in range(40):  # the worker is idle too now: asleep, a stall at the allowance
        clock.now += 0.5
        stall = watch.poll({0: 1000})
        if stall is not None:
            break
    assert stall is not None and (stall.kind, stall.ranks) == (ASLEEP, (0,))


def test_a_rank_is_not_judged_asleep_before_its_first_step_here(tmp_path: Path) -> None:
    clock, procs, writers, watch = _alone(tmp_path)
    writers[0].phase("comm_ready")  # loading its data, asleep on storage
    assert _wait(clock, procs, watch, 60.0, {}, {0: 1000}) is None
    writers[0].step(40)  # a resume's restored step: the first seen here
    assert _wait(clock, procs, watch, 60.0, {}, {0: 1000}) is None
    procs.state[1000] = "T"  # stopped is stopped, wherever it is
    assert _wait(clock, procs, watch, 16.0, {}, {0: 1000}) is not None


def test_a_rank_stopped_after_its_last_step_is_caught_in_the_teardown(tmp_path: Path) -> None:
    """2 ranks past their last step: rank 0 waits in the teardown's barrier (asleep, a
    collective the records do not mark), rank 1 is stopped: rank 1 is named, before any
    process-group timeout."""
    clock, procs, writers, watch = _alone(tmp_path, n=2)
    _steps(clock, procs, writers, watch, range(1, 21), collective=True)
    procs.state[1001] = "T"
    pids = {0: 1000, 1: 1001}
    assert _wait(clock, procs, watch, 14.5, {}, pids) is None
    stall = _wait(clock, procs, watch, 2.0, {}, pids)
    assert stall is not None and (stall.kind, stall.ranks, stall.k) == (STOPPED, (1,), 20)
    # rank 1 wrote "finished" and was stopped in its exit: every record says finished
    clock, procs, writers, watch = _alone(tmp_path / "finished", n=2)
    _steps(clock, procs, writers, watch, range(1, 21), collective=True)
    for w in writers:
        w.phase("finished", 20)
    procs.state[1001] = "T"
    assert _wait(clock, procs, watch, 16.0, {}, pids) is not None


def test_a_rank_waiting_on_a_busy_peer_outside_the_marked_steps_is_not_hung(
        tmp_path: Path) -> None:
    """Rank 0 validates (busy, its own code) while rank 1 waits in the script's own barrier
    (asleep, no record): busy is not hung, for either, until the busy ceiling's peers
    judge."""
    clock, procs, writers, watch = _alone(tmp_path, n=2)
    _steps(clock, procs, writers, watch, range(1, 13), collective=True)
    assert _wait(clock, procs, watch, 120.0, {1000: 1.0}, {0: 1000, 1: 1001}) is None
    # then both asleep (a lock both wait on): every rank idle, a stall naming both
    stall = _wait(clock, procs, watch, 20.0, {}, {0: 1000, 1: 1001})
    assert stall is not None and (stall.kind, stall.ranks) == (ASLEEP, (0, 1))


def test_a_tree_of_processes_is_summed_from_their_parents() -> None:
    from resilient_strategy.machine.procs import sum_tree

    stats = [ProcStat(10, "S", 5, 1), ProcStat(11, "R", 100, 10), ProcStat(12, "S", 7, 11),
             ProcStat(20, "S", 3, 1), ProcStat(13, "Z", 0, 10)]
    assert sum_tree([10, 20, 99], stats) == {10: 112, 20: 3}
    looped = [ProcStat(1, "S", 1, 2), ProcStat(2, "S", 1, 1)]  # never, but never forever
    assert sum_tree([1], looped) == {1: 2}
