"""run_probe: commands and environment (pure), then real probes with torch and TensorFlow on CPU.

GPU tests run only with RS_GPU_TESTS=1 on a machine with at least two CUDA GPUs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

from resilient_strategy.core.measures.probe import (
    ERROR,
    OK,
    TIMEOUT,
    ProbeResult,
    ProbeSpec,
    judged_hang,
)
from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.machine import files as _files
from resilient_strategy.probing import prober
from resilient_strategy.probing import proc as _proc
from resilient_strategy.probing.prober import build_commands, run_probe, worker_env
from resilient_strategy.records.progress import StallPolicy

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_TF = importlib.util.find_spec("tensorflow") is not None
FAULT = "RESILIENT_STRATEGY_PROBE_FAULT"


def torch_has_cuda() -> bool:
    """Read torch/version.py without importing torch (1.6 s here)."""
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    text = (Path(spec.origin).parent / "version.py").read_text()
    return re.search(r"^cuda\b.*=\s*None\s*$", text, re.M) is None


def gloo(timeout_s: float = 30.0, **kw: Any) -> ProbeSpec:
    return ProbeSpec("torch:gloo:cpu", "torch", "gloo", (), world_size=2, timeout_s=timeout_s,
                     message_bytes=4 << 20, **kw)


@pytest.fixture
def env() -> dict[str, str]:
    """The user's environment as a probe gets it: a snapshot, without a stray fault."""
    return {k: v for k, v in os.environ.items() if k != FAULT}


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[_proc.GroupOutcome]]:
    """Every GroupOutcome run_probe saw (the real runner, only watched)."""
    seen: list[_proc.GroupOutcome] = []
    real = _proc.run_group

    def watched(*args: Any, **kwargs: Any) -> _proc.GroupOutcome:
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(_proc, "run_group", watched)
    yield seen


def assert_workers_gone(group: _proc.GroupOutcome) -> None:
    for pid in group.pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)


# ------------------------------------------------------------------------------------------
# Commands and environment (no process)
# ------------------------------------------------------------------------------------------
def test_torch_commands_one_per_rank_meeting_in_the_run_directory(tmp_path: Path) -> None:
    spec = ProbeSpec("k", "torch", "nccl", (2, 3), world_size=2, timeout_s=20.0)
    cmds = build_commands(spec, {}, str(tmp_path), python="/py", parent_pid=42)
    assert len(cmds) == 2
    for rank, c in enumerate(cmds):
        argv = list(c.argv)
        assert argv[:3] == ["/py", "-m", "resilient_strategy.probing.workers.torch_worker"]
        assert argv[argv.index("--rank") + 1] == str(rank)
        assert argv[argv.index("--devices") + 1] == "2,3"
        assert argv[argv.index("--rendezvous") + 1] == str(tmp_path)  # rank 0 publishes there
        assert "--init-method" not in argv  # no file store: training never meets through one
        assert argv[argv.index("--parent-pid") + 1] == "42"
        assert float(argv[argv.index("--timeout") + 1]) > spec.timeout_s  # the runner's fires first
        assert argv[argv.index("--progress") + 1] == c.progress_path == str(
            tmp_path / f"progress-{rank}")
        assert c.cwd == str(tmp_path)
        assert argv[argv.index("--report") + 1] == c.report_path
    assert len({c.report_path for c in cmds}) == 2


def test_tensorflow_is_one_process(tmp_path: Path) -> None:
    spec = ProbeSpec("k", "tensorflow", "hierarchical_copy", (), logical_cpus=2, train_step=False)
    (c,) = build_commands(spec, {}, str(tmp_path), python="/py", parent_pid=1)
    assert c.argv[2] == "resilient_strategy.probing.workers.tf_worker"
    assert "--logical-cpus" in c.argv and "--no-train-step" in c.argv


