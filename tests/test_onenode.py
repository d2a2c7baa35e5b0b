"""The agreement between local ranks: one file per launch attempt, fresh decisions only."""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
import threading
import time
from pathlib import Path

import pytest

from resilient_strategy.errors import ResilientStrategyError
from resilient_strategy.nodes.onenode import (
    START_SLACK_S,
    Agreement,
    AgreementTimeoutError,
    default_dir,
    process_start_ticks,
    process_start_time,
)

LAUNCH = {"TORCHELASTIC_RUN_ID": "job1", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "0"}
PAYLOAD = {"chosen": "torch:nccl:0,1", "results": {}, "from_cache": False, "proven": True}


def fake_proc(root: Path, pid: int | str, ticks: int, comm: str = "torchrun",
              btime: int = 1_700_000_000) -> Path:
    """A /proc with one process (start time ``ticks`` after boot) and the boot time."""
    (root / str(pid)).mkdir(parents=True, exist_ok=True)
    fields = ["S", "1", "1", "1", "0", "-1", "4194560"] + ["0"] * 12 + [str(ticks), "1000"]
    (root / str(pid) / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + " 0 0\n")
    (root / "stat").write_text(f"cpu 1 2 3\nbtime {btime}\nprocesses 5\n")
    return root


def test_start_ticks_is_field_22_even_with_odd_process_names(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, 42, 987654, comm="my (odd) name ) x")
    assert process_start_ticks(42, proc) == "987654"
    assert process_start_ticks(43, proc) == ""  # no such process
    (proc / "42" / "stat").write_text("42 (short) S 1\n")
    assert process_start_ticks(42, proc) == ""  # truncated: unreadable, not an IndexError


def test_process_start_time_from_proc(tmp_path: Path) -> None:
    hz = os.sysconf("SC_CLK_TCK")
    proc = fake_proc(tmp_path, "self", 50 * hz, btime=1_000)
    assert process_start_time(proc) == pytest.approx(1_050.0)
    assert process_start_time(tmp_path / "missing") is None
    if Path("/proc/self/stat").exists():  # this very process started before now
        real = process_start_time()
        assert real is not None and real <= time.time() + 1


def test_a_restart_is_another_agreement(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path / "proc", 4242, 1000)
    first = Agreement.for_job(LAUNCH, "fp", tmp_path, ppid=4242, proc_root=proc)
    again = Agreement.for_job(LAUNCH, "fp", tmp_path, ppid=4242, proc_root=proc)
    restarted = Agreement.for_job({**LAUNCH, "TORCHELASTIC_RESTART_COUNT": "1"}, "fp", tmp_path,
                                  ppid=4242, proc_root=proc)
    assert first == again and first.path != restarted.path
    first.publish({**PAYLOAD, "chosen": "torch:gloo:0,1"})  # attempt 0 decided gloo, then died
    with pytest.raises(AgreementTimeoutError):  # attempt 1 must not follow attempt 0
        restarted.wait(0.3, poll_s=0.05, not_before=-math.inf)


def test_a_reused_parent_pid_is_another_agreement(tmp_path: Path) -> None:
    # torchrun as PID 1 of two containers, or a pid reused: the parent's start time differs
    one = Agreement.for_job(LAUNCH, "fp", tmp_path, ppid=1,
                            proc_root=fake_proc(tmp_path / "a", 1, 100))
    two = Agreement.for_job(LAUNCH, "fp", tmp_path, ppid=1,
                            proc_root=fake_proc(tmp_path / "b", 1, 90000))
    assert one.path != two.path
    assert "100" in one.path.name and "90000" in two.path.name


def test_launcher_values_cannot_leave_the_directory(tmp_path: Path) -> None:
    ag = Agreement.for_job({"TORCHELASTIC_RUN_ID": "../../etc/x y"}, "fp", tmp_path, ppid=7,
                           proc_root=tmp_path / "none")
    assert ag.path.parent == tmp_path and "/" not in ag.path.name


def test_a_decision_older_than_this_process_is_ignored(tmp_path: Path) -> None:
    ag = Agreement(tmp_path / "agree.json")
    ag.publish({**PAYLOAD, "chosen": "stale"}, now=1_000.0)
    with pytest.raises(AgreementTimeoutError, match="earlier launch"):
        ag.wait(0.3, poll_s=0.05, not_before=2_000.0)

    def leader() -> None:
        time.sleep(0.2)
        ag.publish(PAYLOAD, now=2_001.0)

    t = threading.Thread(target=leader)
    t.start()
    try:
        assert ag.wait(5.0, poll_s=0.02, not_before=2_000.0)["chosen"] == PAYLOAD["chosen"]
    finally:
        t.join()


