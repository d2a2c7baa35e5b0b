"""Launch faults are not the backend's (issue 45.3, 42.4): a failure whose evidence points at
the launch (a rendezvous port already held, a store unreachable, a name that does not resolve,
a library that breaks ``import torch``) is a ``launch`` verdict / a launch probe cause: no
step-down, no cache entry, the configuration's exit code, one line naming the thing (a held
port's holder from /proc). A fault that recurs identically on a second backend is treated the
same way. Asserted on data: verdict kinds, causes, attempts, exit codes, the holder's pid."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilient_strategy.errors import LaunchFaultError
from resilient_strategy.machine.ports import Holder, parse_sockets, port_holders, socket_inode
from resilient_strategy.records.progress import COLLECTIVE, Record
from resilient_strategy.run import launch
from resilient_strategy.run.exitcodes import ExitCode
from resilient_strategy.run.policy import Action, RelaunchPolicy, judge
from resilient_strategy.run.verdicts import RankExit, VerdictKind, classify_attempt
from resilient_strategy.testing import MidRunFault, machine, replay
from resilient_strategy.testing.fakes import simulate

ROOT = Path(__file__).resolve().parents[1]
H200X2 = machine(2, name="NVIDIA H200", cc=(9, 0), nvlink=18)

#: Verbatim from public reports (the signatures' sources).
EADDRINUSE = ("The server socket has failed to listen on any local network address. port: 29500,"
              " useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
EADDRINUSE_OLD = ("The server socket has failed to listen on any local network address. The "
                  "server socket has failed to bind to [::]:29500 (errno: 98 - Address already "
                  "in use). The server socket has failed to bind to 0.0.0.0:29500 (errno: 98 - "
                  "Address already in use).")
BAD_NCCL = ("/opt/conda/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so: undefined "
            "symbol: ncclCommRegister")
DIST_NETWORK = ("torch.distributed.DistNetworkError", "torch.distributed.DistError",
                "RuntimeError", "Exception", "object")

TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:7385 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0
   1: 0100007F:7385 0100007F:A1B2 06 00000000:00000000 03:00000DAD 00000000     0        0 0 3 0
   2: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 17 1 0
   garbage line
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:7385 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 777 1 0
"""


def test_proc_net_tcp_is_parsed_from_strings() -> None:
    """/proc/net/tcp{,6}: the sockets bound to a port (29573 = 0x7385), listening first, the
    owner's uid and the inode; a descriptor's link read as a socket's inode."""
    v4 = parse_sockets(TCP, 0x7385)
    assert [(b.listening, b.uid, b.inode) for b in v4] == [(True, 1000, 4242), (False, 0, 0)]
    assert [(b.listening, b.inode) for b in parse_sockets(TCP6, 0x7385)] == [(True, 777)]
    assert parse_sockets(TCP, 1) == ()
    assert socket_inode("socket:[4242]") == 4242
    assert socket_inode("pipe:[4242]") is None and socket_inode("/dev/null") is None


@pytest.fixture
def held_port() -> Iterator[tuple[socket.socket, int]]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        yield s, s.getsockname()[1]
    finally:
        s.close()


def test_the_holder_of_a_real_held_port_is_found_in_proc(
        held_port: tuple[socket.socket, int]) -> None:
    _, port = held_port
    holders = port_holders(port)
    assert [h.pid for h in holders] == [os.getpid()]
    assert holders[0].uid == os.geteuid()


def _exit(message: str, types: tuple[str, ...] = DIST_NETWORK, frame: str = "__main__",
          rank: int = 0) -> RankExit:
    record = {"rank": rank, "types": list(types), "message": message, "step": 0,
              "chain": [{"types": list(types), "message": message,
                         "frames": [{"module": frame, "function": "<module>",
                                     "file": "train.py", "line": 3}]}]}
    return RankExit(rank, 1, record, Record(seq=1, phase=COLLECTIVE, k=1, t=0.0))


