"""No file of a shared directory is unpickled (issue 46.1): torch's ``start_processes`` (the warm
start) names an error file per rank with ``tempfile``, unlinks it and, when the rank exits
non-zero, ``pickle.load``s whatever is at that name. Another real user (uid 65534, a forked
child that dropped to it) watches a real sticky ``TMPDIR`` (mode 1777) with inotify and plants a
pickle at every ``pytorch-errorfile-*`` name it sees: the supervisor (root) must never load it,
with the warm start and without, because every temporary file torch makes for the ranks lives
in the run's private session directory."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pickle
import re
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
OTHER_UID = 65534  # nobody
#: what torch and multiprocessing name in ``tempfile``'s directory for a supervisor's ranks
TORCH_NAMES = ("pytorch-errorfile-", "torchelastic_", "pymp-", "listener-", "watchdog_timer_")

pytestmark = [pytest.mark.torch]
#: the tests that need a second real user (root's setuid) watching a sticky directory (inotify)
second_user = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="a second real user needs root (setuid) and Linux (inotify); CI runs these as root")

_IN_CREATE, _IN_MOVED_TO = 0x100, 0x80
#: the name of the file ``tempfile`` writes and removes once per process, to find a usable
#: directory (each process that first asks for it: the supervisor, the fork server, ranks)
_TEMPFILE_PROBE = re.compile(r"[a-z0-9_]{8}")


class _Payload:
    """What the planted pickle runs when loaded: makes ``marker`` (a directory where only root
    may write: made, it ran as root) and hands torch a traceback's text, so that the job goes on
    as if nothing happened."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return eval, (f"__import__('os').mkdir({str(self.marker)!r}) or 'Traceback: none'",)


def _plant(path: str, payload: bytes, deadline: float) -> bool:
    """Create ``path`` as this (other) user with ``payload``, as soon as torch unlinked its own
    file of that name."""
    while time.monotonic() < deadline:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            time.sleep(0.0002)
            continue
        except OSError:
            return False
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
        return True
    return False


def _attacker(shared: Path, payload: bytes, ready_w: int, stop_r: int, report_w: int) -> None:
    """The other user's process (a forked child, never returns): watch ``shared``, plant at
    every error file's name, report what it saw on ``report_w`` when ``stop_r`` is readable."""
    seen: list[str] = []
    planted: list[str] = []
    try:
        os.setgroups([])
        os.setgid(OTHER_UID)
        os.setuid(OTHER_UID)
        libc = ctypes.CDLL(None, use_errno=True)
        ino = libc.inotify_init()
        if ino < 0 or libc.inotify_add_watch(ino, str(shared).encode(),
                                             _IN_CREATE | _IN_MOVED_TO) < 0:
            os._exit(2)
        os.write(ready_w, b"1")
        while True:
            ready, _, _ = select.select([ino, stop_r], [], [], 60.0)
            if stop_r in ready or not ready:
                break
            buf = os.read(ino, 65536)
            at = 0
            while at + 16 <= len(buf):
                _, _, _, size = struct.unpack_from("iIII", buf, at)
                name = buf[at + 16:at + 16 + size].split(b"\0", 1)[0].decode(errors="replace")
                at += 16 + size
                seen.append(name)
                if name.startswith("pytorch-errorfile-") and _plant(
                        str(shared / name), payload, time.monotonic() + 10.0):
                    planted.append(name)
        os.write(report_w, json.dumps({"seen": seen, "planted": planted}).encode())
    finally:
        os._exit(0)


