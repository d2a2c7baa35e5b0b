"""The process runner, with real ``python -c`` workers (no framework)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
from conftest import deadline

from resilient_strategy.probing import prober
from resilient_strategy.probing.proc import GroupOutcome, WorkerCommand, run_group

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")


def cmd(code: str, tmp_path: Path, name: str, *extra: str) -> WorkerCommand:
    env = {**os.environ, "PYTHONPATH": prober.PACKAGE_ROOT}
    return WorkerCommand((sys.executable, "-c", code, *extra), env, str(tmp_path),
                         str(tmp_path / f"{name}.json"))


def running(marker: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in argv and state != "Z":
            found.append(int(entry.name))
    return found


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def gone_soon(marker: str, within_s: float = 3.0) -> bool:
    """No live process with ``marker`` (reparented ones die asynchronously, from outside)."""
    end = time.monotonic() + within_s
    while running(marker) and time.monotonic() < end:
        time.sleep(0.05)
    return running(marker) == []


def assert_all_gone(out: GroupOutcome) -> None:
    assert all(group_gone(pid) for pid in out.pids)


@pytest.fixture
def marker() -> Iterator[str]:
    m = f"rs-test-{uuid.uuid4().hex}"
    yield m
    for pid in running(m):  # never leave a stray behind, even when a test fails
        os.kill(pid, signal.SIGKILL)


SLEEP = "import time; time.sleep(60)"
WRITE = "import sys, json; open(sys.argv[1], 'w').write(json.dumps({'status': 'ok'}))"


def test_all_succeed_and_reports_are_read(tmp_path: Path) -> None:
    commands = [cmd(WRITE, tmp_path, f"r{i}", str(tmp_path / f"r{i}.json")) for i in range(2)]
    out = run_group(commands, 20.0)
    assert not out.timed_out
    assert [o.returncode for o in out.outcomes] == [0, 0]
    assert [o.report for o in out.outcomes] == ['{"status": "ok"}'] * 2
    assert not any(o.killed_by_runner or o.failed_first for o in out.outcomes)
    assert_all_gone(out)


@pytest.mark.slow
def test_one_failure_stops_the_others_at_once(tmp_path: Path, marker: str) -> None:
    fail = "import sys, time; time.sleep(0.3); print('boom', file=sys.stderr); sys.exit(1)"
    out = run_group([cmd(SLEEP, tmp_path, "a", marker), cmd(fail, tmp_path, "b")], 30.0)
    sleeper, failer = out.outcomes
    assert (failer.returncode, failer.failed_first, failer.killed_by_runner) == (1, True, False)
    assert "boom" in failer.stderr
    assert (sleeper.killed_by_runner, sleeper.returncode, sleeper.signal) == (True, None, 15)
    assert not out.timed_out  # stopped by the failure, not the clock
    assert_all_gone(out)
    assert running(marker) == []


@pytest.mark.slow
def test_deadline_kills_everyone(tmp_path: Path, marker: str) -> None:
    out = run_group([cmd(SLEEP, tmp_path, f"s{i}", marker) for i in range(2)], 1.0)
    assert out.timed_out
    assert 1.0 <= out.elapsed_s < 1.0 + 2.0
    assert all(o.killed_by_runner and o.signal == signal.SIGTERM for o in out.outcomes)
    assert_all_gone(out)
    assert running(marker) == []


@pytest.mark.slow
def test_sigterm_ignored_gets_sigkill(tmp_path: Path, marker: str) -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    out = run_group([cmd(code, tmp_path, "t", marker)], 0.5, grace_s=0.5)
    assert out.timed_out
    assert out.outcomes[0].signal == signal.SIGKILL
    assert_all_gone(out)


@pytest.mark.slow
def test_grandchildren_in_the_worker_group_are_killed(tmp_path: Path, marker: str) -> None:
    code = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', sys.argv[1]]); "
            "time.sleep(0.5); sys.exit(2)")
    out = run_group([cmd(code, tmp_path, "g", marker)], 20.0)
    assert out.outcomes[0].returncode == 2
    assert gone_soon(marker)  # the grandchild, now a child of init, died with the group


@pytest.mark.slow
def test_interrupted_parent_kills_and_reaps(tmp_path: Path, marker: str) -> None:
    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_group([cmd(SLEEP, tmp_path, f"s{i}", marker) for i in range(2)], 30.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert running(marker) == []


def test_sigterm_to_the_parent_stops_the_workers_and_still_terminates_it(
    tmp_path: Path, marker: str
) -> None:
    # torchrun sends SIGTERM to every rank when one fails: a rank mid-probe must not leave
    # its workers or their temporary directory behind, and must still die of the SIGTERM.
    import subprocess

    sleeper = "import time, sys; time.sleep(60)"
    parent = (
        "import os, sys, tempfile\n"
        "from resilient_strategy.probing.proc import WorkerCommand, run_group\n"
        "tempfile.tempdir = sys.argv[1]\n"
        f"cmds = [WorkerCommand((sys.executable, '-c', {sleeper!r}, os.environ['RS_MARKER']), dict(os.environ),"
        " sys.argv[1], os.path.join(sys.argv[1], f'r{i}.json')) for i in range(2)]\n"
        "print('started', flush=True)\n"
        "run_group(cmds, 60.0)\n"
        "print('not reached', flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": prober.PACKAGE_ROOT, "RS_MARKER": marker}
    with subprocess.Popen([sys.executable, "-c", parent, str(tmp_path)], env=env,
                          stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        end = time.monotonic() + 10
        while len(running(marker)) < 2 and time.monotonic() < end:
            time.sleep(0.05)
        assert len(running(marker)) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=deadline(10)) == -signal.SIGTERM
        assert "not reached" not in proc.stdout.read()
    assert gone_soon(marker, within_s=1.0)
    assert not list(tmp_path.glob("rs-proc-*"))


def test_a_worker_that_cannot_start_stops_those_started(tmp_path: Path, marker: str) -> None:
    missing = WorkerCommand(("/nonexistent/python",), {}, str(tmp_path), str(tmp_path / "x.json"))
    with pytest.raises(FileNotFoundError):
        run_group([cmd(SLEEP, tmp_path, "s", marker), missing], 30.0)
    assert running(marker) == []


def test_stderr_is_a_bounded_tail(tmp_path: Path) -> None:
    code = "import sys; sys.stderr.write('x' * 300_000 + '\\nLAST LINE\\n'); sys.exit(1)"
    out = run_group([cmd(code, tmp_path, "e")], 20.0)
    err = out.outcomes[0].stderr
    assert err.endswith("LAST LINE\n")
    assert len(err) <= 64 << 10


@pytest.mark.slow
def test_orphaned_worker_exits_when_its_parent_is_killed(tmp_path: Path, marker: str) -> None:
    # The middle process starts a worker in its own session (as run_group does), then dies by
    # SIGKILL: nothing in the runner can reach that worker; its watchdog must end it.
    # The worker is told its parent's pid, as the runner's workers are (--parent-pid): one that
    # starts after the parent already died (a slow start on a busy machine) exits at once
    # instead of watching init, its new parent, for a minute.
    worker = ("import sys; from resilient_strategy.probing.workers.watchdog import watch_parent; "
              "watch_parent(expected_parent=int(sys.argv[2])); import time; time.sleep(60)")
    middle = ("import os, signal, subprocess, sys, time; "
              f"subprocess.Popen([sys.executable, '-c', {worker!r}, sys.argv[1], str(os.getpid())], "
              "start_new_session=True); time.sleep(1.0); os.kill(os.getpid(), signal.SIGKILL)")
    out = run_group([cmd(middle, tmp_path, "m", marker)], 20.0)
    assert out.outcomes[0].signal == signal.SIGKILL
    assert not out.outcomes[0].killed_by_runner
    assert gone_soon(marker)


def test_watchdog_exits_at_once_when_the_parent_already_changed(tmp_path: Path) -> None:
    code = ("from resilient_strategy.probing.workers.watchdog import watch_parent; "
            "watch_parent(expected_parent=1); import time; time.sleep(60)")
    out = run_group([cmd(code, tmp_path, "w")], 20.0)
    assert out.outcomes[0].returncode == 3
    assert not out.timed_out  # it exited by itself, long before the runner's deadline


def test_killed_workers_leave_no_nccl_shm_segments(tmp_path: Path, marker: str) -> None:
    import subprocess

    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "nccl-before").write_text("another job's, there before the probe")
    hang = ("import pathlib, sys, time; d = pathlib.Path(sys.argv[1]); "
            "(d / ('nccl-' + sys.argv[2])).write_text('x'); time.sleep(60)")
    # another job's segment, made during the probe (once a worker made its own) and still held
    # open: must survive. The group is stopped when all three exist, not at a deadline a slow
    # start on a busy machine could reach first.
    holder = subprocess.Popen([sys.executable, "-c", "import pathlib, sys, time\n"
                               "d = pathlib.Path(sys.argv[1])\n"
                               "while not (d / 'nccl-leak0').exists(): time.sleep(0.01)\n"
                               "f = open(d / 'nccl-held', 'w'); f.write('x'); f.flush()\n"
                               "time.sleep(60)", str(shm)])
    made = [shm / "nccl-leak0", shm / "nccl-leak1", shm / "nccl-held"]
    try:
        out = run_group([cmd(hang, tmp_path, f"w{i}", str(shm), f"leak{i}", marker)
                         for i in range(2)], 60.0, shm_dir=str(shm),
                        stop=lambda: "made" if all(p.exists() for p in made) else "")
        assert out.stopped == "made" and not out.timed_out
        assert sorted(p.name for p in shm.iterdir()) == ["nccl-before", "nccl-held"]
    finally:
        holder.kill()
        holder.wait(timeout=deadline(10))
    assert running(marker) == []


def test_a_clean_run_removes_the_segments_its_workers_left_and_nothing_else(
        tmp_path: Path) -> None:
    """A torch probe worker exits right after its report, without tearing NCCL down: what it left
    goes; a segment there before, or one a live process holds, stays."""
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "nccl-before").write_text("another job's, there before the probe")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'w'); time.sleep(60)",
         str(shm / "nccl-held")])
    try:
        end = time.monotonic() + 10
        while not (shm / "nccl-held").exists() and time.monotonic() < end:
            time.sleep(0.05)
        ok = "import pathlib, sys; (pathlib.Path(sys.argv[1]) / 'nccl-left').write_text('x')"
        out = run_group([cmd(ok, tmp_path, "w", str(shm))], 10.0, shm_dir=str(shm))
        assert not out.timed_out and out.outcomes[0].returncode == 0
        assert sorted(p.name for p in shm.iterdir()) == ["nccl-before", "nccl-held"]
    finally:
        holder.kill()
        holder.wait()
