"""How a probe worker starts (`forkserver.Starter`): forked from the deciding process where it is
fit, else a fresh interpreter; either way its own environment and session, stopped like any
worker, no orphans."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

from resilient_strategy.core.measures.probe import OK, TIMEOUT
from resilient_strategy.probing import forkserver as _forkserver
from resilient_strategy.probing import proc as _proc

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.torch]
FAULT = "RESILIENT_STRATEGY_PROBE_FAULT"
SRC = str(Path(__file__).resolve().parents[1] / "src")
TESTS = str(Path(__file__).resolve().parent)


def _command(tmp_path: Path, code: str = "import sys; sys.exit(0)") -> _proc.WorkerCommand:
    return _proc.WorkerCommand(argv=(sys.executable, "-c", code), env=dict(os.environ),
                               cwd=str(tmp_path), report_path=str(tmp_path / "r.json"))


def test_the_starter_forks_only_torch_in_this_interpreter_switched_on() -> None:
    env = {k: v for k, v in os.environ.items() if k != _forkserver.FORKSERVER_VAR}
    assert _forkserver.Starter("torch", env).fork
    assert not _forkserver.Starter("tensorflow", env).fork  # threads at import: never forked
    assert not _forkserver.Starter("torch", env, python="/other/python").fork
    for off in ("0", "false"):
        assert not _forkserver.Starter("torch", {**env, _forkserver.FORKSERVER_VAR: off}).fork


def test_a_refused_fork_starts_this_and_every_later_worker_fresh(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def refused(module: str, *a: Any) -> Any:
        asked.append(module)
        raise _forkserver.ForkRefused("the test's refusal")

    monkeypatch.setattr(_forkserver, "fork_here", refused)
    starter = _forkserver.Starter("torch", {})
    cmd = _proc.WorkerCommand(argv=(sys.executable, "-m", "json.tool", "--help"),
                              env=dict(os.environ), cwd=str(tmp_path),
                              report_path=str(tmp_path / "r.json"))
    procs = [starter(cmd, str(tmp_path / f"{i}.out"), str(tmp_path / f"{i}.err"))
             for i in range(2)]
    assert [type(p) for p in procs] == [subprocess.Popen, subprocess.Popen]
    assert asked == ["json.tool"] and starter.refused  # asked once, for the first worker
    assert [p.wait(timeout=deadline(60)) for p in procs] == [0, 0]


def test_a_fork_that_fails_falls_back_to_a_fresh_process(tmp_path: Path) -> None:
    """An OSError from the starter (a fork the kernel refused: out of processes or memory)."""
    def failing(cmd: _proc.WorkerCommand, out: str, err: str) -> _proc.Proc:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    group = _proc.run_group([_command(tmp_path, "import sys; sys.exit(3)")], deadline(60),
                            spawn=failing)
    assert [o.returncode for o in group.outcomes] == [3]


# -- forked from the deciding process itself (forkserver.fork_here) -------------------------------

HERE = r'''
import json, os, sys, threading
sys.path.insert(0, sys.argv[1])
from resilient_strategy.core.measures.probe import ProbeSpec
from resilient_strategy.probing import forkserver, proc
from resilient_strategy.probing.prober import run_probe
mode = sys.argv[2]
if mode == "omp":  # an OpenMP pool started before the decision (a child forked so hangs)
    import torch
    torch.set_num_threads(2)
    x = torch.randn(1500, 1500)
    (x @ x).sum()
if mode == "thread":
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
parents = []
real = proc.start_worker
def start_worker(*a, **k):
    p = real(*a, **k)
    stat = open(f"/proc/{p.pid}/stat").read().rpartition(")")[2].split()
    parents.append((type(p).__name__, int(stat[1]), p.pid))
    return p
proc.start_worker = start_worker
spec = ProbeSpec("torch:gloo:cpu", "torch", "gloo", (), world_size=2, timeout_s=60.0,
                 message_bytes=1 << 16)
env = {k: v for k, v in os.environ.items() if k != "RESILIENT_STRATEGY_PROBE_FAULT"}
if mode == "omp":  # the worker keeps the pool's 2 threads (it sets its own only without this)
    env["OMP_NUM_THREADS"] = "2"
if mode == "off":
    env["RESILIENT_STRATEGY_FORKSERVER"] = "0"
if mode == "hang":
    env["RESILIENT_STRATEGY_PROBE_FAULT"] = "hang:1"
    spec = ProbeSpec("torch:gloo:cpu", "torch", "gloo", (), world_size=2, timeout_s=8.0,
                     message_bytes=1 << 16)
res = run_probe(spec, env)
if mode == "thread":
    stop.set()
def alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
groups = [pid for _, _, pid in parents if alive(pid)]  # each worker's whole group stopped
sys.path.insert(0, sys.argv[3])  # tests/: a process that exits while /proc is read is absent
from conftest import children_of
left = children_of(os.getpid())
print(json.dumps({"status": res.status, "parents": parents, "me": os.getpid(), "left": left,
                  "groups": groups, "torch_here": "torch" in sys.modules}))
'''


@pytest.mark.parametrize("mode", ["plain", "omp", "thread", "hang", "off"])
def test_probe_workers_fork_from_the_deciding_process_where_it_is_fit(
        tmp_path: Path, mode: str) -> None:
    """Where the deciding process may fork (its only thread, no GPU driver, an OpenMP pool
    released first), the workers are its own forked children; with another thread running, or
    switched off, they are fresh interpreters. Either way each is its own session, stopped as a
    whole group on a hang, and reaped: nothing is left."""
    script = tmp_path / "here.py"
    script.write_text(HERE)
    env = {k: v for k, v in os.environ.items() if k not in (FAULT, _forkserver.FORKSERVER_VAR)}
    env["PYTHONPATH"] = SRC
    out = subprocess.run([sys.executable, str(script), str(tmp_path), mode, TESTS], env=env,
                         capture_output=True, text=True, timeout=deadline(120), check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["status"] == (TIMEOUT if mode == "hang" else OK)
    assert seen["left"] == [] and seen["groups"] == []  # every worker reaped, its group gone
    assert len(seen["parents"]) == 2
    assert all(parent == seen["me"] for _, parent, _ in seen["parents"])  # our own children
    kinds = {kind for kind, _, _ in seen["parents"]}  # ChildProc: forked here; Popen: fresh
    assert kinds == ({"Popen"} if mode in ("thread", "off") else {"ChildProc"})
    if mode not in ("thread", "off"):
        assert seen["torch_here"]


def test_no_fork_here_with_a_gpu_driver_started(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    line = "7f0000000000-7f0000001000 r-xp 00000000 08:01 42 {}\n"
    maps.write_text(line.format("/usr/lib/x86_64-linux-gnu/libc.so.6"))
    assert _forkserver.driver_started(str(maps)) == ""
    # a driver that cannot be asked whether it was started counts as started
    maps.write_text(maps.read_text() + line.format(str(tmp_path / "libcuda.so.580.1")))
    assert _forkserver.driver_started(str(maps)) != ""  # refused
    maps.write_text(line.format("/opt/rocm/lib/libamdhip64.so.6"))
    assert _forkserver.driver_started(str(maps)) != ""
    assert _forkserver.driver_started(str(tmp_path / "nothing")) != ""
    assert _forkserver.release_openmp(str(maps)) == ""  # no OpenMP runtime: nothing to release


def test_no_fork_here_once_tensorflow_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    for name in _forkserver.THREADED_AT_IMPORT:
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert _forkserver.framework_threads() == ""
    monkeypatch.setitem(sys.modules, "tensorflow", types.ModuleType("tensorflow"))
    assert _forkserver.framework_threads() != ""  # refused (why_not_here asks it)


def test_no_fork_here_beside_another_python_thread() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert _forkserver.why_not_here() != ""  # refused
    finally:
        stop.set()
        thread.join()


def _tasks(root: Path, names: list[str]) -> str:
    for tid, name in enumerate(names, start=100):
        (root / str(tid)).mkdir(parents=True)
        (root / str(tid) / "comm").write_text(name + "\n")
    return str(root)


def test_no_fork_here_once_autograd_s_device_threads_run(tmp_path: Path) -> None:
    """A backward pass on a torch with an accelerator starts autograd's device threads (named
    pt_autograd_<device>); a child forked after it dies in its first backward ("Unable to handle
    autograd's threading in combination with fork-based multiprocessing": a probe failed so,
    seen on an H200 host, and the decision fell back to one CPU process). Read from the names."""
    plain = _tasks(tmp_path / "plain", ["python", "python", "python"])  # OpenMP's pool
    assert _forkserver.autograd_threads(plain) == ""
    started = _tasks(tmp_path / "started", ["python", "pt_autograd_0", "pt_autograd_1"])
    assert _forkserver.autograd_threads(started) != ""  # refused (why_not_here asks it)
    assert _forkserver.autograd_threads(str(tmp_path / "absent")) == ""