def test_wait_compares_with_the_process_start_time_by_default(tmp_path: Path) -> None:
    hz = os.sysconf("SC_CLK_TCK")
    proc = fake_proc(tmp_path / "proc", "self", 100 * hz, btime=10_000)  # started at 10_100
    ag = Agreement(tmp_path / "agree.json")
    ag.publish(PAYLOAD, now=10_100 - START_SLACK_S - 1)
    with pytest.raises(AgreementTimeoutError):
        ag.wait(0.2, poll_s=0.05, proc_root=proc)
    ag.publish(PAYLOAD, now=10_100 - START_SLACK_S + 1)  # within the slack: same launch
    assert ag.wait(0.2, poll_s=0.05, proc_root=proc)["chosen"] == PAYLOAD["chosen"]


def test_publish_prunes_old_agreements(tmp_path: Path) -> None:
    old, recent, other = tmp_path / "agree-1-x.json", tmp_path / "agree-2-x.json", tmp_path / "x"
    for p in (old, recent, other):
        p.write_text("{}")
    two_days_ago = time.time() - 2 * 86400
    os.utime(old, (two_days_ago, two_days_ago))
    os.utime(other, (two_days_ago, two_days_ago))
    Agreement(tmp_path / "agree-3-x.json").publish(PAYLOAD)
    assert not old.exists() and recent.exists() and other.exists()
    assert (tmp_path / "agree-3-x.json").exists()


def test_unusable_directory_is_a_typed_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ResilientStrategyError, match="RESILIENT_STRATEGY_CACHE_DIR"):
        Agreement(blocker / "sub" / "agree.json").publish(PAYLOAD)
    unreadable = tmp_path / "agree.json"
    unreadable.mkdir()  # a directory where the file should be
    with pytest.raises(ResilientStrategyError, match="cannot"):
        Agreement(unreadable).publish(PAYLOAD)
    with pytest.raises(ResilientStrategyError, match="cannot read"):
        Agreement(unreadable).wait(0.2, poll_s=0.05)


def test_a_payload_that_cannot_be_read_is_a_typed_error(tmp_path: Path) -> None:
    ag = Agreement(tmp_path / "agree.json")
    ag.publish({**PAYLOAD, "results": {"k": {"candidate": "k", "status": "weird"}}})
    with pytest.raises(ResilientStrategyError, match="same version"):
        ag.wait(0.5, poll_s=0.05)


def test_default_directory_is_private_to_the_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ag = Agreement.for_job(LAUNCH, "fp", None)
    assert ag.path.parent == tmp_path / f"resilient_strategy-{os.getuid()}" == default_dir({})
    ag.publish(PAYLOAD)
    assert stat.S_IMODE(ag.path.parent.stat().st_mode) == 0o700
    assert ag.wait(1.0)["chosen"] == PAYLOAD["chosen"]
    ag.path.parent.chmod(0o777)  # opened up: another user may have planted files there
    with pytest.raises(ResilientStrategyError, match=r"writable by others \(mode 777\)"):
        ag.publish(PAYLOAD)


def test_default_directory_prefers_xdg_runtime_dir(tmp_path: Path) -> None:
    ag = Agreement.for_job({**LAUNCH, "XDG_RUNTIME_DIR": str(tmp_path)}, "fp", None)
    assert ag.path.parent == tmp_path / "resilient_strategy"
    ag.publish(PAYLOAD)
    assert json.loads(ag.path.read_text())["chosen"] == PAYLOAD["chosen"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_default_directory_of_another_user_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    planted = tmp_path / f"resilient_strategy-{os.getuid()}"
    planted.mkdir(mode=0o777)
    os.chown(planted, 12345, 12345)
    ag = Agreement.for_job(LAUNCH, "fp", None)
    with pytest.raises(ResilientStrategyError, match="owned by uid 12345, not by this user"):
        ag.publish(PAYLOAD)
    with pytest.raises(ResilientStrategyError, match="owned by uid 12345, not by this user"):
        ag.wait(0.2)


# ----- trust and cleanup -----------------------------------------------------------------------
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0,
                             reason="giving a file to another uid (os.chown) needs root")
TORCHRUN2 = {**LAUNCH, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}


