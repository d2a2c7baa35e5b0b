"""Whose fault a rank's exception is, from where it was raised (issue 30, items 2 and 3): the
class chain and frames a worker records (pure, from records), and real supervised runs on CPU
(2 gloo processes) where the script's own errors stop at once as the script's, and a
communication error raised inside torch.distributed on one rank is acted on from its error
record, long before the stall allowance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

from resilient_strategy.core.knowledge.signatures import (
    builtin_signatures,
    load_signatures,
    parse_blame,
)
from resilient_strategy.errors import InvalidRuleError
from resilient_strategy.records.handoff import exception_chain, write_error
from resilient_strategy.records.progress import COLLECTIVE, COLLECTIVE_DONE, Record
from resilient_strategy.run.exitcodes import ExitCode
from resilient_strategy.run.verdicts import (
    BLAME_COLLECTIVE,
    BLAME_DISTRIBUTED,
    BLAME_EXIT,
    BLAME_OOM,
    BLAME_PROCESS_GROUP,
    BLAME_SCRIPT,
    BLAME_SCRIPT_TEXT,
    BLAME_TEXT,
    SEEN_ERROR_RECORD,
    RankExit,
    VerdictKind,
    blame,
    classify_attempt,
)

ROOT = Path(__file__).resolve().parents[1]


def _frame(module: str, function: str = "f", distributed: bool = False,
           library: bool | None = None) -> dict[str, Any]:
    return {"module": module, "file": f"/x/{module.replace('.', '/')}.py", "function": function,
            "line": 7, "distributed": distributed,
            "library": module != "__main__" if library is None else library}


def _record(types: list[str], message: str, frames: list[dict[str, Any]],
            cause: dict[str, Any] | None = None, in_collective: bool = False) -> dict[str, Any]:
    chain = [{"types": types, "message": message, "frames": frames}]
    if cause is not None:
        chain.append(cause)
    return {"types": types, "message": message, "chain": chain, "in_collective": in_collective,
            "phase": COLLECTIVE if in_collective else COLLECTIVE_DONE, "step": 3}


SCRIPT = [_frame("resilient_strategy.run.worker", "main"), _frame("runpy", "run_path"),
          _frame("__main__", "<module>"), _frame("__main__", "push_metrics")]
IN_DIST = [*SCRIPT[:3], _frame("torch.distributed.c10d_logger", "wrapper"),
           _frame("torch.distributed.distributed_c10d", "all_reduce")]
RESET = ["http.client.RemoteDisconnected", "builtins.ConnectionResetError",
         "builtins.ConnectionError", "builtins.OSError", "builtins.Exception"]
ASSERT = ("CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously "
          "reported at some other API call")
GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed "
        "out waiting 2000ms for send operation to complete")


@pytest.mark.parametrize(("record", "kind", "why"), [
    # the script's own code, outside any collective: the script's, whatever the text says
    (_record(RESET, "Remote end closed connection without response", SCRIPT), "user",
     BLAME_SCRIPT),
    (_record(["builtins.ConnectionResetError"], "[Errno 104] Connection reset by peer", SCRIPT),
     "user", BLAME_SCRIPT),
    (_record(["builtins.RuntimeError"], "NCCL error: unhandled system error", SCRIPT), "user",
     BLAME_SCRIPT),
    # raised inside torch.distributed: the backend's
    (_record(["builtins.RuntimeError"], GLOO, IN_DIST), "comm", BLAME_DISTRIBUTED),
    (_record(["builtins.ConnectionResetError", "builtins.OSError"], "reset", IN_DIST), "comm",
     BLAME_DISTRIBUTED),
    # torch.distributed refusing a call the script got wrong is the script's
    (_record(["builtins.ValueError"], "Default process group has not been initialized", IN_DIST),
     "user", BLAME_SCRIPT),
    # the process group's own error type
    (_record(["torch.distributed.DistBackendError", "builtins.RuntimeError"], "x", SCRIPT),
     "comm", BLAME_PROCESS_GROUP),
    # the process group's own error state (NCCL's Backend.get_error()) when it raised: a
    # communication failure that surfaced in the script's CUDA sync, outside any collective
    ({**_record(["torch.AcceleratorError", "builtins.RuntimeError"], "CUDA error: unspecified "
                "launch failure", SCRIPT), "pg_error": "COMM_ERROR"}, "comm", BLAME_PROCESS_GROUP),
    ({**_record(RESET, "reset", SCRIPT), "pg_error": None}, "user", BLAME_SCRIPT),
    # the script wrapped a failed collective: its cause was raised in torch.distributed
    (_record(["builtins.Exception"], "sync failed", SCRIPT,
             cause={"types": ["builtins.RuntimeError"], "message": GLOO, "frames": IN_DIST}),
     "comm", BLAME_DISTRIBUTED),
    # a device-side assert: the script's kernel, even when a collective surfaced it
    (_record(["builtins.RuntimeError"], ASSERT, SCRIPT), "user", BLAME_SCRIPT_TEXT),
    (_record(["builtins.RuntimeError"], ASSERT, IN_DIST), "user", BLAME_SCRIPT_TEXT),
    (_record(["torch.AcceleratorError", "builtins.RuntimeError"], ASSERT, SCRIPT,
             in_collective=True), "user", BLAME_SCRIPT_TEXT),
    # an illegal address: the script's in its own code, the backend's inside a collective call
    (_record(["builtins.RuntimeError"], "CUDA error: an illegal memory access was encountered",
             SCRIPT), "user", BLAME_SCRIPT_TEXT),
    (_record(["builtins.RuntimeError"], "CUDA error: an illegal memory access was encountered",
             IN_DIST), "comm", BLAME_DISTRIBUTED),
    # DDP's reducer raises through autograd (no distributed frame) in the step's all-reduce
    (_record(["builtins.RuntimeError"], GLOO + " Connection closed by peer",
             [*SCRIPT[:3], _frame("torch._tensor", "backward"),
              _frame("torch.autograd.graph", "_engine_run_backward")], in_collective=True),
     "comm", BLAME_COLLECTIVE),
    (_record(["builtins.RuntimeError"], "mat1 and mat2 shapes cannot be multiplied",
             [*SCRIPT[:3], _frame("torch.autograd.graph")], in_collective=True), "user",
     BLAME_SCRIPT),
    # out of memory and exits keep their kinds
    (_record(["torch.OutOfMemoryError", "builtins.RuntimeError"], "CUDA out of memory", IN_DIST),
     "oom", BLAME_OOM),
    (_record(["builtins.SystemExit"], "3", SCRIPT), "exit", BLAME_EXIT),
    # a record that says nothing of where: its type and text alone, as before
    ({"types": ["builtins.RuntimeError"], "message": GLOO}, "comm", BLAME_TEXT),
])
def test_blame_from_the_record(record: dict[str, Any], kind: str, why: str) -> None:
    got = blame(record)
    assert (got.kind, got.why) == (kind, why)


def test_a_user_error_in_the_scripts_code_is_never_the_backend() -> None:
    user = RankExit(1, 1, _record(RESET, "Remote end closed connection without response",
                                  SCRIPT), Record(seq=3, phase=COLLECTIVE_DONE, k=3, t=1.0))
    v = classify_attempt(None, [user])
    assert (v.kind, v.blame, v.relaunchable, v.ranks) == (
        VerdictKind.USER, BLAME_SCRIPT, False, (1,))
    assert "push_metrics" in v.where
    comm = RankExit(1, 1, _record(["builtins.RuntimeError"], GLOO, IN_DIST))
    v = classify_attempt(None, [comm])
    assert (v.kind, v.blame, v.pinned) == (VerdictKind.BACKEND, BLAME_DISTRIBUTED, True)


def test_a_rank_that_died_printing_a_device_assert_is_the_scripts() -> None:
    """NCCL's watchdog may abort a rank on the CUDA error before Python records it: its output
    still says device-side assert, and that is the script's kernel, not the backend."""
    tail = ("RuntimeError: CUDA error: device-side assert triggered\n"
            "terminate called after throwing an instance of 'c10::DistBackendError'\n"
            "  what():  [PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread "
            "terminated with exception: CUDA error: device-side assert triggered")
    died = RankExit(1, -6, None, Record(seq=3, phase=COLLECTIVE_DONE, k=3, t=1.0), tail)
    v = classify_attempt(None, [died])
    assert (v.kind, v.blame, v.ranks) == (VerdictKind.USER, BLAME_SCRIPT_TEXT, (1,))
    nccl = RankExit(1, -6, None, None, "NCCL error: unhandled system error")
    assert classify_attempt(None, [nccl]).kind is VerdictKind.BACKEND


