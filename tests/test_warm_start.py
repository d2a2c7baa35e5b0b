"""`resilient-strategy run --warm-start` (run/warm.py): the environment a forked worker takes
and the options (pure), the worker function's exit codes through torch's process context, and
real supervised runs on CPU (gloo, 2 ranks): a warm-started job that loses rank 1 to a real
SIGKILL is retried, resumes from its checkpoint and finishes, its workers seeing the
environment of their own attempt; a SIGKILLed supervisor leaves no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import deadline

from resilient_strategy.core.call.options import DEFAULT_WARM_START
from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.machine.procs import pids_with_env, read_stat
from resilient_strategy.run.cmdline import options_from_args
from resilient_strategy.run.supervisor import RUN_PREFIX
from resilient_strategy.run.warm import (
    MAX_SOCKET_PATH,
    SOCKET_NAME_CHARS,
    _private_dir,
    applies,
    rank_pids,
    server_alive_fd,
    socket_dirs,
    thread_count,
    worker_environment,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torch_train.py"
TAG = "RS_WARM_TEST_TAG"


# ----- pure ------------------------------------------------------------------------------------
def test_a_forked_worker_takes_exactly_a_fresh_workers_environment() -> None:
    server = {"PATH": "/bin", "NCCL_ALGO": "Ring", "KEEP": "1", "TORCH_SET": "x"}
    # forked: the server's, with what importing torch set (TORCH_SET) and the agent's keys
    now = {**server, "TORCH_SET": "y", "RANK": "1", "MASTER_PORT": "29500"}
    # the supervisor at the attempt's launch: a remedy's variable set, one removed, one changed
    launch = {"PATH": "/bin", "KEEP": "1", "NCCL_IB_DISABLE": "1",
              "RESILIENT_STRATEGY_PG_TIMEOUT": "660"}
    assert worker_environment(launch, server, now) == {
        "PATH": "/bin", "KEEP": "1", "NCCL_IB_DISABLE": "1", "RESILIENT_STRATEGY_PG_TIMEOUT": "660",
        "TORCH_SET": "y", "RANK": "1", "MASTER_PORT": "29500"}  # NCCL_ALGO is gone
    # the agent's value wins over the supervisor's, as Popen(env=os.environ | worker_env) does
    assert worker_environment({"RANK": "9"}, {}, {"RANK": "0"}) == {"RANK": "0"}


def test_the_thread_count_follows_the_workers_own_omp_num_threads() -> None:
    assert thread_count({"OMP_NUM_THREADS": "1"}, {}) == 1
    assert thread_count({"OMP_NUM_THREADS": "4"}, {"OMP_NUM_THREADS": "4"}) is None  # as read
    everything = thread_count({}, {"OMP_NUM_THREADS": "1"})
    assert everything is not None and everything >= 1  # unset: OpenMP's default, every CPU
    assert thread_count({"OMP_NUM_THREADS": "lots"}, {}) == everything


def test_only_torch_jobs_start_warm() -> None:
    assert applies("torch", "linux")
    assert not applies("tensorflow", "linux")
    assert not applies("torch", "win32")


def test_warm_start_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RESILIENT_STRATEGY_WARM_START", raising=False)
    assert options_from_args([str(EXAMPLE)]).warm_start is DEFAULT_WARM_START
    assert options_from_args(["--warm-start", str(EXAMPLE)]).warm_start is True
    # torchrun's --start-method, given and not the warm start's: the user's choice, kept
    assert options_from_args(["--start-method", "spawn", str(EXAMPLE)]).warm_start is False
    monkeypatch.setenv("RESILIENT_STRATEGY_WARM_START", "1")
    assert options_from_args([str(EXAMPLE)]).warm_start is True
    assert options_from_args(["--no-warm-start", str(EXAMPLE)]).warm_start is False  # line wins
    # ...and asking for a warm start too is a contradiction
    with pytest.raises(InvalidOptionError) as err:
        options_from_args(["--start-method", "spawn", str(EXAMPLE)])
    assert err.value.option == "--start-method"
    monkeypatch.setenv("RESILIENT_STRATEGY_WARM_START", "0")
    assert options_from_args(["--start-method", "spawn", str(EXAMPLE)]).warm_start is False
    assert options_from_args(["--start-method", "forkserver", "--warm-start",
                              str(EXAMPLE)]).warm_start is True
    monkeypatch.setenv("RESILIENT_STRATEGY_WARM_START", "soon")
    with pytest.raises(InvalidOptionError) as err:
        options_from_args([str(EXAMPLE)])
    assert err.value.option == "RESILIENT_STRATEGY_WARM_START"


def test_rank_pids_reads_the_workers_pid_files(tmp_path: Path) -> None:
    from resilient_strategy.records.handoff import write_pid

    write_pid(tmp_path, 1, 1)  # this process, as rank 1
    (tmp_path / "rank0.pid").write_text(json.dumps({"pid": 2 ** 22 + 7, "rank": 0}))
    assert rank_pids(tmp_path, 1) == [os.getpid()]
    assert rank_pids(tmp_path, 0) == []  # not alive
    assert rank_pids(tmp_path / "none", 1) == []


def test_the_servers_socket_goes_to_tmp_when_tmpdir_is_too_long_for_a_socket_path(
        tmp_path: Path) -> None:
    """A socket's path is at most `MAX_SOCKET_PATH` bytes: under a TMPDIR too long for it, the
    same directory name in the fallback (/tmp); both too long: multiprocessing's own."""
    name = f"{RUN_PREFIX}4242-m"
    short = Path("/t") / name
    assert socket_dirs(short) == (short, Path("/tmp") / name)
    room = MAX_SOCKET_PATH - SOCKET_NAME_CHARS  # the longest directory that still fits
    fits = Path("/" + "d" * (room - len(name) - 2)) / name
    assert len(str(fits)) == room and socket_dirs(fits)[0] == fits
    long = Path("/" + "d" * (room - len(name) - 1)) / name  # one byte too many
    assert socket_dirs(long) == (Path("/tmp") / name,)
    assert socket_dirs(long, fallback=long.parent) == ()
    # the one taken is made fresh and private; a regular file in its place is refused
    made = tmp_path / name
    made.mkdir()
    (made / "listener-left").write_text("x")  # an earlier process's with this pid: removed
    assert _private_dir(made) and list(made.iterdir()) == []
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700
    (tmp_path / "file").write_text("x")
    assert not _private_dir(tmp_path / "file") and (tmp_path / "file").read_text() == "x"


