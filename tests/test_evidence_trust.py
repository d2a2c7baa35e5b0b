"""The files the supervisor writes and reads for a fault's evidence (issue 46, item 3), under the
rules checkpoints follow (machine/files.py): ``--evidence-dir`` and the session's directory in it
this user's own and never followed as a symlink; what is read from the run directory (stacks,
tracebacks, stderr logs, error records) read as this user's regular files only, bounded, never
through a symlink and never blocking on a FIFO.

The planted variants are planted by a second real user where the tests run as root (CI): a
child process that has become uid/gid 65534 (nobody) makes the link in a real sticky directory;
without root they skip, saying so. The FIFOs are real FIFOs (``mkfifo``)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from resilient_strategy.records.rundir import RunDir
from resilient_strategy.run.evidence import Evidence
from resilient_strategy.run.policy import Action, Attempt, Judgement
from resilient_strategy.run.verdicts import Verdict, VerdictKind

OTHER_UID = 65534  # nobody
as_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="acting as a second real user needs root (setuid); CI runs these as root")
#: The longest a read of the run directory may take here before it counts as blocked.
BLOCKED_S = 30.0


def _as_other_user(action: Callable[[], None]) -> None:
    """Run ``action`` in a child process that is uid/gid 65534 (a second real user). The child
    only makes syscalls and exits (Python 3.12 warns of a fork beside threads: not here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            action()
            code = 0
        except BaseException as exc:
            os.write(2, f"as uid {OTHER_UID}: {exc!r}\n".encode())
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _attempt() -> Attempt:
    verdict = Verdict(VerdictKind.EXIT, "the script's error on rank 0", 0, "exit", ranks=(0,))
    return Attempt(0, "torch:gloo:cpu2", "gloo", verdict, Judgement(Action.STOP, "the script's"))


@pytest.fixture
def world() -> Iterator[Path]:
    """A directory the second user can reach (this session's temp directory is under pytest's,
    which are 0700): in /tmp, mode 0755, removed after."""
    base = Path(tempfile.mkdtemp(prefix="rs-test-trust-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _shared_sticky(base: Path) -> Path:
    """A shared directory as /tmp is: world-writable and sticky (a shared cwd)."""
    shared = base / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    return shared


def _within(seconds: float, call: Callable[[], Any]) -> tuple[bool, Any]:
    """``call()`` in a thread; (finished within ``seconds``, its value)."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(call()), daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive(), (out[0] if out else None)


def _unblock(fifo: Path) -> None:
    """Let a reader blocked opening ``fifo`` go (the code before the fix blocks there)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    os.close(fd)


def _run_dir(tmp_path: Path) -> RunDir:
    run = RunDir(tmp_path / "session" / "attempt0")
    run.root.mkdir(parents=True, mode=0o700)
    run.traceback(0).write_text("Traceback (most recent call last):\nRuntimeError: boom\n")
    return run


# ----- the evidence directory ------------------------------------------------------------------
@as_root
def test_a_link_planted_by_another_user_in_a_shared_evidence_dir_is_never_written_through(
        tmp_path: Path, world: Path) -> None:
    """The issue's case: another user owns a sticky ``./resilient-strategy-evidence`` and plants
    ``<session>`` -> a directory of theirs. Before: ``summary`` followed it (``is_dir()``) and
    root wrote attempts.json there, on a fault-free run too."""
    shared = _shared_sticky(world)
    target = shared / "theirs"
    root = shared / "resilient-strategy-evidence"
    session = "rs-run-123-abcdefgh"

    def plant() -> None:
        target.mkdir(mode=0o777)
        root.mkdir(mode=0o777)
        os.chmod(root, 0o1777)
        os.symlink(target, root / session)

    _as_other_user(plant)
    assert os.lstat(root / session).st_uid == OTHER_UID
    evidence = Evidence(root, session)
    assert evidence.summary([_attempt()]) is None  # a fault-free run's summary
    assert evidence.record(_attempt(), _run_dir(tmp_path).root, 1) is None  # and a fault's
    assert evidence.setup({"what": "agreement"}) is None
    assert os.listdir(target) == []


@as_root
def test_an_evidence_dir_of_another_users_is_refused_before_a_session_is_made_in_it(
        tmp_path: Path, world: Path) -> None:
    shared = _shared_sticky(world)
    root = shared / "resilient-strategy-evidence"
    _as_other_user(lambda: root.mkdir(mode=0o777) or os.chmod(root, 0o1777))
    evidence = Evidence(root, "rs-run-1-x")
    assert evidence.record(_attempt(), _run_dir(tmp_path).root, 1) is None
    assert os.listdir(root) == []


def test_a_session_link_of_this_users_own_is_not_followed_either(tmp_path: Path) -> None:
    root = tmp_path / "evidence"
    root.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (root / "rs-run-1-x").symlink_to(elsewhere)
    evidence = Evidence(root, "rs-run-1-x")
    assert evidence.summary([_attempt()]) is None
    assert evidence.record(_attempt(), _run_dir(tmp_path).root, 1) is None
    assert os.listdir(elsewhere) == []


def test_a_group_writable_evidence_dir_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "evidence"
    root.mkdir()
    os.chmod(root, 0o777)
    assert Evidence(root, "rs-run-1-x").record(_attempt(), _run_dir(tmp_path).root, 1) is None
    assert os.listdir(root) == []


def test_the_evidence_is_written_private_and_a_fault_free_run_writes_nothing(
        tmp_path: Path) -> None:
    root = tmp_path / "evidence"
    quiet = Evidence(root, "rs-run-1-x")
    assert quiet.summary([]) is None and not root.exists()  # no fault: nothing at all
    written = Evidence(root, "rs-run-2-y").record(_attempt(), _run_dir(tmp_path).root, 1)
    assert written is not None
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(Path(written).parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o600
    summary = Evidence(root, "rs-run-2-y").summary([_attempt()])
    assert summary is not None and json.loads(Path(summary).read_text())["attempts"]


# ----- what is read from the run directory -----------------------------------------------------
def test_a_fifo_at_a_ranks_stacks_file_does_not_block_the_evidence(tmp_path: Path) -> None:
    """The issue's case: a FIFO at ``rank0.stacks.txt``. Before: the supervisor blocked forever
    opening it while it wrote the evidence."""
    run = _run_dir(tmp_path)
    os.mkfifo(run.stacks(0))
    evidence = Evidence(tmp_path / "evidence", "rs-run-1-x")
    try:
        done, written = _within(BLOCKED_S, lambda: evidence.record(_attempt(), run.root, 1))
    finally:
        _unblock(run.stacks(0))
    assert done
    assert written is not None
    text = Path(written).read_text()
    assert "RuntimeError: boom" in text  # the traceback is still kept
    assert str(run.stacks(0)) not in text  # the FIFO is not a stacks dump


def test_a_fifo_at_a_ranks_stderr_log_is_no_log(tmp_path: Path) -> None:
    """A FIFO at ``logs/<id>/attempt_0/0/stderr.log``. Before: the stderr tail (the verdict's and
    the evidence's) blocked forever opening it."""
    from resilient_strategy.run.agent import _stderr_tail

    run = _run_dir(tmp_path)
    log_dir = run.logs / "job" / "attempt_0" / "0"
    log_dir.mkdir(parents=True)
    fifo = log_dir / "stderr.log"
    os.mkfifo(fifo)
    try:
        done, logs = _within(BLOCKED_S, lambda: run.stderr_logs(0))
        assert done and logs == []
        done, text = _within(BLOCKED_S, lambda: _stderr_tail(run, 0))
        assert done and text == ""
        done, written = _within(BLOCKED_S, lambda: Evidence(
            tmp_path / "evidence", "rs-run-1-x").record(_attempt(), run.root, 1))
        assert done and written is not None
    finally:
        _unblock(fifo)


def test_a_fifo_at_a_ranks_error_record_is_not_copied(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    os.mkfifo(run.error(0))
    evidence = Evidence(tmp_path / "evidence", "rs-run-1-x")
    try:
        done, written = _within(BLOCKED_S, lambda: evidence.record(_attempt(), run.root, 1))
    finally:
        _unblock(run.error(0))
    assert done and written is not None
    assert not evidence.error_record(0, 0).exists()


@pytest.mark.parametrize("kind", ["traceback", "stacks", "error"])
def test_a_link_in_the_run_directory_is_never_read_into_the_evidence(tmp_path: Path,
                                                                      kind: str) -> None:
    run = _run_dir(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text('{"secret": "do-not-copy"}\n')
    path = run.rank_file(0, kind)
    path.unlink(missing_ok=True)
    path.symlink_to(secret)
    evidence = Evidence(tmp_path / "evidence", "rs-run-1-x")
    written = evidence.record(_attempt(), run.root, 1)
    assert written is not None
    for name in os.listdir(evidence.dir):
        assert "do-not-copy" not in (evidence.dir / name).read_text()


def test_a_ranks_files_written_under_umask_002_are_still_evidence(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    os.chmod(run.traceback(0), 0o664)  # the worker's open() under a user-private-group umask
    written = Evidence(tmp_path / "evidence", "rs-run-1-x").record(_attempt(), run.root, 1)
    assert written is not None and "RuntimeError: boom" in Path(written).read_text()


def test_a_stderr_tail_is_bounded_and_is_the_end(tmp_path: Path) -> None:
    from resilient_strategy.machine import files

    path = tmp_path / "stderr.log"
    path.write_bytes(b"a" * 5000 + b"END")
    os.chmod(path, 0o600)
    assert files.read_tail(path, max_bytes=10) == b"aaaaaaaEND"
    assert files.read_tail(path, max_bytes=1 << 20) == b"a" * 5000 + b"END"
