"""torch's flight recorder in a stall's evidence (issue 20, item 4): the parser on dumps built as
torch writes them (torch/csrc/distributed/c10d/FlightRecorder.hpp), the analysis that names the
stuck collective and the ranks that never entered it, and the worker's answer to the
supervisor's request over a FIFO (a fake dump API: no torch, no process group), with every
outcome typed and the wait bounded."""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from resilient_strategy.records import flight
from resilient_strategy.records.flight import read_answer, request, respond, serve
from resilient_strategy.records.flightdump import (
    DumpStatus,
    FlightFacts,
    RankDump,
    analyse,
    merge_dumps,
    parse_dump,
)
from resilient_strategy.records.rundir import RunDir
from resilient_strategy.run.verdicts import Verdict, VerdictKind

posix_only = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")


def _entry(seq: int, state: str, op: str = "nccl:all_reduce", pg: str = "0", pg_id: int = 0,
           frames: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One entry with the keys torch's recorder writes (FlightRecorder.hpp, dump version 2.x)."""
    return {"record_id": seq - 1, "pg_id": pg_id, "process_group": (pg, "default_pg"),
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": op,
            "time_created_ns": 1_000 * seq, "input_sizes": [[1024]], "input_dtypes": ["Float"],
            "output_sizes": [[1024]], "output_dtypes": ["Float"], "state": state,
            "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
            "retired": state == "completed", "timeout_ms": 600_000, "is_p2p": False,
            "frames": frames or []}


USER = [{"name": "all_reduce", "filename": "/x/site-packages/torch/distributed/c10d.py",
         "line": 10},
        {"name": "main", "filename": "/home/me/train.py", "line": 42}]


def _dump(entries: list[dict[str, Any]], completed: int | None, ranks: str = "[0, 1]") -> bytes:
    d: dict[str, Any] = {"version": "2.4", "pg_config": {"0": {"name": "0", "desc": "default_pg",
                                                              "ranks": ranks}},
                         "entries": entries}
    if completed is not None:
        d["pg_status"] = {"0": {"last_enqueued_collective": max(
            (e["collective_seq_id"] for e in entries), default=0),
            "last_started_collective": -1, "last_completed_collective": completed}}
    return pickle.dumps(d, protocol=2)  # torch's pickler writes protocol 2


def _dumped(rank: int, data: bytes) -> RankDump:
    return RankDump(rank, rank, DumpStatus.DUMPED, dump=parse_dump(data))


def test_the_stuck_collective_and_the_rank_that_never_entered_it() -> None:
    """Rank 0 waits in all-reduce #5 (issued, never completed); rank 1 completed #4 and never
    issued #5 (it hung in its own code): #5 is stuck, rank 1 never entered it."""
    r0 = _dump([_entry(s, "completed") for s in range(1, 5)]
               + [_entry(5, "started", frames=USER), _entry(6, "scheduled")], completed=4,
               ranks="[0, 1, 2, 3]")
    r1 = _dump([_entry(s, "completed") for s in range(1, 5)], completed=4, ranks="[0, 1, 2, 3]")
    facts = analyse([_dumped(0, r0), _dumped(1, r1)])
    assert facts.stuck is not None and facts.last is None
    assert (facts.stuck.op, facts.stuck.seq, facts.stuck.group) == ("nccl:all_reduce", 5, "0")
    assert (facts.stuck.entered, facts.stuck.missing) == ((0,), (1,))
    assert facts.stuck.not_dumped == (2, 3)  # the group's other members: another node
    assert facts.stuck.where == "/home/me/train.py:42 in main"
    assert facts.stuck.sizes == ((1024,),)
    # states alone (no pg_status, as before torch 2.4) say the same
    r0_old = _dump([_entry(s, "completed") for s in range(1, 5)] + [_entry(5, "scheduled")],
                   completed=None)
    r1_old = _dump([_entry(s, "completed") for s in range(1, 5)], completed=None)
    old = analyse([_dumped(0, r0_old), _dumped(1, r1_old)]).stuck
    assert old is not None and (old.seq, old.entered, old.missing) == (5, (0,), (1,))


def test_a_rank_whose_completion_record_lags_is_not_taken_for_stuck() -> None:
    """Seen once in CI under load (gloo, rank 1 hung before its step's all-reduce): rank 1's
    ``last_completed_collective`` still said 3 though rank 0 had completed #4 and waited in #5;
    the analysis named #4 "entered by 0 and 1, never completed". #5 is stuck, rank 1 missing."""
    r0 = _dump([_entry(s, "scheduled", op="gloo:all_reduce") for s in range(1, 6)], 4)
    r1 = _dump([_entry(s, "scheduled", op="gloo:all_reduce") for s in range(1, 5)], 3)
    stuck = analyse([_dumped(0, r0), _dumped(1, r1)]).stuck
    assert stuck is not None
    assert (stuck.op, stuck.seq, stuck.entered, stuck.missing) == ("gloo:all_reduce", 5, (0,), (1,))


def test_every_rank_in_it_none_missing_and_a_rank_without_a_dump() -> None:
    both = [_entry(s, "completed") for s in range(1, 3)] + [_entry(3, "started")]
    facts = analyse([_dumped(0, _dump(both, 2)), _dumped(1, _dump(both, 2)),
                     RankDump(2, 2, DumpStatus.NO_ANSWER)])
    assert facts.stuck is not None
    assert (facts.stuck.seq, facts.stuck.entered, facts.stuck.missing,
            facts.stuck.not_dumped) == (3, (0, 1), (), (2,))


def test_nothing_in_flight_names_the_last_completed_collective() -> None:
    """gloo's recorder leaves every state "scheduled": pg_status says what completed."""
    done = [_entry(s, "scheduled", op="gloo:all_reduce") for s in range(1, 8)]
    facts = analyse([_dumped(0, _dump(done, 7))])
    assert facts.stuck is None and facts.last is not None
    assert (facts.last.op, facts.last.seq) == ("gloo:all_reduce", 7)


def _gloo_dump(groups: list[tuple[str, str, int, int, int]], slot_ranks: str) -> bytes:
    """A dump in the shape torch 2.13's gloo writes (measured: ``_dump_fr_trace()`` of a 4-rank
    gloo job, TORCH_FR_BUFFER_SIZE set): version "2.10"; pg_config's one slot keyed "", name and
    desc "", with the ranks of the group made last ("[]" for a new_group) while the entries say
    process_group ("0", "default_pg"), pg_id 0; pg_status keyed by pg_id; every state
    "scheduled". ``groups``: (name, desc, pg_id, seqs entered, last completed)."""
    entries: list[dict[str, Any]] = []
    for name, desc, pg_id, seqs, _ in groups:
        for s in range(1, seqs + 1):
            e = _entry(s, "scheduled", op="gloo:all_reduce", pg=name, pg_id=pg_id)
            e.update(process_group=(name, desc), input_sizes=[[4]], output_sizes=[[4]])
            entries.append(e)
    return pickle.dumps({"version": "2.10", "comm_lib_version": "",
                         "pg_config": {"": {"name": "", "desc": "", "ranks": slot_ranks}},
                         "pg_status": {str(pg_id): {"last_enqueued_collective": seqs,
                                                    "last_started_collective": -1,
                                                    "last_completed_collective": done}
                                       for _, _, pg_id, seqs, done in groups},
                         "entries": entries}, protocol=2)


def test_a_gloo_dumps_default_group_spans_the_job_its_other_nodes_not_dumped() -> None:
    """Issue 44: torch 2.13's gloo keys pg_config "" (no name, no desc) while its entries say
    group "0": nothing in the dump names the group's members, so ranks 2 and 3 (another node)
    went unlisted. The default group is the job's: with the job's 4 ranks, they are named."""
    dump = _gloo_dump([("0", "default_pg", 0, 4, 3)], "[0, 1, 2, 3]")
    assert "0" not in parse_dump(dump).members  # the unnamed slot is not guessed to be "0"
    here = [_dumped(0, dump), _dumped(1, dump)]
    facts = analyse(here, world=4)
    assert facts.stuck is not None
    assert (facts.stuck.group, facts.stuck.seq, facts.stuck.entered, facts.stuck.missing,
            facts.stuck.not_dumped) == ("0", 4, (0, 1), (), (2, 3))
    unknown = analyse(here).stuck  # the job's ranks not known: none named
    assert unknown is not None and unknown.not_dumped == ()


def test_a_gloo_subgroup_is_given_no_members_it_does_not_record() -> None:
    """A subgroup (desc "undefined", pg_id 1) stuck under gloo: pg_config's slot says "[]" and
    names no group, and the job's ranks are not the subgroup's: no member is invented."""
    dump = _gloo_dump([("0", "default_pg", 0, 2, 2), ("1", "undefined", 1, 2, 1)], "[]")
    facts = analyse([_dumped(0, dump)], world=4)
    assert facts.stuck is not None
    assert (facts.stuck.group, facts.stuck.seq, facts.stuck.not_dumped) == ("1", 2, ())


def _configured(config: dict[str, Any], groups: list[tuple[str, str, int]]) -> dict[str, Any]:
    entries = []
    for name, desc, pg_id in groups:
        e = _entry(1, "started", pg=name, pg_id=pg_id)
        e["process_group"] = (name, desc)
        entries.append(e)
    return dict(parse_dump(pickle.dumps({"version": "2.4", "pg_config": config,
                                         "entries": entries}, protocol=2)).members)


def test_pg_config_is_matched_to_the_entries_group_by_key_name_desc_or_pg_id() -> None:
    """torch's analyser (flight_recorder/components/builder.py) looks a group up by the key its
    entries name; a slot under another key is the group's by its name, else its desc, else the
    entries' pg_id, only when that names one slot and one group."""
    slot = {"name": "", "desc": "", "ranks": "[0, 5]"}
    assert _configured({"0": slot}, [("0", "default_pg", 0)])["0"] == (0, 5)  # by key
    assert _configured({"h": {**slot, "name": "a"}}, [("a", "x", 3)])["a"] == (0, 5)
    assert _configured({"h": {**slot, "desc": "tp"}}, [("a", "tp", 3)])["a"] == (0, 5)
    assert _configured({"3": slot}, [("a", "x", 3)])["a"] == (0, 5)  # by pg_id
    # never a guess: two groups of one desc, two slots of one name, one slot claimed twice
    assert "a" not in _configured({"h": {**slot, "desc": "tp"}},
                                  [("a", "tp", 3), ("b", "tp", 4)])
    assert "a" not in _configured({"h": {**slot, "name": "a"}, "k": {**slot, "name": "a"}},
                                  [("a", "x", 3)])
    two = _configured({"3": {**slot, "name": "b"}}, [("a", "x", 3), ("b", "y", 4)])
    assert "a" not in two and "b" not in two
    # a slot with no ranks ("[]") names nobody
    assert "a" not in _configured({"h": {**slot, "name": "a", "ranks": "[]"}}, [("a", "x", 3)])


def test_the_first_dump_format_a_list_and_two_apis_merged() -> None:
    listed = pickle.dumps([_entry(1, "completed"), _entry(2, "scheduled")], protocol=2)
    d = parse_dump(listed)
    assert [e.seq for e in d.entries] == [1, 2] and d.completed == {}
    merged = merge_dumps([d, parse_dump(_dump([_entry(1, "completed")], 1))])
    assert [e.seq for e in merged.entries] == [1, 2] and merged.completed == {"0": 1}


@pytest.mark.parametrize("data", [b"", b"not a pickle", pickle.dumps({"entries": 3}),
                                  pickle.dumps(Path("/etc/passwd")),  # names a global
                                  pickle.dumps({"entries": [SimpleNamespace()]})])
def test_anything_else_is_refused_never_loaded(data: bytes) -> None:
    with pytest.raises(ValueError):
        parse_dump(data)


def test_the_buffer_variable_for_nccl_only_never_over_the_users() -> None:
    assert flight.buffer_env("nccl", {}) == {flight.BUFFER_VAR: str(flight.DEFAULT_ENTRIES)}
    assert flight.buffer_env("nccl", {}, "2.13.0+cpu") == {
        flight.FR_BUFFER_VAR: str(flight.DEFAULT_ENTRIES)}
    assert flight.buffer_env("nccl", {}, "2.7.1") == {flight.BUFFER_VAR: str(flight.DEFAULT_ENTRIES)}
    assert flight.buffer_env("nccl", {flight.BUFFER_VAR: "5"}, "2.13.0") == {}  # the user's stands
    assert [flight.buffer_var(v) for v in ("2.8.0", "3.0", "2.10.0a0", "2.2.2", "unknown", None)] \
        == [flight.FR_BUFFER_VAR] * 3 + [flight.BUFFER_VAR] * 3
    assert flight.buffer_env("gloo", {}) == {}
    assert flight.buffer_env("nccl", {flight.BUFFER_VAR: "0"}) == {}
    assert flight.buffer_env("nccl", {flight.FR_BUFFER_VAR: "10"}) == {}


class _Api:
    """A stand-in for torch._C._distributed_c10d with the dump APIs given."""

    def __init__(self, **apis: Any) -> None:
        for name, fn in apis.items():
            setattr(self, name, fn)


def test_a_worker_without_a_dump_api_or_whose_api_fails_answers_not_available(
        tmp_path: Path) -> None:
    respond(tmp_path, 0, 0, _Api())
    none = read_answer(tmp_path, 0, 0)
    assert none.status is DumpStatus.NOT_AVAILABLE and none.dump is None

    def boom() -> bytes:
        raise RuntimeError("no recorder")

    respond(tmp_path, 1, 1, _Api(_dump_nccl_trace=boom))
    failed = read_answer(tmp_path, 1, 1)
    assert failed.status is DumpStatus.NOT_AVAILABLE and "_dump_nccl_trace" in failed.reason
    respond(tmp_path, 2, 2, _Api(_dump_fr_trace=lambda: b"garbage"))
    assert read_answer(tmp_path, 2, 2).status is DumpStatus.UNREADABLE


@posix_only
def test_the_request_is_answered_by_the_workers_thread_and_bounded(tmp_path: Path) -> None:
    """Rank 0 serves (a thread blocked on its FIFO answers with both APIs' dumps); rank 1 has no
    listener; rank 2's FIFO is held open by a reader that never answers: each outcome typed,
    and the request returns at its deadline."""
    r0 = _dump([_entry(1, "completed"), _entry(2, "started")], 1)
    assert serve(tmp_path, 0, 0, _Api(_dump_nccl_trace=lambda: r0,
                                      _dump_fr_trace=lambda: _dump([], None)))
    os.mkfifo(RunDir.of(tmp_path).flight_fifo(2))
    silent = os.open(RunDir.of(tmp_path).flight_fifo(2), os.O_RDONLY | os.O_NONBLOCK)  # never answers
    try:
        got = request(tmp_path, [(0, 0), (1, 1), (2, 2)], wait_s=1.0)
    finally:
        os.close(silent)
    assert [(r.rank, r.status) for r in got] == [
        (0, DumpStatus.DUMPED), (1, DumpStatus.NO_LISTENER), (2, DumpStatus.NO_ANSWER)]
    assert got[0].dump is not None and [e.seq for e in got[0].dump.entries] == [1, 2]
    assert len(got[0].files) == 2
    facts = analyse(got)
    assert facts.stuck is not None and (facts.stuck.seq, facts.stuck.not_dumped) == (2, (1, 2))
    # asked again (the thread waits for the next request): a fresh answer
    again = request(tmp_path, [(0, 0)], wait_s=1.0)
    assert again[0].status is DumpStatus.DUMPED


class _Looks:
    """A fake clock and sleep: every sleep advances the clock and is counted."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps += 1
        self.now += s
        time.sleep(0.01)  # a worker's thread answers in real time


@posix_only
def test_a_stopped_rank_is_neither_asked_nor_waited_for(tmp_path: Path) -> None:
    """Rank 1's FIFO is held open by a reader that never answers (as a SIGSTOPped worker's
    is): said to be stopped, it is not asked (nothing written to its FIFO) nor waited for, and
    the request ends with rank 0's answer, its dump, long before the deadline."""
    r0 = _dump([_entry(1, "completed"), _entry(2, "started")], 1)
    assert serve(tmp_path, 0, 0, _Api(_dump_fr_trace=lambda: r0))
    os.mkfifo(RunDir.of(tmp_path).flight_fifo(1))
    silent = os.open(RunDir.of(tmp_path).flight_fifo(1), os.O_RDONLY | os.O_NONBLOCK)
    try:
        got = request(tmp_path, [(1, 1)], wait_s=30.0, stopped=lambda lr: "stopped (T)")
        assert [(r.rank, r.status, r.reason) for r in got] == [
            (1, DumpStatus.STOPPED, "stopped (T)")]
        assert os.read(silent, 1) == b""  # never knocked on (no writer: end of file)
        looks = _Looks()
        got = request(tmp_path, [(0, 0), (1, 1)], wait_s=30.0, clock=looks.clock,
                      sleep=looks.sleep, stopped=lambda lr: "stopped (T)" if lr == 1 else "")
    finally:
        os.close(silent)
    assert [(r.rank, r.status) for r in got] == [(0, DumpStatus.DUMPED),
                                                 (1, DumpStatus.STOPPED)]
    assert looks.now < 30.0  # ended with rank 0's answer, not at the deadline
    facts = analyse(got)
    assert facts.stuck is not None and (facts.stuck.seq, facts.stuck.not_dumped) == (2, (1,))
    assert [r["status"] for r in facts.to_dict()["ranks"]] == ["dumped", "stopped"]