def test_an_open_cache_directory_falls_back_to_a_private_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    env = {**TORCHRUN2, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    with caplog.at_level("WARNING", logger="resilient_strategy"):
        leader = Agreement.for_job({**env, "LOCAL_RANK": "0"}, "fp", shared, ppid=1)
    follower = Agreement.for_job({**env, "LOCAL_RANK": "1"}, "fp", shared, ppid=1)
    assert leader.path == follower.path and leader.path.parent == tmp_path / "run" / \
        "resilient_strategy"
    assert "writable by others" in caplog.text and str(shared) in caplog.text
    leader.publish(PAYLOAD)
    assert follower.wait(1.0, not_before=-math.inf)["chosen"] == PAYLOAD["chosen"]
    assert list(shared.iterdir()) == []


def test_an_unusable_cache_directory_falls_back_to_a_private_one(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    env = {**TORCHRUN2, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    ag = Agreement.for_job(env, "fp", tmp_path / "file" / "cache", ppid=1)
    assert ag.path.parent == tmp_path / "run" / "resilient_strategy"
    ag.publish(PAYLOAD)  # no hard error: the decision is still shared


@as_root
def test_a_planted_agreement_file_is_not_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ag = Agreement(tmp_path / "agree-x.json")
    ag.path.write_text(json.dumps({**PAYLOAD, "chosen": "cpu", "published_at": time.time()}))
    os.chown(ag.path, NOBODY, NOBODY)
    with caplog.at_level("WARNING", logger="resilient_strategy"), \
            pytest.raises(AgreementTimeoutError, match=f"refused: .*owned by uid {NOBODY}"):
        ag.wait(0.3, poll_s=0.05, not_before=-math.inf)
    assert f"owned by uid {NOBODY}" in caplog.text
    ag.publish(PAYLOAD)  # rank 0's atomic replace takes its place
    assert ag.wait(0.3, not_before=-math.inf)["chosen"] == PAYLOAD["chosen"]


def test_a_symlinked_agreement_file_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({**PAYLOAD, "chosen": "cpu", "published_at": time.time()}))
    ag = Agreement(tmp_path / "agree-x.json")
    ag.path.symlink_to(elsewhere)
    with pytest.raises(AgreementTimeoutError, match="symbolic link"):
        ag.wait(0.3, poll_s=0.05, not_before=-math.inf)


@pytest.mark.parametrize("change", [
    {"proven": None}, {"from_cache": "yes"}, {"chosen": 3}, {"results": []},
    {"results": {"torch:gloo:0,1": {"candidate": "torch:nccl:0,1", "status": "ok"}}},
])
def test_every_payload_field_is_checked(tmp_path: Path, change: dict[str, object]) -> None:
    ag = Agreement(tmp_path / "agree.json")
    ag.publish({**PAYLOAD, **change})
    with pytest.raises(ResilientStrategyError, match="cannot read"):
        ag.wait(0.5, not_before=-math.inf)
    for key in PAYLOAD:  # a missing key is a typed error too, never a KeyError
        ag.publish({k: v for k, v in PAYLOAD.items() if k != key})
        with pytest.raises(ResilientStrategyError, match="cannot read"):
            ag.wait(0.5, not_before=-math.inf)


def test_a_deeply_nested_agreement_is_refused_not_a_recursion_error(tmp_path: Path) -> None:
    ag = Agreement(tmp_path / "agree.json")
    ag.path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(AgreementTimeoutError, match="nested deeper than"):
        ag.wait(0.3, poll_s=0.05, not_before=-math.inf)


def test_the_last_reader_removes_the_file(tmp_path: Path) -> None:
    env = {**LAUNCH, "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}
    ranks = [Agreement.for_job({**env, "LOCAL_RANK": str(r)}, "fp", tmp_path, ppid=1)
             for r in range(3)]
    assert [a.readers for a in ranks] == [2, 2, 2]
    ranks[0].publish(PAYLOAD)
    assert ranks[1].wait(1.0, not_before=-math.inf)["chosen"] == PAYLOAD["chosen"]
    assert ranks[0].path.exists()  # rank 2 has not read it yet
    assert ranks[2].wait(1.0, not_before=-math.inf)["chosen"] == PAYLOAD["chosen"]
    assert list(tmp_path.iterdir()) == []


def test_one_local_rank_writes_nothing(tmp_path: Path) -> None:
    ag = Agreement.for_job({**LAUNCH, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, "fp",
                           tmp_path, ppid=1)
    ag.publish(PAYLOAD)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into a read-only directory; the "
                    "same fallback runs for a path that cannot be created, just above")
def test_a_read_only_cache_directory_falls_back_to_a_private_one(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        env = {**TORCHRUN2, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
        ag = Agreement.for_job(env, "fp", ro / "cache", ppid=1)
        assert ag.path.parent == tmp_path / "run" / "resilient_strategy"
        ag.publish(PAYLOAD)
    finally:
        ro.chmod(0o700)
