"""The machine around the job (issue 45, item 5): what a rank started dies with its attempt and
/dev/shm is left clean; an OOM kill is named as memory; a full disk is the machine's (75).

Before the fix, a torch job under `run` (warm start, the default) whose DataLoader has workers:
in a script without a ``__main__`` guard every worker died at the first batch ("exited
unexpectedly": the rank had inherited the fork server's start method); with a guard and a
forkserver DataLoader, a worker killed by SIGKILL left 6 processes (the rank's fork server, its
resource tracker, the other workers) and 28 ``sem.mp-*`` entries in /dev/shm after the
supervisor had ended, and nobody said "memory". A rank whose checkpoint met a full disk was the
script's error (exit 1)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import deadline

from resilient_strategy.machine import procs
from resilient_strategy.run.exitcodes import ExitCode
from resilient_strategy.run.policy import RelaunchPolicy, judge
from resilient_strategy.run.verdicts import (
    BLAME_NO_SPACE,
    RankExit,
    Verdict,
    VerdictKind,
    blame,
    classify_attempt,
    memory_killed,
)

ROOT = Path(__file__).resolve().parents[1]


# ----- pure: /proc's ids, the kernel's OOM counter ----------------------------------------------
def test_a_stat_line_gives_parent_group_and_session() -> None:
    line = "4242 (pt_data (worker)) S 4200 4100 4100 0 -1 4194560 1 0 0 0 7 3 0 0 20 0 1 0"
    assert procs.parse_ids(line) == procs.ProcIds(4242, 4200, 4100, 4100, "S")
    assert procs.parse_ids("garbage") is None
    assert procs.parse_ids("12 (x) S 1") is None


def test_a_session_outlives_its_leader_and_spares_what_is_asked() -> None:
    ids = [procs.ProcIds(10, 1, 10, 10, "S"), procs.ProcIds(11, 1, 10, 10, "S"),  # orphaned
           procs.ProcIds(12, 11, 12, 10, "R"), procs.ProcIds(13, 1, 13, 13, "S"),
           procs.ProcIds(14, 11, 10, 10, "Z"), procs.ProcIds(15, 1, 15, 10, "S")]
    assert procs.in_sessions([10], ids, spare=[15]) == [10, 11, 12]
    assert procs.in_sessions([0, -1], ids) == []  # never "every process"


def test_the_oom_kill_counter_is_read_from_v1_v2_and_vmstat() -> None:
    assert procs.parse_oom_kills("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n") == 2
    assert procs.parse_oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n") == 5
    assert procs.parse_oom_kills("pgfault 1\n") is None
    v1 = "4:memory:/job/7\n0::/\n"
    assert procs.memory_cgroup_files(v1, "/cg") == [
        "/cg/memory/job/7/memory.oom_control", "/cg/memory/memory.oom_control",
        "/cg/memory.events"]
    assert procs.memory_cgroup_files("0::/user.slice/x\n", "/cg")[0] == \
        "/cg/user.slice/x/memory.events"


# ----- pure: the verdicts ----------------------------------------------------------------------
def _raised(types: list[str], message: str, number: int | None = None) -> dict[str, object]:
    frame = {"module": "__main__", "function": "<module>", "file": "/job/train.py", "line": 9,
             "library": False}
    entry: dict[str, object] = {"types": types, "message": message, "frames": [frame]}
    if number is not None:
        entry["errno"] = number
    return {"types": types, "message": message, "chain": [entry]}


def test_a_full_disk_in_the_scripts_checkpoint_is_the_machines_and_requeues() -> None:
    """Before: blamed on the script (`user`, exit 1)."""
    error = _raised(["builtins.OSError", "builtins.Exception"],
                    "[Errno 28] No space left on device", errno.ENOSPC)
    assert blame(error).why == BLAME_NO_SPACE
    # the number alone says it (a message in another language, a wrapped one)
    assert blame(_raised(["builtins.OSError"], "Kein Speicherplatz", errno.ENOSPC)).why == \
        BLAME_NO_SPACE
    assert blame(_raised(["builtins.OSError"], "file exists", errno.EEXIST)).kind == "user"
    verdict = classify_attempt(None, [RankExit(1, 1, error)])
    assert (verdict.kind, verdict.cause, verdict.ranks) == (VerdictKind.EXIT, "no_space", (1,))
    said = judge(verdict, "torch:gloo:cpu", [], _policy())
    assert said.exit_code == ExitCode.INFRASTRUCTURE and said.action.value == "stop"


def _policy() -> RelaunchPolicy:
    return RelaunchPolicy()


def test_torchs_words_for_a_killed_dataloader_worker_name_memory() -> None:
    """A rank that left only its output (no error record) saying torch's words."""
    tail = "[rank1]: RuntimeError: DataLoader worker (pid 8945) is killed by signal: Killed.\n"
    verdict = classify_attempt(None, [RankExit(1, 1, None, stderr_tail=tail)])
    assert (verdict.kind, verdict.cause, verdict.ranks) == (VerdictKind.OOM, "host_memory", (1,))
    assert judge(verdict, "torch:gloo:cpu", [], _policy()).exit_code == ExitCode.USER_ERROR