@posix_only
def test_a_rank_stopped_while_waited_for_is_given_up_at_the_next_look(tmp_path: Path) -> None:
    os.mkfifo(RunDir.of(tmp_path).flight_fifo(0))
    silent = os.open(RunDir.of(tmp_path).flight_fifo(0), os.O_RDONLY | os.O_NONBLOCK)
    asked: list[int] = []

    def stopped(lr: int) -> str:
        asked.append(lr)
        return "stopped (T)" if len(asked) > 3 else ""  # stopped after the knock

    looks = _Looks()
    try:
        got = request(tmp_path, [(0, 0)], wait_s=30.0, clock=looks.clock, sleep=looks.sleep,
                      stopped=stopped)
        assert os.read(silent, 1) == b"1"  # it was asked
    finally:
        os.close(silent)
    assert [(r.rank, r.status) for r in got] == [(0, DumpStatus.STOPPED)]
    assert looks.sleeps == 2  # given up at the third look, the first that saw it stopped


def test_the_facts_travel_in_the_verdict_record() -> None:
    facts = analyse([_dumped(0, _dump([_entry(1, "started")], 0)),
                     RankDump(1, 1, DumpStatus.NOT_AVAILABLE, "no API")])
    v = Verdict(VerdictKind.STALL, "stalled", 1, "timeout", ranks=(1,), flight=facts)
    back = Verdict.from_dict(v.to_dict())
    assert back.flight is not None and back.flight.to_dict() == facts.to_dict()
    assert back.to_dict() == v.to_dict()
    assert Verdict.from_dict(Verdict(VerdictKind.STALL, "s").to_dict()).flight is None
    with pytest.raises(ValueError):
        FlightFacts.from_dict({"ranks": [{"rank": 0}]})


