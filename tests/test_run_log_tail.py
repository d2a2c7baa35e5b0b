"""A rank's ``stderr.log`` under ``resilient-strategy run`` (issue 46, item 3): torch's elastic
agent tails it to the console (run/agent.py sets ``--tee 2``), and torch's own tailer does
``open(file)``, which waits forever on a FIFO found at that name, and with it the supervisor
(``TailLog.stop`` joins every tailer at the attempt's end).

Where the file lives: ``<TMPDIR>/rs-run-<pid>-XXXX/attempt<N>/logs/<run id>_XXXX/attempt_0/<local
rank>/stderr.log``: the session is made by ``mkdtemp`` (0700, this user's, a random name) and
checked before each attempt (`run.agent.private_tempdir` checks it without following a link),
and torch's own run directory inside it is another ``mkdtemp``. A second real user (uid 65534,
root's setuid, as tests/test_evidence_trust.py) cannot reach it to plant anything: shown from
inside a real run. Whatever does put a FIFO or a symlink there (this user's own processes) is
refused by the tailer the supervisor now hands torch (`run.agent.tail_regular_file`): shown on
torch's real ``TailLog`` with a real FIFO, in a process of its own with a deadline."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import deadline

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
OTHER_UID = 65534  # nobody
pytestmark = [pytest.mark.torch]
second_user = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="a second real user needs root (setuid); CI runs these as root")

#: torch's real TailLog over one file, with the supervisor's tailer (``ours``) or torch's own;
#: prints what it copied once ``stop()`` returned.
TAIL = textwrap.dedent("""
    import io, json, logging, sys, time
    logging.basicConfig(level=logging.WARNING)
    from torch.distributed.elastic.multiprocessing.tail_log import TailLog
    from resilient_strategy.run.agent import regular_tails
    out = io.StringIO()
    with regular_tails():
        tail = TailLog("trainer", {0: sys.argv[1]}, out, interval_sec=0.05).start()
    time.sleep(0.3)  # the tailer has looked at the file
    tail.stop()
    print(json.dumps({"stopped": True, "copied": out.getvalue()}), flush=True)
""")


def _tail(path: Path) -> dict[str, object]:
    proc = subprocess.Popen([sys.executable, "-c", TAIL, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        out, err = proc.communicate(timeout=deadline(60))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=deadline(10))
        raise AssertionError(f"the tailer of {path} never stopped") from None
    assert proc.returncode == 0, err[-2000:]
    said: dict[str, object] = json.loads(out.splitlines()[-1])
    said["stderr"] = err
    return said


def test_a_fifo_at_a_ranks_log_is_refused_and_the_tail_stops(tmp_path: Path) -> None:
    """Before (torch's own tailer): ``open()`` of the FIFO waits for a writer forever, and
    ``stop()`` with it."""
    fifo = tmp_path / "stderr.log"
    os.mkfifo(fifo)
    said = _tail(fifo)
    assert said["stopped"] is True and said["copied"] == ""
    assert "not a regular file" in str(said["stderr"])
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # left as found, never opened for writing


def test_a_symlink_at_a_ranks_log_is_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "secret.txt"
    elsewhere.write_text("another file's line\n")
    link = tmp_path / "stderr.log"
    link.symlink_to(elsewhere)
    said = _tail(link)
    assert said["stopped"] is True and said["copied"] == ""


def test_a_regular_log_is_still_copied(tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    log.write_text("line one\nline two\n")
    said = _tail(log)
    assert said["copied"] == "[trainer0]:line one\n[trainer0]:line two\n"


def test_torchs_own_tailer_is_put_back_after_the_attempt() -> None:
    from torch.distributed.elastic.multiprocessing import tail_log

    from resilient_strategy.run.agent import regular_tails, tail_regular_file

    before = tail_log.tail_logfile
    with regular_tails():
        assert tail_log.tail_logfile is tail_regular_file
    assert tail_log.tail_logfile is before


# ----- a second real user, from inside a real run ----------------------------------------------
#: The rank finds its stderr.log (its fd 2, which torch pointed at it), then a child of it that
#: has become uid 65534 tries to plant a FIFO there, beside it, and to reach its directory; the
#: rank prints the errno of each try (0: it worked) and the session directory's mode and owner.
PLANT = textwrap.dedent("""
    import errno, json, os, sys
    import resilient_strategy
    log = os.readlink("/proc/self/fd/2")
    session = log
    while not os.path.basename(session).startswith("rs-run-"):
        session = os.path.dirname(session)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        tried = {}
        try:
            os.setgroups([])
            os.setgid(%(uid)d)
            os.setuid(%(uid)d)
            for name, act in (
                    ("fifo_beside", lambda: os.mkfifo(log + ".planted")),
                    ("replace", lambda: os.rename(log + ".planted", log)),
                    ("unlink", lambda: os.unlink(log)),
                    ("list_session", lambda: os.listdir(session)),
                    ("fifo_in_session", lambda: os.mkfifo(os.path.join(session, "x")))):
                try:
                    act()
                    tried[name] = 0
                except OSError as exc:
                    tried[name] = exc.errno
        finally:
            os.write(w, json.dumps(tried).encode())
            os._exit(0)
    os.close(w)
    got = b""
    while chunk := os.read(r, 65536):
        got += chunk
    os.waitpid(pid, 0)
    st = os.stat(session)
    sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=8)
    print("PLANT " + json.dumps({"tried": json.loads(got), "mode": st.st_mode & 0o7777,
                                  "uid": st.st_uid, "log_regular": os.path.isfile(log)
                                  and not os.path.islink(log)}), flush=True)
    sel.shutdown()
""") % {"uid": OTHER_UID}


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A real sticky world-writable directory (1777) under a root-owned 0755 one: the run's
    TMPDIR, where the second user may create whatever it likes."""
    base = Path(tempfile.mkdtemp(prefix="rs-test-tail-", dir="/tmp"))
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


@pytest.mark.slow
@second_user
@pytest.mark.parametrize("start", ["--warm-start", "--no-warm-start"])
def test_a_second_user_cannot_plant_anything_at_a_ranks_log(shared_tmp: Path,
                                                            start: str) -> None:
    base = shared_tmp.parent
    script = base / "plant.py"
    script.write_text(PLANT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
           or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}
    env.update({"PYTHONPATH": str(ROOT / "src"), "TMPDIR": str(shared_tmp),
                "RESILIENT_STRATEGY_CACHE_DIR": str(base / "cache"), "OMP_NUM_THREADS": "1",
                "CUDA_VISIBLE_DEVICES": "", "RESILIENT_STRATEGY_TIMEOUT": "60"})
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node", "1",
         "--max-relaunches", "0", start, str(script)],
        env=env, cwd=base, capture_output=True, text=True, timeout=deadline(300), check=False)
    said = [json.loads(line.split("PLANT ", 1)[1]) for line in
            (proc.stdout + proc.stderr).splitlines() if "PLANT {" in line]
    assert said, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]  # the run finished, the log was tailed
    got = said[0]
    assert got["mode"] == 0o700 and got["uid"] == os.geteuid()
    assert got["tried"] == {name: 13 for name in (  # EACCES: each one, from the session down
        "fifo_beside", "replace", "unlink", "list_session", "fifo_in_session")}
    assert got["log_regular"] is True