def test_bad_specs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidOptionError):
        build_commands(ProbeSpec("k", "jax", "x", ()), {}, str(tmp_path), python="p", parent_pid=1)
    with pytest.raises(InvalidOptionError):
        build_commands(ProbeSpec("k", "torch", "nccl", (0,), world_size=2), {}, str(tmp_path),
                       python="p", parent_pid=1)


def test_worker_env_adds_candidate_and_path_and_keeps_the_users() -> None:
    user = {"PATH": "/bin", "PYTHONPATH": "/mine", "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    spec = ProbeSpec("k", "torch", "nccl", (0, 1), env=(("NCCL_P2P_DISABLE", "1"),
                                                         ("NCCL_NVLS_ENABLE", "1")))
    out = worker_env(spec, user)
    assert out == {**user, "NCCL_P2P_DISABLE": "1",
                   "PYTHONPATH": prober.PACKAGE_ROOT + os.pathsep + "/mine"}
    assert (Path(prober.PACKAGE_ROOT) / "resilient_strategy" / "probing" / "workers").is_dir()
    assert worker_env(ProbeSpec("k", "torch", "cpu", ()), {})["PYTHONPATH"] == prober.PACKAGE_ROOT


def test_worker_env_quiets_tensorflow_unless_the_user_chose() -> None:
    spec = ProbeSpec("k", "tensorflow", "cpu", ())
    assert worker_env(spec, {})["TF_CPP_MIN_LOG_LEVEL"] == "2"
    assert worker_env(spec, {"TF_CPP_MIN_LOG_LEVEL": "0"})["TF_CPP_MIN_LOG_LEVEL"] == "0"
    assert "TF_CPP_MIN_LOG_LEVEL" not in worker_env(ProbeSpec("k", "torch", "cpu", ()), {})


def test_a_python_that_cannot_start_is_an_error_result(env: dict[str, str]) -> None:
    res = run_probe(ProbeSpec("k", "torch", "cpu", ()), env, python="/nonexistent/python")
    assert (res.status, res.cause) == (ERROR, "worker_error")
    assert "could not start" in res.detail