def test_the_fork_server_is_known_by_its_command_line() -> None:
    """multiprocessing starts its server as ``python -c "...main(LISTENER, ALIVE, ..."``: the
    second number is the pipe that reads end-of-file once the supervisor is gone."""
    cmd = ("from multiprocessing.forkserver import main; main(5, 8, ['resilient_strategy.run."
           "warm'], **{'sys_path': ['/x']})")
    assert server_alive_fd(["/usr/bin/python3", "-B", "-c", cmd]) == 8
    assert server_alive_fd(["python", "-m", "resilient_strategy", "run", "-c", cmd]) is None
    assert server_alive_fd(["python", "-c", "import x; main(5, 8)"]) is None
    assert server_alive_fd(["python", "-c", cmd, "more"]) is None
    assert server_alive_fd(["python", "-c"]) is None
    assert server_alive_fd([]) is None


# ----- real processes ---------------------------------------------------------------------------
#: A supervisor that starts the fork server and waits; its preload is this package's hook, then a
#: module that takes two minutes to import (torch on a loaded machine takes seconds).
SERVER_PARENT = textwrap.dedent("""
    import sys, time
    from multiprocessing import forkserver
    from resilient_strategy.run import warm
    warm.PRELOAD = (warm.PRELOAD[0], "rs_slow_preload")
    warm.start_server()
    print(forkserver._forkserver._forkserver_pid, flush=True)
    time.sleep(600)
""")
SLOW_PRELOAD = textwrap.dedent("""
    import os, time
    open(os.path.join(os.path.dirname(__file__), "importing"), "w").close()
    time.sleep(120)
""")


def _gone(pid: int) -> bool:
    st = read_stat(pid)
    return st is None or st.gone  # a zombie is gone: nothing runs in it


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forkserver and /proc")
@pytest.mark.parametrize("when", ["at_once", "importing"])
def test_the_fork_server_dies_with_a_sigkilled_supervisor_while_it_imports(
        tmp_path: Path, when: str) -> None:
    """issue 46.6: the server used to watch its supervisor only once its imports were done,
    and outlived a SIGKILLed one for as long as torch took to import (up to 12.7 s)."""
    (tmp_path / "rs_slow_preload.py").write_text(SLOW_PRELOAD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT / "src"), str(tmp_path))),
           "TMPDIR": str(tmp_path)}
    parent = subprocess.Popen([sys.executable, "-c", SERVER_PARENT], env=env,
                              stdout=subprocess.PIPE, text=True)
    server = 0
    try:
        assert parent.stdout is not None
        server = int(parent.stdout.readline())
        if when == "importing":  # past this package's hook, in the slow import
            end = time.monotonic() + 60
            while not (tmp_path / "importing").exists() and time.monotonic() < end:
                time.sleep(0.01)
            assert (tmp_path / "importing").exists() and not _gone(server)
    finally:
        parent.kill()
        parent.wait(timeout=deadline(30))  # not its output: a live server holds the pipe open
        if parent.stdout is not None:
            parent.stdout.close()
    end = time.monotonic() + 30  # generous on a loaded machine; the import takes 120 s
    while not _gone(server) and time.monotonic() < end:
        time.sleep(0.01)
    gone = _gone(server)
    if not gone:
        with_kill(server)
    assert gone