@pytest.mark.skipif("torch" not in sys.modules and not __import__("importlib").util.find_spec(
    "torch"), reason="torch is not installed")
def test_this_torchs_own_dump_parses(tmp_path: Path) -> None:
    """The dump APIs of the installed torch (whichever it has) answer, and what they return
    parses (an empty recorder: no process group here)."""
    import torch  # noqa: F401

    status = respond(tmp_path, 0, 0)
    answer = read_answer(tmp_path, 0, 0)
    assert answer.status in (DumpStatus.DUMPED, DumpStatus.NOT_AVAILABLE)
    assert (answer.status is DumpStatus.DUMPED) == bool(status["apis"])


def test_the_evidence_file_keeps_the_facts_and_the_raw_dumps(tmp_path: Path) -> None:
    from resilient_strategy.run.evidence import Evidence
    from resilient_strategy.run.policy import Action, Attempt, Judgement

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data = _dump([_entry(1, "completed"), _entry(2, "started")], 1)
    RunDir.of(run_dir).flight_dump(0, "_dump_nccl_trace").write_bytes(data)
    rank0 = RankDump(0, 0, DumpStatus.DUMPED, dump=parse_dump(data),
                     files=(str(RunDir.of(run_dir).flight_dump(0, "_dump_nccl_trace")),))
    facts = analyse([rank0, RankDump(1, 1, DumpStatus.NO_ANSWER)])
    verdict = Verdict(VerdictKind.STALL, "stalled", 2, "timeout", ranks=(0, 1), flight=facts)
    evidence = Evidence(tmp_path / "evidence", "session")
    attempt = Attempt(0, "torch:nccl:0,1", "NCCL", verdict, Judgement(Action.RETRY, "first"))
    written = evidence.record(attempt, run_dir, 2)
    assert written is not None and Path(written).is_file()
    assert (evidence.dir / "attempt1._dump_nccl_trace.rank0").read_bytes() == data
    summary = evidence.summary([attempt])
    assert summary is not None
    stuck = json.loads(Path(summary).read_text())["attempts"][0]["verdict"]["flight"]["stuck"]
    assert (stuck["seq"], stuck["entered"], stuck["not_dumped"]) == (2, [0], [1])