@contextlib.contextmanager
def _other_user_watching(shared: Path, marker: Path) -> Iterator[dict[str, list[str]]]:
    """A second real user watching ``shared`` while the body runs; yields what it saw (filled
    in on exit)."""
    payload = pickle.dumps(_Payload(marker))
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        for fd in (ready_r, stop_w, report_r):
            os.close(fd)
        _attacker(shared, payload, ready_w, stop_r, report_w)
    for fd in (ready_w, stop_r, report_w):
        os.close(fd)
    got: dict[str, list[str]] = {}
    try:
        assert os.read(ready_r, 1) == b"1", "the other user could not watch the directory"
        yield got
    finally:
        os.close(stop_w)
        chunks = []
        while chunk := os.read(report_r, 65536):
            chunks.append(chunk)
        os.waitpid(pid, 0)
        for fd in (ready_r, report_r):
            os.close(fd)
        got.update(json.loads(b"".join(chunks) or b"{}"))


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A real sticky world-writable directory (1777) under a root-owned 0755 one."""
    if not os.path.isdir("/tmp"):
        pytest.skip("no /tmp")
    base = Path(tempfile.mkdtemp(prefix="rs-test-errfile-", dir="/tmp"))  # reachable by all
    try:
        base.chmod(0o755)
        if any(os.stat(p).st_mode & 0o001 == 0 for p in base.parents):
            pytest.skip(f"uid {OTHER_UID} cannot reach {base}")
        shared = base / "tmp"
        shared.mkdir()
        shared.chmod(0o1777)
        yield shared
    finally:
        shutil.rmtree(base, ignore_errors=True)


#: A rank that exits 1 at once, leaving no error record of ours (the agent judges the exit code
#: through torch's process context, which reads torch's error file).
EXIT_1 = "import os\nos._exit(1)\n"


@pytest.mark.parametrize("start", ["--warm-start", "--no-warm-start"])
@pytest.mark.slow
@second_user
def test_a_planted_pickle_at_torchs_error_file_name_never_runs(
        shared_tmp: Path, start: str) -> None:
    base = shared_tmp.parent
    marker = base / "planted-pickle-ran"
    script = base / "exit1.py"
    script.write_text(EXIT_1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}
    env.update({"PYTHONPATH": str(ROOT / "src"), "TMPDIR": str(shared_tmp),
                "RESILIENT_STRATEGY_CACHE_DIR": str(base / "cache"),
                "CUDA_VISIBLE_DEVICES": "", "RESILIENT_STRATEGY_TIMEOUT": "60"})
    with _other_user_watching(shared_tmp, marker) as saw:
        proc = subprocess.run(
            [sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node", "1",
             "--max-relaunches", "0", start, str(script)],
            env=env, cwd=base, capture_output=True, text=True, timeout=deadline(300), check=False)
    assert not marker.exists(), f"the other user's pickle ran as root: {saw}"
    assert proc.returncode != 0, proc.stderr[-3000:]  # the rank's exit 1 is the job's failure
    assert saw["seen"], "the watch saw nothing (not even the run's own directory)"
    # torch named nothing of the ranks' in the shared directory: only the run's own private
    # directories (the session, the fork server's socket directory) appeared there
    assert saw["planted"] == []
    assert [n for n in saw["seen"] if n.startswith(TORCH_NAMES)] == []
    assert [n for n in saw["seen"] if not n.startswith(("rs-run-", "torchinductor_"))
            and not _TEMPFILE_PROBE.fullmatch(n)] == []
    assert [p.name for p in shared_tmp.iterdir() if not p.name.startswith("torchinductor_")] \
        == []


@pytest.mark.slow
@second_user
def test_the_attacker_plants_what_it_sees(shared_tmp: Path) -> None:
    """The harness itself: a file named as torch names its error files, created in the shared
    directory by root and removed, is replaced by the other user's pickle."""
    marker = shared_tmp.parent / "ran"
    with _other_user_watching(shared_tmp, marker) as saw:
        fd, name = tempfile.mkstemp(prefix="pytorch-errorfile-", suffix=".pickle",
                                    dir=shared_tmp)  # as torch's start_processes does
        os.close(fd)
        os.unlink(name)
        deadline = time.monotonic() + 30
        while not os.path.exists(name) and time.monotonic() < deadline:
            time.sleep(0.01)
        st = os.stat(name)
    assert saw["planted"] == [os.path.basename(name)]
    assert st.st_uid == OTHER_UID
    with open(name, "rb") as fh:
        pickle.load(fh)  # as torch does
    assert marker.is_dir()


def test_tempfile_names_the_sessions_private_directory_only_during_an_attempt(
        tmp_path: Path) -> None:
    from resilient_strategy.errors import UnsafePathError
    from resilient_strategy.run.agent import TORCH_TEMP, private_tempdir

    session = tmp_path / "rs-run-1-session"
    session.mkdir(mode=0o700)
    before = tempfile.tempdir
    with private_tempdir(session / TORCH_TEMP) as where:
        assert tempfile.gettempdir() == str(where)
        assert (where.stat().st_mode & 0o777, where.stat().st_uid) == (0o700, os.geteuid())
        fd, name = tempfile.mkstemp(prefix="pytorch-errorfile-")  # as torch names one
        os.close(fd)
        assert Path(name).parent == where
    assert tempfile.tempdir == before
    # a symlink in its place (to a directory of ours elsewhere) is refused, nothing changed
    shutil.rmtree(session / TORCH_TEMP)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (session / TORCH_TEMP).symlink_to(elsewhere)
    with pytest.raises(UnsafePathError), private_tempdir(session / TORCH_TEMP):
        pass
    assert tempfile.tempdir == before
    # so is a session others may write to
    (session / TORCH_TEMP).unlink()
    session.chmod(0o777)
    with pytest.raises(UnsafePathError), private_tempdir(session / TORCH_TEMP):
        pass
    assert tempfile.tempdir == before and not (session / TORCH_TEMP).exists()