# ------------------------------------------------------------------------------------------
# torch on this machine's CPU
# ------------------------------------------------------------------------------------------
@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_gloo_two_processes_on_cpu(env: dict[str, str], groups: list[_proc.GroupOutcome]) -> None:
    res = run_probe(gloo(), env)
    assert res.status == OK, res.why() + "\n" + res.stderr_tail
    assert res.ranks == 2
    assert res.bus_bandwidth_gbps is not None and res.bus_bandwidth_gbps > 0
    assert res.message_bytes == 4 << 20
    assert res.step_seconds is not None and res.step_seconds > 0
    assert "all-reduce exact" in res.detail
    # where the time went, in the order the worker went: up, torch, gloo, checks, step
    names = [name for name, _ in res.phases]
    for earlier, later in (("started", "imported"), ("imported", "comm_ready"),
                           ("comm_ready", "checked"), ("checked", "measured"),
                           ("measured", "stepped")):
        assert names.index(earlier) <= names.index(later)
    assert all(0 <= s <= res.elapsed_s for _, s in res.phases)
    assert ProbeResult.from_dict(res.to_dict()) == res
    assert_workers_gone(groups[-1])


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_nccl_on_a_cpu_build_fails_fast(
        env: dict[str, str], groups: list[_proc.GroupOutcome]) -> None:
    if torch_has_cuda():
        pytest.skip("this torch has CUDA")
    spec = ProbeSpec("torch:nccl", "torch", "nccl", (0, 1), world_size=2, timeout_s=30.0)
    res = run_probe(spec, env)
    assert (res.status, res.cause) == (ERROR, "backend_unavailable")
    assert not any(g.timed_out for g in groups)  # ended by the error, not the deadline


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
@pytest.mark.parametrize(("fault", "kind", "where", "ranks"), [
    ("hang:1", "straggler", "collective 1", "1"),  # before the collective: rank 0 waits in it
    ("hang_collective:1", "collective", "collective 1", "0,1"),  # inside it
    ("hang_setup:1", "setup", "communicator setup", "0,1"),  # inside communicator setup
])
def test_each_phase_of_a_hang_is_cut_from_progress_and_every_worker_is_gone(
    fault: str, kind: str, where: str, ranks: str,
    env: dict[str, str], groups: list[_proc.GroupOutcome]
) -> None:
    spec = gloo(timeout_s=60.0)
    res = run_probe(spec, {**env, FAULT: fault})
    assert (res.status, res.cause) == (TIMEOUT, "timeout")
    extra = dict(res.extra)
    assert (extra["hang"], extra["hang_at"], extra["hang_ranks"]) == (kind, where, ranks)
    assert judged_hang(res)
    # cut at its judged limit (plus spawn and import), far inside the 60 s deadline
    assert float(extra["hang_waited_s"]) >= float(extra["hang_limit_s"])
    assert "rank 1 hangs" in res.stderr_tail
    group = groups[-1]
    assert group.stall is not None and not group.timed_out
    assert_workers_gone(group)


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_the_deadline_still_bounds_a_probe_that_reports_no_progress(
    env: dict[str, str], groups: list[_proc.GroupOutcome], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a hang during import (never judged: a generous allowance) ends at the deadline
    monkeypatch.setattr(prober, "stall_policy",
                        lambda spec, env=None: StallPolicy(
                            arrive_grace_s=1e9, setup_grace_s=1e9, collective_base_s=1e9,
                            quiet_s=None))
    res = run_probe(gloo(timeout_s=8.0), {**env, FAULT: "hang:1"})
    assert (res.status, res.cause) == (TIMEOUT, "timeout")
    assert not judged_hang(res)
    assert 8.0 <= res.elapsed_s < 8.0 + 5.0
    assert groups[-1].timed_out and groups[-1].stall is None
    assert_workers_gone(groups[-1])


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_a_rank_that_exits_gets_its_peer_killed_at_once(
    env: dict[str, str], groups: list[_proc.GroupOutcome]
) -> None:
    spec = gloo(timeout_s=30.0)
    res = run_probe(spec, {**env, FAULT: "exit:1"})
    assert res.status == ERROR
    assert res.detail.startswith("rank 1 exited with code 1"), res.detail
    assert not groups[-1].timed_out  # stopped by the exit, not the deadline
    rank0 = groups[-1].outcomes[0]
    assert rank0.killed_by_runner or rank0.returncode == 1  # stopped, or failed on the reset
    assert_workers_gone(groups[-1])


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_a_corrupted_contribution_is_a_wrong_result(env: dict[str, str]) -> None:
    res = run_probe(gloo(train_step=False), {**env, FAULT: "wrong:1"})
    assert (res.status, res.cause) == (ERROR, "wrong_result")
    assert "index 512" in res.detail


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
@pytest.mark.parametrize(("fault", "cause"), [("nan:1", "nan_result"), ("zero:0", "zero_result")])
def test_nan_and_zero_results_are_their_own_causes(
        fault: str, cause: str, env: dict[str, str]) -> None:
    res = run_probe(gloo(train_step=False), {**env, FAULT: fault})
    assert (res.status, res.cause) == (ERROR, cause)
    assert res.detail.startswith("rank ")


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_a_healthy_probe_checks_every_size_ddp_sends(
        env: dict[str, str], groups: list[_proc.GroupOutcome]) -> None:
    bucket = (3 << 20) + 4  # an odd size, as a real model's largest bucket is
    res = run_probe(gloo(check_bytes=(bucket,)), env)
    assert res.status == OK, res.why() + res.stderr_tail
    assert "all-reduce exact at 5 sizes (4 KiB..25 MiB) x3" in res.detail
    assert groups[-1].stall is None


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
@pytest.mark.parametrize(("use_libuv", "store"), [
    (None, "TCPStore libuv"),  # torch's default transport (>= 2.4), as torchrun's store has it
    ("0", "TCPStore"),  # the user's USE_LIBUV=0 is what training will use: the probe follows
])
def test_the_ranks_meet_in_a_tcp_store_as_a_training_group_does(
        use_libuv: str | None, store: str, env: dict[str, str],
        groups: list[_proc.GroupOutcome]) -> None:
    env = {k: v for k, v in env.items() if k != "USE_LIBUV"}
    if use_libuv is not None:
        env["USE_LIBUV"] = use_libuv
    res = run_probe(gloo(train_step=False), env)
    assert res.status == OK, res.why() + res.stderr_tail
    assert ("rendezvous", store) in res.extra
    # every collective training issues was proven, after the all-reduces
    names = [name for name, _ in res.phases]
    assert names.index("checked") < names.index("collectives")
    assert_workers_gone(groups[-1])


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
@pytest.mark.parametrize(("fault", "hang"), [
    ("hang_rendezvous:0", "setup"),  # rank 0 never publishes its store: rank 1 waits for it
    ("hang_broadcast:1", "collective"),
    ("hang_gather:0", "collective"),
])
def test_a_hung_rendezvous_broadcast_or_all_gather_is_a_judged_hang(
        fault: str, hang: str, env: dict[str, str], groups: list[_proc.GroupOutcome]) -> None:
    res = run_probe(gloo(timeout_s=60.0, train_step=False), {**env, FAULT: fault})
    assert (res.status, res.cause) == (TIMEOUT, "timeout")
    assert judged_hang(res) and dict(res.extra)["hang"] == hang
    group = groups[-1]
    assert group.stall is not None and not group.timed_out  # cut from progress, not the deadline
    assert_workers_gone(group)


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("fault", ["wrong_broadcast:1", "wrong_gather:0"])
def test_a_wrong_value_from_a_broadcast_or_all_gather_is_a_wrong_result(
        fault: str, env: dict[str, str]) -> None:
    res = run_probe(gloo(train_step=False), {**env, FAULT: fault})
    assert (res.status, res.cause) == (ERROR, "wrong_result")
    assert res.detail.startswith(f"rank {fault[-1]}")


# ------------------------------------------------------------------------------------------
# TensorFlow on two logical CPU devices
# ------------------------------------------------------------------------------------------
@pytest.mark.tensorflow
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TF, reason="tensorflow is not installed")
@pytest.mark.parametrize(("backend", "status"), [
    ("nccl", ERROR), ("hierarchical_copy", OK), ("reduction_to_one_device", OK),
])
def test_tensorflow_on_logical_cpus(backend: str, status: str, env: dict[str, str]) -> None:
    spec = ProbeSpec(f"tensorflow:{backend}", "tensorflow", backend, (), logical_cpus=2,
                     timeout_s=60.0, message_bytes=4 << 20)
    res = run_probe(spec, env)
    assert res.status == status, res.why() + "\n" + res.stderr_tail
    if status == OK:
        assert res.bus_bandwidth_gbps is not None and res.bus_bandwidth_gbps > 0
        assert res.step_seconds is not None and res.step_seconds > 0
        assert "2 replica(s)" in res.detail
        # where the time went: TF imported, the strategy built, checks, bandwidth, Keras step
        names = [name for name, _ in res.phases]
        for earlier, later in (("imported", "comm_ready"), ("comm_ready", "checked"),
                               ("checked", "measured"), ("measured", "stepped")):
            assert names.index(earlier) <= names.index(later)
    else:
        assert res.cause == "backend_unavailable"
        assert "NcclAllReduce" in res.detail