@pytest.mark.parametrize("message,cause", [
    (EADDRINUSE, "port_in_use"), (EADDRINUSE_OLD, "port_in_use"),
    ("The client socket has timed out after 1800s while trying to connect to (10.0.0.9, "
     "29500).", "store_unreachable"),
    ("host not found: Name or service not known", "name_unresolved"),
])
def test_a_rank_that_raised_a_launch_fault_is_a_launch_verdict_that_stops_with_usage(
        message: str, cause: str) -> None:
    """Before: a DistNetworkError was the process group's own error type, `backend`: a step
    down at once (and a step-down again on the next strategy, where it recurs)."""
    verdict = classify_attempt(None, [_exit(message), RankExit(1, -15)])
    assert (verdict.kind, verdict.cause, verdict.ranks) == (VerdictKind.LAUNCH, cause, (0,))
    judged = judge(verdict, "torch:gloo:cpu", [], RelaunchPolicy())
    assert (judged.action, judged.exit_code) == (Action.STOP, ExitCode.USAGE)


def test_a_library_that_breaks_import_torch_is_a_launch_verdict_not_the_scripts() -> None:
    """The import raised in the script's own frame: before, `user` and exit 1."""
    verdict = classify_attempt(None, [_exit(BAD_NCCL, ("builtins.ImportError", "Exception"))])
    assert (verdict.kind, verdict.cause) == (VerdictKind.LAUNCH, "torch_import")


def test_the_agents_own_rendezvous_error_is_a_launch_verdict_with_the_port_named() -> None:
    """torch's agent raises creating the store on a held --master-port, before any worker."""
    verdict = launch.raised([(DIST_NETWORK, EADDRINUSE)])
    assert verdict is not None and (verdict.kind, verdict.cause) == (VerdictKind.LAUNCH,
                                                                     "port_in_use")
    assert launch.port_in(verdict.summary) == 29500
    assert launch.port_in(EADDRINUSE_OLD) == 29500
    assert launch.raised([(("builtins.ValueError",), "bad value")]) is None
    holder = Holder(4242, "/usr/bin/python3 other_job.py", 0)
    assert launch.named(verdict, [holder]).held_by == (4242,)


def test_a_fault_that_recurs_identically_on_another_backend_stops_with_usage() -> None:
    """The same error (numbers aside) on NCCL (and NCCL with its remedy), then on gloo: it
    follows the job from backend to backend. Before: stepped down once more, to one GPU."""
    said = "rehearsed: connection to the job's metrics relay at 10.1.2.3:9000 was lost"
    job = replay(H200X2, [MidRunFault("error", "nccl", 30, message=said),
                          MidRunFault("error", "gloo", 30, message=said.replace("9000", "9001"))])
    assert job.backends == ["nccl", "nccl", "gloo"]
    assert job.actions == ["step_down", "step_down", "stop"]
    assert job.exit_code == ExitCode.USAGE


def test_a_backends_own_fault_still_steps_down_within_the_backend() -> None:
    """NCCL's error again on NCCL with a remedy is NCCL's: the rule compares backends."""
    job = replay(H200X2, [MidRunFault("error", "nccl", 30, rank=1)])
    assert job.actions == ["step_down", "step_down", "finish"]


def test_a_replayed_broken_import_stops_at_once_on_the_first_strategy() -> None:
    job = replay(H200X2, [MidRunFault("error", "nccl", 1, message=BAD_NCCL,
                                      error_type="builtins.ImportError", raised_in="script"),
                          MidRunFault("error", "single_device", 1, message=BAD_NCCL,
                                      error_type="builtins.ImportError", raised_in="script")])
    assert (job.actions, job.exit_code) == (["stop"], ExitCode.USAGE)
    assert job.attempts[0].verdict.kind is VerdictKind.LAUNCH
    assert job.failures == {}  # nothing learned of NCCL, so nothing to cache