def test_the_kernels_oom_kills_make_a_sigkilled_rank_a_memory_fault() -> None:
    exits = [RankExit(0, -9), RankExit(1, -15)]
    before = classify_attempt(None, exits)
    assert before.kind is VerdictKind.EXIT  # a bare SIGKILL: retried as transient
    after = memory_killed(before, exits, 1)
    assert (after.kind, after.cause, after.ranks) == (VerdictKind.OOM, "host_memory", (0,))
    assert memory_killed(before, exits, 0) == before  # no kill counted: no memory verdict
    # a worker that vanished under the loader (torch: "exited unexpectedly") with a kill
    error = _raised(["builtins.RuntimeError"], "DataLoader worker (pid(s) 3985) exited "
                    "unexpectedly")
    user = classify_attempt(None, [RankExit(1, 1, error)])
    assert user.kind is VerdictKind.USER
    assert memory_killed(user, [RankExit(1, 1, error)], 2).cause == "host_memory"
    assert Verdict.from_dict(after.to_dict()).checked() == Verdict.from_dict(after.to_dict())


# ----- real processes: the sweep after an attempt ----------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_sweep_kills_what_a_rank_left_and_clears_its_shared_memory(tmp_path: Path) -> None:
    """A "rank" in a session of its own forks a "worker" and exits: the orphan (reparented to
    init) is found by its session and killed; the entries it made in the shm directory are
    removed once it is gone; an entry older than the attempt and one of another name stay."""
    from resilient_strategy.probing.proc import shm_entries
    from resilient_strategy.run.agent import ATTEMPT_SHM_PREFIXES, sweep_attempt

    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "torch_old").write_bytes(b"x")
    before = shm_entries(str(shm), ATTEMPT_SHM_PREFIXES)
    pids = tmp_path / "pids"
    code = textwrap.dedent(f"""
        import os, sys, time
        pid = os.fork()
        if pid == 0:
            for name in ("torch_123_456_0", "sem.mp-abcd", "unrelated"):
                open(os.path.join({str(shm)!r}, name), "wb").close()
            with open({str(pids)!r}, "w") as fh:
                fh.write(str(os.getpid()))
            time.sleep(600)
        os._exit(0)
    """)
    rank = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    rank.wait(timeout=deadline(30))
    until = time.monotonic() + deadline(30)
    while not (pids.exists() and pids.read_text()) and time.monotonic() < until:
        time.sleep(0.05)
    orphan = int(pids.read_text())
    assert procs.alive(orphan)
    killed, removed = sweep_attempt([rank.pid], str(tmp_path / "no-decision.json"), before,
                                    str(shm), wait_s=deadline(10))
    assert killed == [orphan]
    ids = procs.read_ids(orphan)
    assert ids is None or ids.gone
    assert sorted(removed) == ["sem.mp-abcd", "torch_123_456_0"]
    assert sorted(os.listdir(shm)) == ["torch_old", "unrelated"]


# ----- end to end: run, a DataLoader worker killed -------------------------------------------
SCRIPT = """
import os, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
import resilient_strategy

class Data(Dataset):
    def __len__(self):
        return 1 << 20
    def __getitem__(self, i):
        return torch.randn(8), torch.randint(0, 2, ())

def init(_):
    with open(os.environ["WORKER_PIDS"], "a") as fh:
        fh.write(f"{os.environ['RANK']} {os.getpid()}\\n")

def main():
    sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=16)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Data(), batch_size=sel.batch_size, num_workers=2, worker_init_fn=init,
                        multiprocessing_context=os.environ.get("CTX") or None)
    model, opt, loader = sel.prepare(model, opt, loader)
    step = 0
    for x, y in loader:
        with sel.accumulate(model):
            sel.backward(torch.nn.functional.cross_entropy(model(x), y))
        step += sel.step(opt)
        time.sleep(0.05)
        if step >= int(os.environ["STEPS"]):
            break
    print("finished", sel.launch.rank)
    sel.shutdown()

#MAIN
"""


def _private_shm() -> list[str]:
    """The command prefix that runs a command with a private, empty /dev/shm (a mount
    namespace; root), or skips."""
    unshare = shutil.which("unshare")
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or unshare is None or \
            subprocess.run([unshare, "-m", "--propagation", "private", "true"],
                           capture_output=True, timeout=deadline(30)).returncode != 0:
        pytest.skip("a private /dev/shm needs root and unshare(1)")
    return [unshare, "-m", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs -o size=64m tmpfs /dev/shm && "$@"; rc=$?; '
            'ls -A /dev/shm > "$SHM_LEFT"; exit $rc', "sh"]