@pytest.mark.tensorflow
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TF, reason="tensorflow is not installed")
@pytest.mark.parametrize(("fault", "status", "cause", "hang"), [
    ("hang:0", TIMEOUT, "timeout", "quiet"),  # ready, then silent before the first all-reduce
    ("hang_setup:0", TIMEOUT, "timeout", "setup"),
    ("nan:1", ERROR, "nan_result", None),
])
def test_tensorflow_hangs_are_cut_and_bad_values_named(
        fault: str, status: str, cause: str, hang: str | None, env: dict[str, str],
        groups: list[_proc.GroupOutcome]) -> None:
    spec = ProbeSpec("tensorflow:hierarchical_copy", "tensorflow", "hierarchical_copy", (),
                     logical_cpus=2, timeout_s=60.0, message_bytes=4 << 20)
    res = run_probe(spec, {**env, FAULT: fault})
    assert (res.status, res.cause) == (status, cause), res.why() + res.stderr_tail
    assert dict(res.extra).get("hang") == hang
    assert not groups[-1].timed_out  # cut from progress or ended by the error, not the deadline


# ------------------------------------------------------------------------------------------
# Real GPUs (RS_GPU_TESTS=1 and two CUDA GPUs)
# ------------------------------------------------------------------------------------------
def need_two_gpus() -> None:
    if os.environ.get("RS_GPU_TESTS") != "1":
        pytest.skip("set RS_GPU_TESTS=1 on a machine with 2 CUDA GPUs")
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")


