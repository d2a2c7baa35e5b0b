"""An attempt's run directory as one value (`records/rundir.RunDir`), its writers going through
`machine/files`' atomic write, and the supervisor's environment writes through `machine/env`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilient_strategy.errors import NoSpaceError
from resilient_strategy.machine import env as machine_env
from resilient_strategy.machine import files
from resilient_strategy.records import phases
from resilient_strategy.records.handoff import HandedDecision, write_decision, write_error
from resilient_strategy.records.rundir import RANK_FILES, RunDir


def test_every_file_of_an_attempt_is_its_own(tmp_path: Path) -> None:
    where = RunDir(tmp_path)
    paths = [where.decision, where.checkpoint_note, where.supervisor_phases, where.logs,
             *(where.rank_file(r, k) for r in range(3) for k in RANK_FILES),
             *(where.flight_dump(r, "_dump_nccl_trace") for r in range(3))]
    assert len(set(paths)) == len(paths)
    assert all(p.parent == tmp_path for p in paths)
    assert RunDir.of(str(tmp_path)) == where and RunDir.of(where) is where


def test_the_writers_and_the_readers_meet_in_it(tmp_path: Path) -> None:
    where = RunDir(tmp_path)
    write_decision(where.decision, HandedDecision(framework="torch", chosen="torch:cpu:cpu",
                                                  results={}, run_dir=str(tmp_path)))
    assert json.loads(where.decision.read_text())["chosen"] == "torch:cpu:cpu"
    write_error(tmp_path, 1, RuntimeError("boom"), None)
    assert json.loads(where.error(1).read_text())["types"][0] == "builtins.RuntimeError"
    phases.mark(where.supervisor_phases, phases.VERDICT, 3.0)
    phases.mark(where.phases(0), phases.FIRST_STEP, 5.0)
    phases.mark(where.phases(0), phases.FIRST_STEP, 9.0)  # once: the first time stands
    timeline = phases.Timeline.read(tmp_path, 1)
    assert timeline.supervisor == {phases.VERDICT: 3.0}
    assert timeline.ranks == ({phases.FIRST_STEP: 5.0},)
    assert not list(tmp_path.glob(".tmp-*"))  # every write was atomic, nothing left over


def test_an_atomic_write_that_fails_leaves_the_old_file_whole(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    files.write_bytes_atomic(target, b"old")
    with pytest.raises(RuntimeError), files.atomic_writer(target) as fh:
        fh.write(b"half")
        raise RuntimeError("the writer failed")
    assert target.read_bytes() == b"old" and not list(tmp_path.glob(".tmp-*"))


def test_an_atomic_write_on_a_full_disk_is_typed(tmp_path: Path) -> None:
    def full() -> None:
        raise OSError(28, "No space left on device")

    target = tmp_path / "f.bin"
    with pytest.raises(NoSpaceError), files.atomic_writer(target, before_replace=full) as fh:
        fh.write(b"x")
    assert not target.exists() and not list(tmp_path.glob(".tmp-*"))


def test_keep_previous_and_set_aside(tmp_path: Path) -> None:
    cur, prev = tmp_path / "c.pt", tmp_path / "c.prev.pt"
    assert files.keep_previous(cur, prev) is None and not prev.exists()  # nothing to keep
    cur.write_bytes(b"1")
    assert files.keep_previous(cur, prev) is None and prev.read_bytes() == b"1"
    assert files.set_aside(cur, tmp_path / "c.corrupt") and not cur.exists()
    prev.write_bytes(b"2")
    assert not files.set_aside(prev, tmp_path / "c.corrupt", keep_existing=True)
    assert prev.exists()


def test_env_setting_never_overrides_and_restores() -> None:
    target = {"USER_SET": "mine"}
    with machine_env.setting({"USER_SET": "ours", "NEW": "1"}, target) as applied:
        assert applied == {"NEW": "1"} and target == {"USER_SET": "mine", "NEW": "1"}
    assert target == {"USER_SET": "mine"}


def test_unset_added_removes_only_what_was_not_there() -> None:
    before = {"OMP_NUM_THREADS": "4"}
    target = {"OMP_NUM_THREADS": "4"}
    machine_env.unset_added(["OMP_NUM_THREADS"], before, target)
    assert target == {"OMP_NUM_THREADS": "4"}  # the user's stays
    target = {"OMP_NUM_THREADS": "1"}
    machine_env.unset_added(["OMP_NUM_THREADS"], {}, target)
    assert target == {}  # torchrun's goes