def test_the_worker_records_the_chain_and_the_frames(tmp_path: Path) -> None:
    import http.client

    def push() -> None:
        raise http.client.RemoteDisconnected("Remote end closed connection without response")

    try:
        try:
            push()
        except ConnectionError as exc:
            raise RuntimeError("metrics push failed") from exc
    except RuntimeError as exc:
        chain = exception_chain(exc)
        write_error(tmp_path, 0, exc, None)
    assert [c["types"][0] for c in chain] == ["builtins.RuntimeError",
                                              "http.client.RemoteDisconnected"]
    assert "builtins.ConnectionResetError" in chain[1]["types"]
    assert chain[1]["frames"][-1]["function"] == "push"
    assert chain[1]["frames"][-1]["module"] == __name__
    assert not any(f["distributed"] for c in chain for f in c["frames"])
    record = json.loads((tmp_path / "rank0.error.json").read_text())
    assert record["chain"] == chain and record["in_collective"] is False
    assert blame(record).kind == "user"


def test_a_script_that_does_not_compile_is_the_scripts(tmp_path: Path) -> None:
    """The frames runpy raises a SyntaxError through are installed code (the frozen stdlib
    too): where it was raised is not the script's line, and the verdict is the script's."""
    import runpy

    bad = tmp_path / "train.py"
    bad.write_text("x = (\n")
    with pytest.raises(SyntaxError) as err:
        runpy.run_path(str(bad))
    frames = exception_chain(err.value)[0]["frames"]
    assert frames and all(f["library"] for f in frames if f["module"] != __name__)
    got = blame({"types": ["builtins.SyntaxError"], "message": "x",
                 "chain": exception_chain(err.value)})
    assert (got.kind, got.why) == ("user", BLAME_SCRIPT)