def nccl(timeout_s: float, **kw: Any) -> ProbeSpec:
    return ProbeSpec("torch:nccl:0,1", "torch", "nccl", (0, 1), world_size=2,
                     timeout_s=timeout_s, **kw)


@pytest.mark.gpu
@pytest.mark.torch
@pytest.mark.slow
def test_gpu_nccl_healthy(env: dict[str, str], groups: list[_proc.GroupOutcome]) -> None:
    need_two_gpus()
    res = run_probe(nccl(60.0), env)
    assert res.status == OK, res.why() + "\n" + res.stderr_tail
    assert res.bus_bandwidth_gbps is not None and res.bus_bandwidth_gbps > 1.0
    assert res.step_seconds is not None
    assert_workers_gone(groups[-1])


@pytest.mark.gpu
@pytest.mark.torch
@pytest.mark.slow
def test_gpu_nccl_bogus_algo_fails_fast(
    env: dict[str, str], groups: list[_proc.GroupOutcome]
) -> None:
    need_two_gpus()
    spec = nccl(60.0, env=(("NCCL_ALGO", "bogus"),))
    res = run_probe(spec, {k: v for k, v in env.items() if k != "NCCL_ALGO"})
    assert (res.status, res.cause) == (ERROR, "nccl_invalid_usage"), res.why()
    assert not groups[-1].timed_out  # ended by the error, not the deadline
    assert_workers_gone(groups[-1])


@pytest.mark.gpu
@pytest.mark.torch
@pytest.mark.slow
def test_gpu_nccl_unroutable_sockets_end_within_the_deadline(
    env: dict[str, str], groups: list[_proc.GroupOutcome]
) -> None:
    need_two_gpus()
    broken = (("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1"),
              ("NCCL_SOCKET_IFNAME", "nonexistent0"))
    spec = nccl(30.0, env=broken)
    res = run_probe(spec, {k: v for k, v in env.items() if k not in dict(broken)})
    assert res.status in (ERROR, TIMEOUT)
    assert res.elapsed_s < spec.timeout_s + 6.0  # deadline plus the bounded kill
    assert_workers_gone(groups[-1])



# ----- temporary directories after a signal ----------------------------------------------------
_PARENT = """
import os, sys, tempfile
from resilient_strategy.probing import prober
from resilient_strategy.probing import proc as _proc
from resilient_strategy.core.measures.probe import ProbeSpec
tempfile.tempdir, marker = sys.argv[1], os.environ["RS_MARKER"]
worker = ("from resilient_strategy.probing.workers.watchdog import watch_parent; "
          "watch_parent({}); import time; time.sleep(60)")
def sleepers(spec, env, workdir, *, python, parent_pid):
    code = worker.format(parent_pid)
    return [_proc.WorkerCommand((python, "-c", code, marker), dict(os.environ), workdir,
                                os.path.join(workdir, f"report-{i}.json")) for i in range(2)]
prober.build_commands = sleepers  # the real runner and directories, workers that just wait
print("started", flush=True)
prober.run_probe(ProbeSpec("torch:gloo:cpu", "torch", "gloo", (), world_size=2,
                           timeout_s=60.0), dict(os.environ))
print("not reached", flush=True)
"""