def _marked(marker: str) -> list[int]:
    return procs.pids_with_env({"RS_TEST_MACHINE_MARK": marker})


def _supervise(tmp: Path, guarded: bool, steps: int, kill: bool,
               **extra: str) -> tuple[subprocess.CompletedProcess[str], list[str], list[int]]:
    script = tmp / "train.py"
    script.write_text(SCRIPT.replace("#MAIN", "if __name__ == '__main__':\n    main()"
                                     if guarded else "main()"))
    marker = f"{os.getpid()}-{tmp.name}"
    (tmp / "tmp").mkdir(exist_ok=True)
    workers = tmp / "workers"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")}
    env.update({"PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": "",
                "RESILIENT_STRATEGY_CACHE_DIR": str(tmp / "cache"), "TMPDIR": str(tmp / "tmp"),
                "RESILIENT_STRATEGY_TIMEOUT": "60", "WORKER_PIDS": str(workers),
                "STEPS": str(steps), "SHM_LEFT": str(tmp / "shm-left"),
                "RS_TEST_MACHINE_MARK": marker, **extra})
    with (tmp / "out").open("wb") as out, (tmp / "err").open("wb") as err:
        sup = subprocess.Popen(
            [*_private_shm(), sys.executable, "-m", "resilient_strategy", "run",
             "--nproc-per-node", "2", "--stall-timeout", "30", "--evidence-dir",
             str(tmp / "evidence"), str(script)], env=env, cwd=tmp, stdout=out, stderr=err)
    # files, not pipes: a process the run left behind would hold a pipe open (and the test)
    try:
        if kill:  # rank 1's first worker, as the OOM killer would, once both ranks train
            until = time.monotonic() + deadline(240)
            while time.monotonic() < until and sup.poll() is None and not (
                    workers.exists() and len(workers.read_text().splitlines()) >= 4):
                time.sleep(0.1)
            victim = next(int(p) for r, p in (line.split() for line in
                                              workers.read_text().splitlines()) if r == "1")
            time.sleep(1.0)
            os.kill(victim, signal.SIGKILL)
        sup.wait(timeout=deadline(300))
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
    done = subprocess.CompletedProcess(sup.args, sup.returncode, (tmp / "out").read_text(),
                                       (tmp / "err").read_text())
    left = (tmp / "shm-left").read_text().split()
    # a process SIGKILLed by the sweep may still be dying on a loaded machine; one the run left
    # behind stays (before the fix: still alive 50 minutes later), so a bounded wait tells them
    until = time.monotonic() + deadline(20)
    alive = _marked(marker)
    while alive and time.monotonic() < until:
        time.sleep(0.2)
        alive = [p for p in _marked(marker) if procs.alive(p)]
    for pid in alive:  # what the run left: this test's own processes
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return done, left, alive


def _verdicts(tmp: Path) -> list[dict[str, object]]:
    found = list((tmp / "evidence").glob("*/attempts.json"))
    return [a["verdict"] for a in json.loads(found[0].read_text())["attempts"]] if found else []


@pytest.mark.slow
@pytest.mark.torch
def test_a_dataloader_in_a_script_without_a_main_guard_trains_under_a_warm_start(
        tmp_path: Path) -> None:
    """Before: every DataLoader worker died at the first batch (the rank had the warm start's
    fork server as its start method): exit 1, "exited unexpectedly", at step 0."""
    pytest.importorskip("torch")
    done, left, alive = _supervise(tmp_path, guarded=False, steps=6, kill=False)
    assert done.returncode == ExitCode.SUCCESS, done.stderr[-3000:]
    assert left == [] and alive == []


@pytest.mark.slow
@pytest.mark.torch
def test_a_killed_dataloader_worker_leaves_no_process_and_no_shm_and_says_memory(
        tmp_path: Path) -> None:
    """A forkserver DataLoader (its own fork server, resource tracker and semaphores), one of
    rank 1's workers SIGKILLed as the OOM killer does. Before: 6 processes of the run alive and
    28 sem.mp-* entries in /dev/shm after the supervisor ended; the verdict "user", no cause."""
    pytest.importorskip("torch")
    done, left, alive = _supervise(tmp_path, guarded=True, steps=100000, kill=True,
                                   CTX="forkserver")
    assert alive == [], done.stderr[-3000:]
    assert left == []
    assert done.returncode == ExitCode.USER_ERROR, done.stderr[-3000:]
    first = _verdicts(tmp_path)[0]
    assert first["ranks"] == [1]
    # torch's words for the kill reach the rank through the loader ("killed by signal: Killed"),
    # or its queue's reset first: memory is named when its words are there
    if "killed by signal: Killed" in done.stderr:
        assert (first["kind"], first["cause"]) == ("oom", "host_memory")
