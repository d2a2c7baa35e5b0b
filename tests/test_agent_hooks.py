"""The hooks of run/agent.py taken alone: the stop of an attempt's group (a stopped rank is
SIGKILLed at once, `prepare_stop`, through the agent's ``_shutdown``), the monitoring loop's own
checks (`AttemptMonitor`, torch-free, with fakes), and the small pure decisions around torch's
agent (`stop_grace`, `finished_without_values`)."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline
from test_phases import _seen_stopped

from resilient_strategy.records import phases
from resilient_strategy.records.progress import COLLECTIVE, Stall
from resilient_strategy.records.rundir import RunDir
from resilient_strategy.run.agent import (
    AttemptMonitor,
    finished_without_values,
    prepare_stop,
    stop_grace,
)
from resilient_strategy.run.verdicts import PeerFault, Verdict, VerdictKind

linux_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc")


@contextmanager
def _two_ranks() -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    """Two rank processes (``sleep``); the second SIGSTOPped (a real signal, seen stopped)."""
    running = subprocess.Popen(["sleep", "600"])
    stopped = subprocess.Popen(["sleep", "600"])
    try:
        stopped.send_signal(signal.SIGSTOP)
        _seen_stopped(stopped.pid)
        yield running, stopped
    finally:
        for p in (running, stopped):
            p.kill()
            p.wait(timeout=deadline(30))


@linux_proc
def test_prepare_stop_kills_a_stopped_rank_at_once_and_leaves_a_running_one() -> None:
    """A stopped rank would hold a SIGTERM pending for the whole grace: it is SIGKILLed (its
    exit is SIGKILL's); a running rank is left to the agent's SIGTERM (still running)."""
    with _two_ranks() as (running, stopped):
        assert prepare_stop({0: running.pid, 1: stopped.pid}) == [1]
        assert stopped.wait(timeout=deadline(10)) == -signal.SIGKILL
        assert running.poll() is None


class _Context:
    """torch's process context as the agent's ``_shutdown`` reads it: each local rank's pid."""

    def __init__(self, pids: Mapping[int, int]) -> None:
        self._pids = dict(pids)

    def pids(self) -> dict[int, int]:
        return dict(self._pids)


@pytest.mark.torch
@linux_proc
def test_when_the_group_stops_a_stopped_rank_is_sigkilled_before_torchs_sigterm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's stop of its group (``_shutdown``): before torch's own stop (SIGTERM, then
    the grace), a rank whose process is stopped is already SIGKILLed (a SIGTERM would never be
    delivered to it), and a running rank is still there for torch's SIGTERM."""
    pytest.importorskip("torch")
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from resilient_strategy.run.agent import _agent_class

    cls = _agent_class()
    with _two_ranks() as (running, stopped):
        seen: list[tuple[int | None, int | None, dict[str, object]]] = []

        def torch_shutdown(self: object, *args: object, **kwargs: object) -> None:
            # what torch's stop finds when it begins: the stopped rank gone (SIGKILL's exit)
            seen.append((stopped.wait(timeout=deadline(10)), running.poll(), kwargs))

        monkeypatch.setattr(LocalElasticAgent, "_shutdown", torch_shutdown)
        agent = cls.__new__(cls)
        agent._pcontext = _Context({0: running.pid, 1: stopped.pid})
        agent._shutdown_timeout = 3
        agent._shutdown()
        assert [(code, poll) for code, poll, _ in seen] == [(-signal.SIGKILL, None)]


def test_the_configured_grace_is_added_only_when_torch_gave_none() -> None:
    assert stop_grace((), {}, True, 3) == {"timeout": 3}
    assert stop_grace((signal.SIGTERM, 30), {}, True, 3) == {}
    assert stop_grace((), {"timeout": 7}, True, 3) == {"timeout": 7}
    assert stop_grace((), {}, False, 3) == {}  # torch 2.11's _shutdown has no timeout


def test_forked_workers_that_exited_0_without_a_value_are_done_only_when_all_are() -> None:
    assert finished_without_values([0, 0], {1})  # rank 0 os._exit(0), rank 1 returned
    assert not finished_without_values([0, None], set())  # rank 1 still running
    assert not finished_without_values([0, 0], {0, 1})  # every value handed back: torch's
    assert not finished_without_values([None, None], {0, 1})


class _Watch:
    def __init__(self, stalls: list[Stall | None]) -> None:
        self.stalls = stalls
        self.asked: list[dict[int, int]] = []

    def poll(self, pids: Mapping[int, int]) -> Stall | None:
        self.asked.append(dict(pids))
        return self.stalls.pop(0) if self.stalls else None


class _Peer:
    def __init__(self, faults: list[PeerFault | None]) -> None:
        self.faults = faults
        self.polls = 0

    def poll(self) -> PeerFault | None:
        self.polls += 1
        return self.faults.pop(0) if self.faults else None


def _stall() -> Stall:
    return Stall("collective", COLLECTIVE, 3, (1,), 9.0, 5.0, (COLLECTIVE, COLLECTIVE))


def _monitor(tmp_path: Path | None, watch: _Watch, peer: _Peer | None = None,
             switch: Any = None) -> AttemptMonitor:
    return AttemptMonitor(watch, peer, tmp_path, 2, switch)  # type: ignore[arg-type]


def test_a_rank_error_record_is_acted_on_once(tmp_path: Path) -> None:
    monitor = _monitor(tmp_path, _Watch([]))
    assert not monitor.raised_now()
    RunDir(tmp_path).error(1).write_text("{}")
    assert monitor.raised_now() and monitor.raised == 1
    assert not monitor.raised_now()  # seen: not again
    assert phases.FAULT_SEEN in phases.read_marks(RunDir(tmp_path).supervisor_phases)


def test_a_stall_stops_the_group_with_its_evidence_before_switch_or_peer(tmp_path: Path) -> None:
    asked: list[str] = []
    peer = _Peer([])
    watch = _Watch([None, _stall()])
    monitor = _monitor(tmp_path, watch, peer, switch=lambda: asked.append("switch") or None)
    assert not monitor.healthy_checks(dict, [])  # healthy: every check asked once
    assert (asked, peer.polls) == (["switch"], 1)
    assert monitor.healthy_checks(dict, [])  # the stall: neither switch nor peer asked
    assert (asked, peer.polls) == (["switch"], 1)
    assert monitor.stall == _stall() and monitor.stall_at != float("inf")
    marks = phases.read_marks(RunDir(tmp_path).supervisor_phases)
    assert marks[phases.FAULT_SEEN] == monitor.stall_at and phases.EVIDENCE_TAKEN in marks
    assert not monitor.switch_due()  # never a switch after a fault
    assert not monitor.stalled(dict, [])  # one stall per attempt


def test_a_measured_switch_is_taken_once_and_never_after_a_rank_raised(tmp_path: Path) -> None:
    monitor = _monitor(None, _Watch([]), switch=lambda: 40)
    assert monitor.switch_due() and monitor.switched == 40
    assert not monitor.switch_due()
    raised = _monitor(tmp_path, _Watch([]), switch=lambda: 40)
    RunDir(tmp_path).error(0).write_text("{}")
    assert raised.raised_now()
    assert not raised.switch_due() and raised.switched is None


def test_another_nodes_fault_stops_the_group_once() -> None:
    fault = PeerFault(1, "torch:gloo:cpu", Verdict(VerdictKind.EXIT, "a rank left", node=1))
    peer = _Peer([None, fault])
    monitor = _monitor(None, _Watch([]), peer)
    assert not monitor.peer_failed()
    assert monitor.peer_failed() and monitor.peer_fault == fault
    assert not monitor.peer_failed() and peer.polls == 2  # not asked again


def test_the_started_ranks_are_kept_for_the_sweep(tmp_path: Path) -> None:
    monitor = _monitor(tmp_path, _Watch([]))
    monitor.started({0: 101, 1: 102})
    assert monitor.rank_pids == {101, 102}
    assert phases.WORKERS_STARTED in phases.read_marks(RunDir(tmp_path).supervisor_phases)