def _with_marker(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes() \
                    and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _wait_for(cond: Any, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.05)
    return bool(cond())


def _probe_in_a_child(tmp_path: Path, sig: signal.Signals) -> int:
    marker = f"rs-test-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": prober.PACKAGE_ROOT, "RS_MARKER": marker}
    with subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path)], env=env,
                          stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
            assert _wait_for(lambda: len(_with_marker(marker)) == 2, 20)
            assert len(list(tmp_path.glob("rs-*"))) == 2  # rs-probe-<pid>-*, rs-proc-<pid>-*
            proc.send_signal(sig)
            assert proc.wait(timeout=deadline(20)) == -sig
            assert "not reached" not in proc.stdout.read()
            assert _wait_for(lambda: _with_marker(marker) == [], 10)  # no orphan either way
        finally:
            for pid in _with_marker(marker):
                os.kill(pid, signal.SIGKILL)
    return proc.pid


@pytest.mark.slow
def test_sigterm_mid_probe_leaves_no_temporary_directory(tmp_path: Path) -> None:
    _probe_in_a_child(tmp_path, signal.SIGTERM)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_next_run_sweeps_what_a_sigkill_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid = _probe_in_a_child(tmp_path, signal.SIGKILL)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert [n.split("-")[1:3] for n in left] == [["probe", str(pid)], ["proc", str(pid)]]
    mine_alive = tmp_path / f"rs-probe-{os.getpid()}-running"  # a live run's: left alone
    mine_alive.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(_files, "SWEEP_AFTER_S", 0.0)  # else only after 10 minutes untouched
    monkeypatch.setattr(_files, "TEMP_SWEEP", _files.TempSweep())
    ok = "import json, sys; json.dump({'status': 'ok'}, open(sys.argv[1], 'w'))"
    monkeypatch.setattr(prober, "build_commands", lambda spec, env, workdir, **_: [
        _proc.WorkerCommand((sys.executable, "-c", ok, f"{workdir}/r.json"), dict(os.environ),
                            workdir, f"{workdir}/r.json")])
    res = run_probe(ProbeSpec("torch:gloo:cpu", "torch", "gloo", (), timeout_s=30.0), os.environ)
    assert res.status == OK
    assert [p.name for p in tmp_path.iterdir()] == [mine_alive.name]


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_a_wrong_value_floored_at_a_size_is_injected_there_only(env: dict[str, str]) -> None:
    """``wrong:1:gloo:>=N`` corrupts only all-reduces of N bytes and more: floored above every
    size the probe checks, the probe passes; floored at 2 MiB (the 4 MiB all-reduce and DDP's
    25 MiB bucket are checked), it is caught."""
    spec = gloo(60.0, train_step=False)
    floored = run_probe(spec, {**env, FAULT: f"wrong:1:gloo:>={256 << 20}"})
    assert floored.status == OK
    caught = run_probe(spec, {**env, FAULT: f"wrong:1:gloo:>={2 << 20}"})
    assert caught.status != OK and caught.cause == "wrong_result"


@pytest.mark.tensorflow
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TF, reason="tensorflow is not installed")
def test_a_tensorflow_probe_leaves_no_autograph_files_in_the_temp_dir(
        env: dict[str, str], tmp_path: Path) -> None:
    spec = ProbeSpec("tensorflow:hierarchical_copy", "tensorflow", "hierarchical_copy", (),
                     logical_cpus=2, timeout_s=60.0, message_bytes=1 << 20)
    res = run_probe(spec, {**env, "TMPDIR": str(tmp_path)})  # the worker's temp dir
    assert res.status == OK, res.why() + "\n" + res.stderr_tail
    assert sorted(p.name for p in tmp_path.iterdir()) == []


