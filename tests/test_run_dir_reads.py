"""What the agent reads of a rank's files is read as a regular file only (a FIFO planted at a
rank's ``error.json`` or ``stderr.log`` never blocks the supervisor), and the warm start's
socket directory is a fresh random one when every fixed name is taken or too long."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path

import pytest

from resilient_strategy.run import agent, warm


def _within(fn, seconds: float = 20.0):  # type: ignore[no-untyped-def]
    """fn() in a thread, or None (the call blocked): the test must never hang on a FIFO."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    return out[0] if out else "blocked"


def test_a_fifo_at_an_error_record_is_no_record(tmp_path: Path) -> None:
    fifo = tmp_path / "rank0.error.json"
    os.mkfifo(fifo)
    assert _within(lambda: agent._read_json(fifo)) is None


def test_an_error_record_written_by_the_worker_is_read(tmp_path: Path) -> None:
    rec = tmp_path / "rank0.error.json"
    rec.write_text('{"message": "boom"}')
    rec.chmod(0o664)  # a worker under umask 002
    assert agent._read_json(rec) == {"message": "boom"}


def test_a_fresh_socket_directory_is_private_and_short(request: pytest.FixtureRequest) -> None:
    short = Path(tempfile.mkdtemp(prefix="rs-t-", dir="/tmp"))  # pytest's tmp_path may be long
    request.addfinalizer(lambda: shutil.rmtree(short, ignore_errors=True))
    made = warm._fresh_dir("rs-run-123-m", fallback=short)
    assert made is not None and made.parent == short
    assert made.name.startswith("rs-run-123-m-")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert len(str(made)) + warm.SOCKET_NAME_CHARS <= warm.MAX_SOCKET_PATH


def test_no_socket_directory_where_even_a_fresh_one_is_too_long(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    assert warm._fresh_dir("rs-run-123-m", fallback=deep) is None
    assert list(deep.iterdir()) == []  # nothing left behind


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_squatted_socket_names_leave_a_fresh_one(tmp_path: Path,
                                                request: pytest.FixtureRequest) -> None:
    """Another user holds the fixed names (in the session's TMPDIR and in the fallback): the
    choice is a fresh random directory of this user's, not multiprocessing's pymp-* in TMPDIR
    and not a raw 'AF_UNIX path too long'."""
    long_tmp = tmp_path / ("t" * 40)
    long_tmp.mkdir()
    session = long_tmp / "rs-run-4242-m"
    session.mkdir()
    os.chown(session, 65534, 65534)
    fallback = Path(tempfile.mkdtemp(prefix="rs-t-", dir="/tmp"))  # short, as /tmp is
    request.addfinalizer(lambda: shutil.rmtree(fallback, ignore_errors=True))
    squat = fallback / session.name
    squat.mkdir()
    os.chown(squat, 65534, 65534)
    assert not any(warm._private_dir(d) for d in warm.socket_dirs(session, fallback))
    made = warm._fresh_dir(session.name, fallback=fallback)
    assert made is not None and made != squat and made.stat().st_uid == os.geteuid()
