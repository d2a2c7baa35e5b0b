"""The fork server: torch imported once, workers forked per probe with their own environment and
session, stopped like any worker, no orphans; fresh interpreters when it is off or gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

from resilient_strategy.core.measures.probe import OK, TIMEOUT, ProbeSpec
from resilient_strategy.probing import forkserver as _forkserver
from resilient_strategy.probing import proc as _proc
from resilient_strategy.probing.prober import run_probe

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.torch]
FAULT = "RESILIENT_STRATEGY_PROBE_FAULT"
SRC = str(Path(__file__).resolve().parents[1] / "src")
TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture
def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in (FAULT, _forkserver.FORKSERVER_VAR)}


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Every worker the fork server forked during the test (servers fresh, and closed after; the
    deciding process never forks them itself here)."""
    _forkserver.close_all()
    monkeypatch.setattr(_forkserver, "why_not_here", lambda maps="": "the server's tests")
    seen: list[Any] = []
    real = _forkserver.ForkServer.spawn

    def spawn(self: _forkserver.ForkServer, *a: Any, **k: Any) -> _forkserver.ForkedProc:
        seen.append(real(self, *a, **k))
        return seen[-1]

    monkeypatch.setattr(_forkserver.ForkServer, "spawn", spawn)
    yield seen
    _forkserver.close_all()