def test_the_blame_tables_are_data_with_sources(tmp_path: Path) -> None:
    table = builtin_signatures().blame
    assert table.distributed("torch.distributed.distributed_c10d")
    assert not table.distributed("torch.distributedx") and not table.distributed("__main__")
    assert all(e.source for e in (*table.frames, *table.script))
    mine = tmp_path / "mine.toml"
    mine.write_text('version = 1\n[[distributed_frame]]\nid = "my-collectives"\n'
                    'module = "mylib.comm"\nsource = "our wrapper around all_reduce"\n')
    assert load_signatures(mine).blame.distributed("mylib.comm.ring")
    for bad in ('[[distributed_frame]]\nid = "x"\nmodule = "a b"\nsource = "s"\n',
                '[[script_fault]]\nid = "x"\nmatch = "("\nsource = "s"\n',
                '[[script_fault]]\nid = "x"\nmatch = "a"\n',
                '[[distributed_frame]]\nid = "x"\nmodule = "a"\nsource = "s"\nextra = 1\n'):
        with pytest.raises(InvalidRuleError):
            parse_blame("version = 1\n" + bad, "bad.toml")


@pytest.mark.torch
def test_the_process_group_error_state_is_read_only_where_the_backend_has_one(
        tmp_path: Path) -> None:
    """NCCL's backend reports its error state (``get_error()``); gloo's has none: None, never
    an exception, with or without a group."""
    import torch.distributed as dist

    from resilient_strategy.frameworks.teardown import process_group_error

    assert process_group_error() is None
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        assert process_group_error() is None
    finally:
        dist.destroy_process_group()


# ----- real supervised runs --------------------------------------------------------------------
torch = pytest.importorskip("torch")