def test_a_probe_that_cannot_import_torch_stops_the_decision_instead_of_a_fallback() -> None:
    """An older libnccl first on LD_LIBRARY_PATH: every probe worker's import dies. Before: the
    plan fell back to another candidate, which dies the same way."""
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    with pytest.raises(LaunchFaultError) as raised:
        simulate(H200X2, {"nccl": f"fails:ImportError: {BAD_NCCL}",
                          "gloo": f"fails:ImportError: {BAD_NCCL}",
                          "single_device": f"fails:ImportError: {BAD_NCCL}"},
                 framework="torch", env=env)
    assert raised.value.cause == "torch_import"


# ----- real runs: a port held by this test process ---------------------------------------------
TOY = """
import os
import resilient_strategy
sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=64)
import torch
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
loader = torch.utils.data.DataLoader(data, batch_size=sel.batch_size)
model, opt, loader = sel.prepare(model, opt, loader)
if "SIDE_PORT" in os.environ and sel.launch.rank == 0:  # a store of the script's own
    side = torch.distributed.TCPStore("127.0.0.1", int(os.environ["SIDE_PORT"]), 1, True,
                                      wait_for_workers=False)
for x, y in loader:
    with sel.accumulate(model):
        sel.backward(torch.nn.functional.cross_entropy(model(x), y))
    sel.step(opt)
sel.shutdown()
"""


def _run(tmp: Path, run_args: list[str], **extra: str) -> tuple[int, list[dict[str, object]]]:
    pytest.importorskip("torch")
    script = tmp / "toy.py"
    script.write_text(textwrap.dedent(TOY))
    (tmp / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}
    env.update({"PYTHONPATH": str(ROOT / "src"), "RESILIENT_STRATEGY_CACHE_DIR": str(tmp / "c"),
                "TMPDIR": str(tmp / "tmp"), "RESILIENT_STRATEGY_TIMEOUT": "60",
                "CUDA_VISIBLE_DEVICES": "", **extra})
    proc = subprocess.run([sys.executable, "-m", "resilient_strategy", "run",
                           "--nproc-per-node", "2", *run_args, str(script)],
                          env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
    found = list((tmp / "resilient-strategy-evidence").glob("*/attempts.json"))
    assert len(found) == 1, proc.stderr[-3000:]
    return proc.returncode, list(json.loads(found[0].read_text())["attempts"])


@pytest.mark.slow
@pytest.mark.torch
def test_an_explicit_master_port_held_by_another_process_is_one_launch_attempt(
        tmp_path: Path, held_port: tuple[socket.socket, int]) -> None:
    """Before: torch's DistNetworkError traceback, exit 1, no attempts record."""
    _, port = held_port
    code, attempts = _run(tmp_path, ["--master-port", str(port)])
    assert code == ExitCode.USAGE
    [attempt] = attempts
    verdict = attempt["verdict"]
    assert isinstance(verdict, dict)
    assert (verdict["kind"], verdict["cause"], verdict["held_by"]) == (
        "launch", "port_in_use", [os.getpid()])
    assert (attempt["action"], attempt["exit_code"]) == ("stop", ExitCode.USAGE)


@pytest.mark.slow
@pytest.mark.torch
def test_a_held_port_inside_the_script_is_not_stepped_down(
        tmp_path: Path, held_port: tuple[socket.socket, int]) -> None:
    """Rank 0's own TCPStore on a held port. Before: `backend`, a step-down to one CPU process,
    where it failed the same way, then exit 75 at the crash-loop bound (three attempts)."""
    _, port = held_port
    code, attempts = _run(tmp_path, [], SIDE_PORT=str(port))
    assert code == ExitCode.USAGE
    assert [(str(a["candidate"]).split(":")[1], a["verdict"]["kind"], a["action"])  # type: ignore[index]
            for a in attempts] == [("gloo", "launch", "stop")]
    assert attempts[0]["verdict"]["held_by"] == [os.getpid()]  # type: ignore[index]
    assert "mid_run" not in "".join(p.read_text() for p in (tmp_path / "c").glob("*.json"))