def gone(pid: int, within_s: float = 5.0) -> bool:
    """Exited: no such process, or a zombie its parent has not reaped yet."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                if f.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def gloo(**kw: Any) -> ProbeSpec:
    return ProbeSpec("torch:gloo:cpu", "torch", "gloo", (), world_size=2, timeout_s=60.0,
                     message_bytes=1 << 20, **kw)


def test_probes_fork_from_one_server_with_their_own_environment(
        env: dict[str, str], spawned: list[Any]) -> None:
    first = run_probe(gloo(env=(("NCCL_DEBUG", "WARN"),)), env)
    second = run_probe(ProbeSpec("torch:cpu", "torch", "cpu", (), timeout_s=60.0), env)
    assert first.status == OK and second.status == OK, first.why() + second.why()
    assert len(spawned) == 3  # two ranks, then the CPU probe, all forked
    servers = list(_forkserver.FORK_SERVERS.servers.values())
    assert len(servers) == 1 and servers[0].alive
    for p in spawned:  # each was its own session, reaped by the server
        assert p.returncode == 0
        with pytest.raises(ProcessLookupError):
            os.killpg(p.pid, 0)


def test_a_forked_hang_is_stopped_and_reaped(env: dict[str, str], spawned: list[Any]) -> None:
    res = run_probe(gloo(), {**env, FAULT: "hang:1"})
    assert res.status == TIMEOUT and dict(res.extra)["hang"] == "straggler"
    assert len(spawned) == 2
    for p in spawned:
        assert p.returncode is not None  # stopped by the runner, reaped by the server
        with pytest.raises(ProcessLookupError):
            os.killpg(p.pid, 0)


def test_switched_off_starts_fresh_interpreters(env: dict[str, str], spawned: list[Any]) -> None:
    res = run_probe(gloo(), {**env, _forkserver.FORKSERVER_VAR: "0"})
    assert res.status == OK and spawned == []


def test_a_server_that_cannot_start_falls_back_to_fresh_processes(
        env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*a: Any, **k: Any) -> _forkserver.ForkServer:
        raise _forkserver.ForkServerError("simulated")

    monkeypatch.setattr(_forkserver, "server_for", broken)
    monkeypatch.setattr(_forkserver, "why_not_here", lambda maps="": "the server's tests")
    seen: list[_proc.GroupOutcome] = []
    real = _proc.run_group

    def watched(*a: Any, **k: Any) -> _proc.GroupOutcome:
        seen.append(real(*a, **k))
        return seen[-1]

    monkeypatch.setattr(_proc, "run_group", watched)
    assert run_probe(gloo(), env).status == OK
    assert len(seen[-1].pids) == 2


def test_the_server_exits_when_idle_and_when_its_parent_dies(tmp_path: Path) -> None:
    code = (
        "import os, sys, time\n"
        "from resilient_strategy.probing import forkserver as _forkserver\n"
        "_forkserver.IDLE_EXIT_S = float(sys.argv[1])\n"
        "s = _forkserver.server_for(sys.executable, dict(os.environ))\n"
        "print(s.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    for idle, kill_parent in ((0.5, False), (600.0, True)):
        parent = subprocess.Popen([sys.executable, "-c", code, str(idle)], env=env,
                                  stdout=subprocess.PIPE, start_new_session=True)
        try:
            assert parent.stdout is not None
            server = int(parent.stdout.readline())
            if kill_parent:
                os.kill(parent.pid, signal.SIGKILL)
            assert gone(server, 10.0), (idle, kill_parent)
        finally:
            if parent.poll() is None:
                os.kill(parent.pid, signal.SIGKILL)
            parent.wait()
            if parent.stdout is not None:
                parent.stdout.close()


def test_a_decision_closes_the_fork_servers_it_started() -> None:
    """The decision loop finds the fork servers' module by name to close them (a name that no
    longer matched left them running after the layout moved the module)."""
    import importlib

    from resilient_strategy.deciding import decide as decide_module

    assert importlib.import_module(decide_module.FORKSERVER_MODULE) is _forkserver


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
    parents.append((type(p).__name__, int(open(f"/proc/{p.pid}/stat").read().rpartition(")")[2].split()[1])))
    return p
proc.start_worker = start_worker
spec = ProbeSpec("torch:gloo:cpu", "torch", "gloo", (), world_size=2, timeout_s=60.0,
                 message_bytes=1 << 16)
env = {k: v for k, v in os.environ.items() if k != "RESILIENT_STRATEGY_PROBE_FAULT"}
if mode == "omp":  # the worker keeps the pool's 2 threads (it sets its own only without this)
    env["OMP_NUM_THREADS"] = "2"
if mode == "hang":
    env["RESILIENT_STRATEGY_PROBE_FAULT"] = "hang:1"
    spec = ProbeSpec("torch:gloo:cpu", "torch", "gloo", (), world_size=2, timeout_s=8.0,
                     message_bytes=1 << 16)
res = run_probe(spec, env)
if mode == "thread":
    stop.set()
servers = len(forkserver.FORK_SERVERS.servers)
forkserver.close_all()  # as the decision does once its probing is over
sys.path.insert(0, sys.argv[3])  # tests/: a process that exits while /proc is read is absent
from conftest import children_of
left = children_of(os.getpid())
print(json.dumps({"status": res.status, "parents": parents, "me": os.getpid(), "left": left,
                  "servers": servers,
                  "torch_here": "torch" in sys.modules}))
'''


@pytest.mark.parametrize("mode", ["plain", "omp", "thread", "hang"])
def test_probe_workers_fork_from_the_deciding_process_where_it_is_fit(
        tmp_path: Path, mode: str) -> None:
    """Where the deciding process may fork (its only thread, no GPU driver, an OpenMP pool
    released first), the workers are its own children and no server imports torch; with another
    thread running they come from the fork server."""
    script = tmp_path / "here.py"
    script.write_text(HERE)
    env = {k: v for k, v in os.environ.items() if k not in (FAULT, _forkserver.FORKSERVER_VAR)}
    env["PYTHONPATH"] = SRC
    out = subprocess.run([sys.executable, str(script), str(tmp_path), mode, TESTS], env=env,
                         capture_output=True, text=True, timeout=deadline(120), check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["status"] == (TIMEOUT if mode == "hang" else OK)
    assert seen["left"] == []  # every worker reaped (a hung one stopped first)
    kinds = {kind for kind, _ in seen["parents"]}  # ChildProc: forked here; ForkedProc: by a server
    if mode == "thread":
        assert kinds == {"ForkedProc"} and seen["servers"] == 1
        assert all(parent != seen["me"] for _, parent in seen["parents"])
    else:
        assert kinds == {"ChildProc"} and seen["servers"] == 0 and seen["torch_here"]
        assert all(parent == seen["me"] for _, parent in seen["parents"])


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