TOY = """
import datetime, http.server, os, socket, sys, threading, time, urllib.request
import resilient_strategy
sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=64)
import torch
import torch.distributed as dist
with open(os.environ["LAUNCHES"], "a") as fh:
    fh.write(f"{{sel.launch.rank}} {{sel.backend}}\\n")
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(1024, 8), torch.randint(0, 2, (1024,)))
loader = torch.utils.data.DataLoader(data, batch_size=sel.batch_size, shuffle=True)
model, opt, loader = sel.prepare(model, opt, loader)
side = (dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
        if sel.backend == "gloo" else None)


def push_metrics(step):
    # a metrics server that hangs up: urllib raises http.client.RemoteDisconnected, a
    # ConnectionResetError, from the script's own code
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    def hang_up():
        conn, _ = srv.accept()
        conn.recv(65536)
        conn.close()
    threading.Thread(target=hang_up, daemon=True).start()
    urllib.request.urlopen(f"http://127.0.0.1:{{srv.getsockname()[1]}}/metrics?step={{step}}",
                           timeout=10)


def push_metrics_reset(step):
    # a metrics server that resets the connection (RST): ConnectionResetError, "[Errno 104]
    # Connection reset by peer", the words a gloo peer's failure prints too
    import struct
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    def reset():
        conn, _ = srv.accept()
        conn.recv(65536)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    threading.Thread(target=reset, daemon=True).start()
    urllib.request.urlopen(f"http://127.0.0.1:{{srv.getsockname()[1]}}/metrics?step={{step}}",
                           timeout=10)


def check_labels(step):
    # what a bad label does to a CUDA loss kernel, raised from the script's own code
    raise RuntimeError("CUDA error: device-side assert triggered\\nCUDA kernel errors might be "
                       "asynchronously reported at some other API call, so the stacktrace below "
                       "might be incorrect.")


def real_assert(step):
    # a real device-side assert: a label out of range in a CUDA loss (GPU runs only)
    logits = torch.randn(4, 2, device=sel.device).log_softmax(1)
    torch.nn.functional.nll_loss(logits, torch.tensor([0, 1, 5, 0], device=sel.device))
    torch.cuda.synchronize()


def side_sync(step):
    # an all-reduce this rank alone enters, on a group with a 2 s timeout: gloo raises inside
    # torch.distributed while the other rank trains on into the next gradient all-reduce
    dist.all_reduce(torch.ones(1), group=side)


step = 0
for epoch in range(2):
    sel.set_epoch(epoch)
    for x, y in loader:
        with sel.accumulate(model):
            sel.backward(torch.nn.functional.cross_entropy(model(x), y))
        step += sel.step(opt)
        if (sel.backend == os.environ.get("FAULT_BACKEND", "gloo")
                and step == int(os.environ["FAULT_STEP"])
                and sel.launch.rank == int(os.environ["FAULT_RANK"])):
            {action}(step)
print("finished", sel.launch.rank)
sel.shutdown()
"""


def _env(tmp: Path, cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}
    (tmp / "tmp").mkdir(exist_ok=True)
    env.update({"PYTHONPATH": str(ROOT / "src"), "RESILIENT_STRATEGY_CACHE_DIR": str(cache),
                "TMPDIR": str(tmp / "tmp"), "RESILIENT_STRATEGY_TIMEOUT": "60", **extra})
    return env


def _supervise(tmp: Path, cache: Path, action: str, rank: int, step: int,
               backend: str = "gloo", run_args: tuple[str, ...] = ()
               ) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]], list[str]]:
    script = tmp / "toy.py"
    script.write_text(textwrap.dedent(TOY.format(action=action)))
    # a stall allowance of 10 minutes: a verdict that waited for it would never come in time
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node", "2",
         "--stall-timeout", "600", *run_args, str(script)],
        env=_env(tmp, cache, LAUNCHES=str(tmp / "launches"), FAULT_RANK=str(rank),
                 FAULT_STEP=str(step), FAULT_BACKEND=backend,
                 **({"CUDA_VISIBLE_DEVICES": ""} if backend == "gloo" else {})),
        cwd=tmp, capture_output=True, text=True, timeout=deadline(300))
    found = list((tmp / "resilient-strategy-evidence").glob("*/attempts.json"))
    assert len(found) == 1, proc.stderr[-3000:]
    attempts = list(json.loads(found[0].read_text())["attempts"])
    if backend == "gloo":
        window = int(run_args[run_args.index("--fault-window") + 1]) \
            if "--fault-window" in run_args else 100
        _replay_agrees(found[0].parent, attempts, rank, window)
    return proc, attempts, sorted((tmp / "launches").read_text().split("\n")[:-1])


def _replay_agrees(evidence: Path, attempts: list[dict[str, Any]], rank: int,
                   window: int = 100) -> None:
    """The testing kit's replay of the fault the run recorded (the rank's error record, copied
    beside the evidence) takes the same actions through the same ladder."""
    from resilient_strategy.testing import machine
    from resilient_strategy.testing.replay import MidRunFault, replay

    record = json.loads((evidence / f"attempt1.rank{rank}.error.json").read_text())
    from resilient_strategy.run.policy import RelaunchPolicy

    job = replay(machine(0), [MidRunFault.from_record(record, "gloo")], nproc=2,
                 global_batch_size=64, steps=32, checkpoint_every=10_000,
                 policy=RelaunchPolicy(fault_window=window))
    assert job.actions == [a["action"] for a in attempts]
    assert [a.verdict.kind.value for a in job.attempts] == [
        a["verdict"]["kind"] for a in attempts]
    assert [a.verdict.blame for a in job.attempts] == [a["verdict"]["blame"] for a in attempts]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize(("action", "rank", "step"), [
    ("push_metrics", 1, 3), ("push_metrics", 0, 6), ("push_metrics_reset", 1, 4),
    ("check_labels", 1, 2), ("check_labels", 0, 5)])