torch = pytest.importorskip("torch")


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forkserver and /proc")
def test_the_warm_workers_exit_codes_are_the_scripts(tmp_path: Path) -> None:
    """Through torch's process context as the agent starts them: a script that returns or
    calls sys.exit(0) succeeds; sys.exit(3) is 3, an exception 1 with its error record."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": "",
           "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_warm_exits.py"),
                           str(tmp_path / "work")], env=env, capture_output=True, text=True,
                          timeout=deadline(240), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["returns"] == {"exitcode": None, "done": True, "exited": [0],
                              "error_record": False}
    assert got["exit0"] == got["returns"]
    assert got["exit3"] == {"exitcode": 3, "done": True, "exited": [3], "error_record": True}
    assert got["raises"] == {"exitcode": 1, "done": True, "exited": [1], "error_record": True}
    # os._exit(0) hands torch no return value: the agent counts the exits (agent._warm_monitor)
    assert got["os_exit0"]["exited"] == [0]


SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import resilient_strategy
    import torch
    cuda_before = torch.cuda.is_initialized()
    sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=64)
    from resilient_strategy.machine.inspect import detect_facts
    info = detect_facts().framework("torch")
    marks = os.environ["RS_MARKS"]
    rank = sel.launch.rank
    attempt = os.path.basename(os.path.dirname(os.environ["RESILIENT_STRATEGY_DECISION"]))
    seen = {k: os.environ.get(k) for k in (
        "RANK", "OMP_NUM_THREADS", "RESILIENT_STRATEGY_PG_TIMEOUT", "RS_USER_VAR",
        "TORCHELASTIC_RUN_ID")}
    seen.update(threads=torch.get_num_threads(), cuda_before=cuda_before, pid=os.getpid(),
                imported=info.imported, gpu_initialized=info.gpu_initialized)
    with open(os.path.join(marks, f"{attempt}.rank{rank}.json"), "w") as fh:
        json.dump(seen, fh)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.utils.data.TensorDataset(torch.randn(2048, 16), torch.randint(0, 4, (2048,)))
    loader = torch.utils.data.DataLoader(data, batch_size=sel.batch_size, drop_last=True)
    ckpt = sel.checkpoint(sys.argv[1], every_steps=5)
    model, opt, loader = sel.prepare(model, opt, loader)
    if rank == 0:
        with open(os.path.join(marks, "resumed"), "a") as fh:
            fh.write(f"{sel.optimizer_steps}\\n")
    total = int(os.environ["RS_STEPS"])
    while sel.optimizer_steps < total:
        for x, y in loader:
            time.sleep(float(os.environ["RS_STEP_S"]))
            with sel.accumulate(model):
                sel.backward(torch.nn.functional.cross_entropy(model(x), y))
            sel.step(opt)
            with open(os.path.join(marks, f"rank{rank}.step.tmp"), "w") as fh:
                fh.write(str(sel.optimizer_steps))
            os.replace(os.path.join(marks, f"rank{rank}.step.tmp"),
                       os.path.join(marks, f"rank{rank}.step"))
            if sel.optimizer_steps >= total:
                break
    sys.stdout.write(f"finished {rank} {sel.optimizer_steps}\\n")  # one write: ranks share stdout
    sys.stdout.flush()
    sel.shutdown()
""")


