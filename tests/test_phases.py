"""The phases of an attempt (records/phases.py): the marks each writer leaves, the typed timeline
the supervisor reads back into attempts.json, the reporter's marks from the training calls, and
the stacks wait that ends when every rank's file is written (run/agent.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import deadline

from resilient_strategy.records import phases
from resilient_strategy.records.handoff import TrainingReporter
from resilient_strategy.records.progress import ProgressWriter
from resilient_strategy.records.rundir import RunDir
from resilient_strategy.run.agent import dump_stacks, stop_stopped
from resilient_strategy.run.exitcodes import ExitCode
from resilient_strategy.run.policy import Action, Attempt, Judgement
from resilient_strategy.run.verdicts import Verdict, VerdictKind


def test_a_mark_is_written_once_and_read_back(tmp_path: Path) -> None:
    path = RunDir.of(tmp_path).supervisor_phases
    phases.mark(path, phases.AGENT_STARTED, 10.0)
    phases.mark(path, phases.AGENT_STARTED, 20.0)  # reached again: the first time stays
    phases.mark(path, phases.FAULT_SEEN, 12.5)
    assert phases.read_marks(path) == {phases.AGENT_STARTED: 10.0, phases.FAULT_SEEN: 12.5}


def test_unreadable_or_foreign_marks_read_as_empty_or_numbers_only(tmp_path: Path) -> None:
    assert phases.read_marks(tmp_path / "absent.json") == {}
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert phases.read_marks(bad) == {}
    mixed = tmp_path / "mixed.json"
    mixed.write_text(json.dumps({"a": 1.5, "b": "x", "c": True, "d": 3}))
    assert phases.read_marks(mixed) == {"a": 1.5, "d": 3.0}


def test_a_mark_that_cannot_be_written_is_lost_not_raised(tmp_path: Path) -> None:
    phases.mark(tmp_path / "no" / "such" / "dir.json", phases.VERDICT)  # no raise
    assert not (tmp_path / "no").exists()  # and nothing made on the way
    assert phases.Timeline.read(tmp_path / "no" / "such", 1).supervisor == {}


def test_timeline_reads_the_supervisor_and_every_rank(tmp_path: Path) -> None:
    phases.mark(RunDir.of(tmp_path).supervisor_phases, phases.WORKERS_STARTED, 1.0)
    phases.mark(RunDir.of(tmp_path).phases(0), phases.FIRST_STEP, 5.0)
    phases.mark(RunDir.of(tmp_path).phases(1), phases.FIRST_STEP, 6.0)
    t = phases.Timeline.read(tmp_path, 2)
    assert t.supervisor == {phases.WORKERS_STARTED: 1.0}
    assert t.last(phases.FIRST_STEP) == 6.0
    assert t.last(phases.COMM_READY) is None  # no rank reached it
    assert phases.Timeline.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    assert phases.Timeline.read(tmp_path, 3).last(phases.FIRST_STEP) is None  # rank 2 never


def test_an_attempt_record_carries_its_timeline(tmp_path: Path) -> None:
    phases.mark(RunDir.of(tmp_path).supervisor_phases, phases.VERDICT, 3.0)
    attempt = Attempt(0, "torch:gloo:cpu", "gloo", Verdict(VerdictKind.EXIT, "rank 1 exited"),
                      Judgement(Action.RETRY, "once", None), None,
                      phases.Timeline.read(tmp_path, 1))
    d = json.loads(json.dumps(attempt.to_dict()))
    assert d["times"] == {"supervisor": {phases.VERDICT: 3.0}, "ranks": [{}]}
    assert Attempt(0, "k", "l", Verdict(VerdictKind.OK, ""),
                   Judgement(Action.STOP, "done", ExitCode.SUCCESS)).to_dict()["times"] is None


def test_the_reporter_marks_setup_restore_and_the_first_step_in_order(tmp_path: Path) -> None:
    path = RunDir.of(tmp_path).phases(0)
    rep = TrainingReporter(ProgressWriter(str(tmp_path / "rank0.progress")), rank=0,
                           backend="gloo", collective=True, phases=str(path))
    assert list(phases.read_marks(path)) == [phases.REPORTING]
    rep.setup_begin()
    rep.setup_end()
    rep.restored(15)
    for _ in range(3):
        rep.backward_begin(True)
        rep.backward_end(True)
        rep.stepped(True)
    marks = phases.read_marks(path)
    assert list(marks) == [phases.REPORTING, phases.COMM_READY, phases.RESTORED,
                           phases.FIRST_STEP]
    assert sorted(marks.values()) == list(marks.values())
    assert rep.step == 18


def test_a_running_total_is_rewritten_and_the_timeline_takes_the_largest_rank(
        tmp_path: Path) -> None:
    path = RunDir.of(tmp_path).phases(0)
    phases.mark(path, phases.FIRST_STEP, 5.0)
    phases.note(path, phases.CHECKPOINT_STALL, 0.5)
    phases.note(path, phases.CHECKPOINT_STALL, 1.25)  # a total: the newest value stands
    phases.note(RunDir.of(tmp_path).phases(1), phases.CHECKPOINT_STALL, 0.25)
    assert phases.read_marks(path) == {phases.FIRST_STEP: 5.0, phases.CHECKPOINT_STALL: 1.25}
    t = phases.Timeline.read(tmp_path, 3)  # rank 2 noted none
    assert t.most(phases.CHECKPOINT_STALL) == 1.25 and t.last(phases.FIRST_STEP) is None
    assert phases.Timeline().most(phases.CHECKPOINT_STALL) == 0.0
    assert phases.Timeline.from_dict(json.loads(json.dumps(t.to_dict()))) == t


def test_the_reporter_notes_the_checkpoint_stall_after_the_first_step_only(
        tmp_path: Path) -> None:
    """The saves of the first step fall before its mark (start-up); each later save's stall is
    noted once, when the checkpointer's total grew, as a total since the first step."""
    path = RunDir.of(tmp_path).phases(0)
    rep = TrainingReporter(ProgressWriter(str(tmp_path / "rank0.progress")), rank=0,
                           backend="cpu", collective=False, phases=str(path))
    totals = [0.5, 0.5, 0.75, 0.75, 1.5]  # the checkpointer's stall_s at steps 1..5
    noted = []
    for total in totals:
        rep.checkpoint_stalled(total)
        rep.stepped(True)
        noted.append(phases.read_marks(path).get(phases.CHECKPOINT_STALL))
    assert noted == [None, None, 0.25, 0.25, 1.0]
    assert phases.CHECKPOINT_STALL in phases.WORKER_TOTALS
    assert phases.CHECKPOINT_STALL not in phases.WORKER_PHASES  # seconds, not a wall time