def test_the_scripts_own_error_stops_at_once_as_the_scripts(
        action: str, rank: int, step: int, tmp_path: Path, cache_dir: Path) -> None:
    proc, attempts, launches = _supervise(tmp_path, cache_dir, action, rank, step)
    assert proc.returncode == ExitCode.USER_ERROR, proc.stderr[-3000:]
    assert launches == ["0 gloo", "1 gloo"]  # no step-down, no retry
    [attempt] = attempts
    v = attempt["verdict"]
    assert (v["kind"], v["ranks"], v["seen"], attempt["action"]) == (
        "user", [rank], SEEN_ERROR_RECORD, "stop")
    assert v["blame"] == (BLAME_SCRIPT_TEXT if action == "check_labels" else BLAME_SCRIPT)
    assert action in v["where"]  # the script's function that raised it


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize(("rank", "step"), [(1, 3), (0, 5)])
def test_a_communication_error_is_acted_on_from_its_error_record(
        rank: int, step: int, tmp_path: Path, cache_dir: Path) -> None:
    proc, attempts, launches = _supervise(tmp_path, cache_dir, "side_sync", rank, step)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = attempts[0]["verdict"]
    # seen from the rank's error record (not the stall watch, whose allowance is 600 s; not
    # the rank's exit, which the record precedes), blamed on the frame in torch.distributed
    assert (first["kind"], first["ranks"], first["seen"], first["blame"]) == (
        "backend", [rank], SEEN_ERROR_RECORD, BLAME_DISTRIBUTED)
    assert attempts[0]["action"] == "step_down"
    assert [a["verdict"]["kind"] for a in attempts[1:]] == ["ok"]
    assert launches == ["0 cpu", "0 gloo", "1 gloo"]


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize(("rank", "step"), [(1, 8), (0, 6)])
def test_a_communication_error_after_a_healthy_stretch_is_retried_first(
        rank: int, step: int, tmp_path: Path, cache_dir: Path) -> None:
    """With a fault window of 5 steps, a communication error at step 6 or 8 (no fault before)
    comes after a healthy stretch: retried on gloo first; its repeat on the retry (the script
    keeps no checkpoint: it fails at the same step again) steps down."""
    proc, attempts, launches = _supervise(tmp_path, cache_dir, "side_sync", rank, step,
                                          run_args=("--fault-window", "5"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(a["candidate"].split(":")[1], a["verdict"]["kind"], a["action"])
            for a in attempts] == [("gloo", "backend", "retry"), ("gloo", "backend", "step_down"),
                                   ("cpu", "ok", "finish")]
    assert launches == ["0 cpu", "0 gloo", "0 gloo", "1 gloo", "1 gloo"]


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.gpu
@pytest.mark.parametrize("rank", [0, 1])
def test_a_real_device_side_assert_under_nccl_is_the_scripts(
        rank: int, tmp_path: Path, cache_dir: Path) -> None:
    """On two GPUs (NCCL): a label out of range in the script's CUDA loss asserts on the device;
    the run stops at once as the script's (exit 1), never steps down."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    proc, attempts, launches = _supervise(tmp_path, cache_dir, "real_assert", rank, 3, "nccl")
    assert proc.returncode == ExitCode.USER_ERROR, proc.stderr[-3000:]
    assert launches == ["0 nccl", "1 nccl"]
    [attempt] = attempts
    v = attempt["verdict"]
    assert (v["kind"], v["seen"], attempt["action"]) == ("user", SEEN_ERROR_RECORD, "stop")
    # raised in the script's own frame (script_code) or known by its text wherever the CUDA
    # error surfaced (script_fault_text): either is the script's (seen on 2 x H200: script_code)
    assert v["blame"] in (BLAME_SCRIPT, BLAME_SCRIPT_TEXT)