class WarmRun:
    """A supervised warm-started run in its own directory, its tag in its environment."""

    def __init__(self, tmp: Path, cache: Path, steps: int, step_s: float) -> None:
        self.tmp, self.tag = tmp, f"{os.getpid()}-{time.monotonic_ns()}"
        self.marks = tmp / "marks"
        self.marks.mkdir()
        (tmp / "tmp").mkdir()
        script = tmp / "train.py"
        script.write_text(SCRIPT)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                    or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}
        env.update({"PYTHONPATH": str(ROOT / "src"), "RESILIENT_STRATEGY_CACHE_DIR": str(cache),
                    "TMPDIR": str(tmp / "tmp"), "CUDA_VISIBLE_DEVICES": "", TAG: self.tag,
                    "RS_MARKS": str(self.marks), "RS_STEPS": str(steps),
                    "RS_STEP_S": str(step_s), "RS_USER_VAR": "the user's",
                    "RESILIENT_STRATEGY_WARM_START": "1"})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node", "2",
             str(script), str(tmp / "ckpt")],
            env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_step(self, rank: int, step: int, deadline_s: float = 180.0) -> bool:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and self.proc.poll() is None:
            try:
                if int((self.marks / f"rank{rank}.step").read_text() or 0) >= step:
                    return True
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        return False

    def rank_pids(self, rank: int) -> list[int]:
        dirs = sorted((self.tmp / "tmp").glob(f"{RUN_PREFIX}{self.proc.pid}-*/attempt*"),
                      key=lambda p: int(p.name.removeprefix("attempt") or 0))
        return rank_pids(dirs[-1], rank) if dirs else []

    def left(self, deadline_s: float = 20.0) -> list[int]:
        """This run's processes still alive after ``deadline_s`` (the fork server included: it
        started with the supervisor's environment, tag and all)."""
        end = time.monotonic() + deadline_s
        while (left := pids_with_env({TAG: self.tag})) and time.monotonic() < end:
            time.sleep(0.1)
        for pid in left:  # never leave them behind us
            with_kill(pid)
        return left


def with_kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forkserver and /proc")
def test_a_sigkilled_rank_under_warm_start_is_retried_and_resumes(
        tmp_path: Path, cache: Path) -> None:
    run = WarmRun(tmp_path, cache, steps=16, step_s=0.05)
    try:
        assert run.wait_step(1, 7), "the run never reached step 7"
        pids = run.rank_pids(1)
        assert len(pids) == 1  # found through the pid it wrote: its /proc environ is the server's
        os.kill(pids[0], signal.SIGKILL)
        killed = int((run.marks / "rank1.step").read_text())
        assert pids_with_env({TAG: run.tag, "RANK": "1"}) == []
        out, _ = run.proc.communicate(timeout=deadline(240))
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.communicate(timeout=deadline(30))
    assert run.proc.returncode == 0, out[-3000:]
    assert run.left() == []
    # nothing left in the temp dir either: the run's directory, the fork server's socket's
    assert [p.name for p in (tmp_path / "tmp").iterdir()
            if not p.name.startswith("torchinductor_")] == []
    [record] = (tmp_path / "resilient-strategy-evidence").glob("*/attempts.json")
    attempts = json.loads(record.read_text())["attempts"]
    assert [(a["verdict"]["kind"], a["action"]) for a in attempts] == [
        ("exit", "retry"), ("ok", "finish")]
    assert attempts[0]["verdict"]["ranks"] == [1]
    # resumed from the last checkpoint (every 5 steps) before the kill, as a cold start does
    resumed = [int(x) for x in (run.marks / "resumed").read_text().split()]
    assert resumed == [0, attempts[1]["resumed_from"]]
    assert resumed[1] % 5 == 0 and killed - 5 <= resumed[1] <= killed + 1
    assert sorted(line for line in out.splitlines() if line.startswith("finished")) == [
        "finished 0 16", "finished 1 16"]
    seen = {p.stem: json.loads(p.read_text()) for p in run.marks.glob("attempt*.rank*.json")}
    assert sorted(seen) == ["attempt0.rank0", "attempt0.rank1", "attempt1.rank0",
                            "attempt1.rank1"]
    for name, s in seen.items():
        assert s["RANK"] == name[-1]
        assert s["RS_USER_VAR"] == "the user's"
        # set by the supervisor for each attempt, after the fork server started: seen
        assert s["RESILIENT_STRATEGY_PG_TIMEOUT"] is not None
        # torchrun's OMP_NUM_THREADS=1 for 2 processes, and torch took it (read at its import
        # in the server, set again in the worker)
        assert (s["OMP_NUM_THREADS"], s["threads"]) == ("1", 1)
        # torch imported by the server, no GPU touched: the guard has nothing to refuse
        assert (s["cuda_before"], s["imported"], s["gpu_initialized"]) == (False, True, False)
    assert seen["attempt0.rank0"]["TORCHELASTIC_RUN_ID"] != seen["attempt1.rank0"][
        "TORCHELASTIC_RUN_ID"]
    assert len({s["pid"] for s in seen.values()}) == 4


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forkserver and /proc")
def test_a_sigkilled_supervisor_leaves_no_process_under_warm_start(
        tmp_path: Path, cache: Path) -> None:
    run = WarmRun(tmp_path, cache, steps=1000, step_s=0.05)
    try:
        assert run.wait_step(1, 2), "the run never trained"
        assert run.rank_pids(0) and run.rank_pids(1)
        assert len(pids_with_env({TAG: run.tag})) >= 4  # supervisor, fork server, 2 ranks
    finally:
        run.proc.send_signal(signal.SIGKILL)
        run.proc.communicate(timeout=deadline(30))
    assert run.left() == []