def test_a_reporter_without_a_phases_file_marks_nothing(tmp_path: Path) -> None:
    rep = TrainingReporter(ProgressWriter(str(tmp_path / "rank0.progress")), rank=0,
                           backend="cpu", collective=False)
    rep.stepped(True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.progress"]


_STACKS_CHILD = """
import faulthandler, signal, sys, time
fh = open(sys.argv[1], "w")
faulthandler.register(signal.SIGUSR1, file=fh, all_threads=True, chain=False)
print("ready", flush=True)
time.sleep(60)
"""


@contextlib.contextmanager
def _stack_ranks(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    """Two processes that write their stacks on SIGUSR1, ready; killed (continued first) after."""
    procs = [subprocess.Popen([sys.executable, "-c", _STACKS_CHILD,
                               str(tmp_path / f"rank{lr}.stacks.txt")], stdout=subprocess.PIPE,
                              text=True) for lr in range(2)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait(timeout=deadline(30))
            if p.stdout is not None:
                p.stdout.close()


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1")
def test_the_stacks_wait_ends_when_every_rank_has_written(tmp_path: Path) -> None:
    with _stack_ranks(tmp_path) as procs:
        missing = dump_stacks({lr: p.pid for lr, p in enumerate(procs)}, tmp_path, wait_s=30.0)
        assert missing == []
        for lr in range(2):
            assert "<module>" in (tmp_path / f"rank{lr}.stacks.txt").read_text()


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1")
def test_a_rank_whose_stacks_never_come_is_named_after_the_bound(tmp_path: Path) -> None:
    # a process that ignores SIGUSR1 writes nothing: the wait ends at its bound and names it
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                              "signal.signal(signal.SIGUSR1, signal.SIG_IGN); print('ready', "
                              "flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert dump_stacks({3: child.pid}, tmp_path, wait_s=0.2) == [3]
    finally:
        child.kill()
        child.wait(timeout=deadline(30))
        if child.stdout is not None:
            child.stdout.close()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=deadline(30))
    assert dump_stacks({0: gone.pid}, tmp_path, wait_s=30.0) == []


def test_the_rendezvous_names_its_records_as_inspect_would() -> None:
    import inspect

    from resilient_strategy.run import agent

    agent._cheap_method_names()
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    def via_inspect() -> str:
        return inspect.stack()[2].function

    def recorder(fn: object) -> str:  # as _record calls it: the caller of the caller
        return fn()  # type: ignore[operator,no-any-return]

    def caller_a() -> str:
        return recorder(via_inspect)

    def caller_b() -> str:
        return recorder(dr.get_method_name)

    assert dr.get_method_name is agent._method_name
    assert caller_a() == "caller_a"
    assert caller_b() == "caller_b"


def _seen_stopped(pid: int) -> None:
    from resilient_strategy.machine.procs import read_stat

    for _ in range(1000):  # the kernel stops it within microseconds; bounded all the same
        got = read_stat(pid)
        if got is not None and got.stopped:
            return
        time.sleep(0.01)
    raise AssertionError(f"{pid} never seen stopped")


def _pending(pid: int) -> int:
    """The signals pending for the whole process (``ShdPnd`` of ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            return int(line.split()[1], 16)
    raise AssertionError("no ShdPnd line")


@pytest.mark.skipif(not Path("/proc/self/status").exists() or not hasattr(signal, "SIGUSR1"),
                    reason="Linux /proc")
def test_a_stopped_rank_is_not_asked_for_its_stacks_and_is_killed_at_once(
        tmp_path: Path) -> None:
    """Two ranks that write their stacks on SIGUSR1; rank 1 is SIGSTOPped (a real signal):
    rank 0's stacks come, rank 1 is neither asked (no SIGUSR1 pending in its
    ``/proc/<pid>/status``) nor waited for (not listed as late), then `stop_stopped` SIGKILLs
    rank 1 alone, at once (its exit is SIGKILL's, not a SIGTERM it would have held pending)."""
    with _stack_ranks(tmp_path) as procs:
        os.kill(procs[1].pid, signal.SIGSTOP)
        _seen_stopped(procs[1].pid)
        pids = {lr: p.pid for lr, p in enumerate(procs)}
        assert dump_stacks(pids, tmp_path, wait_s=20.0) == []
        assert "<module>" in (tmp_path / "rank0.stacks.txt").read_text()
        assert _pending(procs[1].pid) & (1 << (signal.SIGUSR1 - 1)) == 0
        assert stop_stopped(pids) == [1]
        assert procs[1].wait(timeout=deadline(30)) == -signal.SIGKILL
        assert procs[0].poll() is None  # the running one is left to the agent's SIGTERM
        os.kill(procs[0].pid, signal.SIGSTOP)  # the check itself, on a signal sent now
        _seen_stopped(procs[0].pid)
        os.kill(procs[0].pid, signal.SIGUSR1)
        assert _pending(procs[0].pid) & (1 << (signal.SIGUSR1 - 1))