class _LaggingPoll:
    """A worker whose exit the runner sees late: ``poll()`` says "running" until ``other`` has
    exited (the runner's sweep of polls, where an echo can be seen exit first)."""

    def __init__(self, proc: Any, other: list[Any]) -> None:
        self._proc, self._other, self._lagged = proc, other, False

    def poll(self) -> int | None:
        if not self._other or self._other[0].poll() is None:
            return None
        if not self._lagged:  # the sweep that sees the other exit still sees this one running
            self._lagged = True
            return None
        return self._proc.poll()  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._proc, name)


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_the_rank_that_found_zeros_is_blamed_when_its_echo_is_seen_exit_first(
        env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    # zero:0: rank 0 finds zeros and exits; rank 1 then fails in the next all-reduce
    # ("connection reset"). The runner is made to see rank 1's exit first, which is how the
    # suite saw `worker_error` now and then.
    real_start = _proc.start_worker
    started: list[Any] = []
    rank1: list[Any] = []

    def start(cmd: Any, out: Path, err: Path, spawn: Any) -> Any:
        proc = real_start(cmd, out, err, spawn)
        if not started:
            started.append(proc)
            return _LaggingPoll(proc, rank1)
        rank1.append(proc)
        return proc

    monkeypatch.setattr(_proc, "start_worker", start)
    res = run_probe(gloo(train_step=False), {**env, FAULT: "zero:0"})
    assert (res.status, res.cause) == (ERROR, "zero_result"), res.detail
    assert res.detail.startswith("rank 0")


def _listening_addresses(port: int) -> list[str]:
    """The local addresses of the sockets listening on ``port`` (``/proc/net/tcp{,6}``, as the
    kernel has them: hex, e.g. ``0100007F`` for 127.0.0.1, 32 zeros for ``::``)."""
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as fh:
            for line in fh.read().splitlines()[1:]:
                fields = line.split()
                address, _, hex_port = fields[1].rpartition(":")
                if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    found.append(address)
    return found


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs /proc/net/tcp")
@pytest.mark.parametrize("use_libuv", [None, "0"])
def test_the_probe_store_listens_on_loopback_only(
        use_libuv: str | None, env: dict[str, str]) -> None:
    """Issue 46, item 2: every worker of a probe runs on this host, so rank 0's TCPStore takes
    no connection from another host. Before: torch's server listened on every interface
    (``::``) whatever its host name said (torch 2.13, both servers). Read while the probe runs
    (rank 1 hangs in its broadcast: the store stays up until the hang is judged)."""
    import threading

    env = {k: v for k, v in env.items() if k != "USE_LIBUV"}
    if use_libuv is not None:
        env["USE_LIBUV"] = use_libuv
    mine = set(Path(tempfile.gettempdir()).glob(f"rs-probe-{os.getpid()}-*"))
    done: list[ProbeResult] = []
    probe = threading.Thread(target=lambda: done.append(run_probe(
        gloo(timeout_s=60.0, train_step=False), {**env, FAULT: "hang_broadcast:1"})))
    probe.start()
    seen: list[str] = []
    try:
        end = time.monotonic() + deadline(120)
        while not seen and probe.is_alive() and time.monotonic() < end:
            for where in set(Path(tempfile.gettempdir()).glob(f"rs-probe-{os.getpid()}-*")) - mine:
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    port = json.loads((where / "store-port.json").read_text())["port"]
                    seen = _listening_addresses(port)
            time.sleep(0.01)
    finally:
        probe.join(timeout=deadline(180))
    assert not probe.is_alive()
    assert seen == ["0100007F"]  # 127.0.0.1 alone: not 0.0.0.0, not ::
    assert done and done[0].status == TIMEOUT  # the rehearsed hang, judged as before
