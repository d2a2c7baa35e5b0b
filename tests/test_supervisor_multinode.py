"""`resilient-strategy run --nnodes 2`: two supervisors on 127.0.0.1 (two simulated nodes, one
process per node, gloo between them on CPU) agree through the rendezvous endpoint's store
before any worker starts, and relaunch together after a mid-run fault on one node.

c10d numbers the workers' nodes as they join (not by --node-rank), so a fault is named by global
rank (``exit:1:gloo:<step>``): it hits whichever node's worker became rank 1. The supervisors
themselves are numbered by --node-rank: node 0's hosts the store.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.torch]

ROOT = Path(__file__).resolve().parents[1]
JOB = Path(__file__).resolve().parent / "_two_node_job.py"
EXAMPLE = ROOT / "examples" / "torch_train.py"
LIMIT_S = 240  # a bound on each supervisor so that a bug fails the test instead of hanging it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_pair(tmp: Path, script: Path, script_args: list[str], probe_timeout: float = 30,
             **extra: str) -> tuple[list[int], list[str]]:
    """Both supervisors to the end (killed, with everything below them, at LIMIT_S)."""
    return finish(start_pair(tmp, script, script_args, probe_timeout, **extra))


def start_pair(tmp: Path, script: Path, script_args: list[str], probe_timeout: float = 30,
               **extra: str) -> list[subprocess.Popen[str]]:
    """The two supervisors (node ranks 0 and 1), started."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}
    (tmp / "tmp").mkdir(exist_ok=True)
    env.update({"PYTHONPATH": str(ROOT / "src"), "RESILIENT_STRATEGY_CACHE_DIR": str(tmp / "cache"),
                "RESILIENT_STRATEGY_TIMEOUT": "30", "TMPDIR": str(tmp / "tmp"),
                "OMP_NUM_THREADS": "1", **extra})
    # CPU nodes (gloo), on a GPU machine too: the simulated nodes would share its GPU 0
    env["CUDA_VISIBLE_DEVICES"] = ""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "resilient_strategy", "run", "--nnodes", "2", "--node-rank",
             str(n), "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{port}", "--stall-timeout", "5", "--probe-timeout",
             f"{probe_timeout:g}", str(script), *script_args],
            env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        for n in (0, 1)
    ]
    return procs


def finish(procs: list[subprocess.Popen[str]]) -> tuple[list[int], list[str]]:
    """Every supervisor's exit code and output (each killed with its group at LIMIT_S)."""
    codes, logs = [], []
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=deadline(LIMIT_S))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                out, _ = p.communicate()
            codes.append(p.returncode)
            logs.append(out)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return codes, logs


def processes_of(tmp: Path, *words: str) -> list[str]:
    """Live processes whose command line names ``tmp`` (and every one of ``words``)."""
    mine = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                status = (proc / "stat").read_text().split(") ", 1)[-1][:1]
                if str(tmp) in cmd and status != "Z" and all(w in cmd for w in words):
                    mine.append(f"{proc.name} {cmd[:160]}")
    return mine


def assert_clean(tmp: Path, temp_files: bool = True) -> None:
    """No process of the run left, no temporary file left (torch's inductor cache aside)."""
    if temp_files:
        left = [p.name for p in (tmp / "tmp").iterdir()
                if not p.name.startswith("torchinductor_")]
        assert left == []
    assert processes_of(tmp) == []


def read(out: Path, name: str) -> dict[int, dict[str, Any]]:
    return {int(f.stem.rpartition("-")[2]): json.loads(f.read_text())
            for f in out.glob(f"{name}-*.json")}


def test_two_supervisors_agree_across_nodes_before_launching(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    codes, logs = run_pair(tmp_path, JOB, [str(out)])
    assert codes == [0, 0], [log[-3000:] for log in logs]
    decisions = read(out, "decision")
    assert set(decisions) == {0, 1}  # both nodes launched their one worker
    d0, d1 = decisions[0], decisions[1]
    assert (d0["backend"], d0["num_replicas"]) == ("gloo", 2)
    assert d1["candidates"][0]["key"] == d0["candidates"][0]["key"]
    for d in (d0, d1):  # proven across the two nodes, before the workers started
        probe = d["probes"]["torch:gloo:cpu"]
        assert probe["status"] == "ok" and probe["ranks"] == 2
        assert ["nodes", "2"] in probe["extra"]
        assert d["proven"]
    trained = read(out, "trained")
    assert trained[0]["optimizer_steps"] == trained[1]["optimizer_steps"] == 2
    assert trained[0]["weights"] == trained[1]["weights"]
    assert_clean(tmp_path)


ARGS = ["--samples", "4096", "--epochs", "2", "--hidden", "32", "--checkpoint-every", "5"]


def test_a_mid_run_fault_on_one_node_relaunches_both_on_the_next_candidate(
        tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    codes, logs = run_pair(tmp_path, EXAMPLE, [*ARGS, "--checkpoint-dir", str(ckpt)],
                           RESILIENT_STRATEGY_TRAIN_FAULT="exit:1:gloo:8")
    assert codes == [0, 0], [log[-3000:] for log in logs]
    # gloo failed mid-run on the pair; the next candidate is node 0 alone (accumulating): it
    # resumed from the checkpoint and finished every optimizer step; node 1 had nothing to run
    steps = [int(line.split(":")[1]) for line in logs[0].splitlines()
             if line.startswith("optimizer steps:")]
    assert steps == [2 * 4096 // 256]
    assert [ln for ln in logs[1].splitlines() if ln.startswith("optimizer steps:")] == []
    # each supervisor retried gloo once (node 1's worker exited, node 0's saw the connection
    # close: the nodes merged their verdicts into the exit), then stepped down on the repeat
    records = [json.loads(p.read_text())["attempts"]
               for p in (tmp_path / "resilient-strategy-evidence").glob("*/attempts.json")]
    assert len(records) == 2  # one per node's supervisor
    for attempts in records:
        assert [(a["verdict"]["kind"], a["action"]) for a in attempts][:2] == [
            ("exit", "retry"), ("exit", "step_down")], attempts
    assert (ckpt / "checkpoint.pt").is_file()
    assert_clean(tmp_path)


def test_a_probe_hang_on_node_1_falls_back_to_node_0_alone_on_both(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    codes, logs = run_pair(tmp_path, JOB, [str(out)], probe_timeout=8,
                           RESILIENT_STRATEGY_PROBE_FAULT="hang:1:gloo")
    assert codes == [0, 0], [log[-3000:] for log in logs]
    decisions = read(out, "decision")
    assert list(decisions) == [0]  # node 0's one worker; node 1 had nothing to run and exit 0
    d = decisions[0]
    assert (d["backend"], d["num_replicas"], d["accumulation_steps"]) == ("cpu", 1, 2)
    probe = d["probes"]["torch:gloo:cpu"]
    assert (probe["status"], probe["cause"]) == ("timeout", "inter_node")
    trained = read(out, "trained")
    assert list(trained) == [0] and trained[0]["optimizer_steps"] == 2  # 4 micro-steps
    assert_clean(tmp_path)


def test_node_1_killed_mid_decision_stops_node_0_within_the_deadlines(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    procs = start_pair(tmp_path, JOB, [str(out)], probe_timeout=60,
                       RESILIENT_STRATEGY_PROBE_FAULT="hang:1:gloo")
    try:
        end = time.monotonic() + deadline(LIMIT_S)  # until node 1's side of the cross-node probe is up
        while not processes_of(tmp_path, "torch_worker", "--rank 1"):
            assert time.monotonic() < end and procs[0].poll() is None, finish(procs)
            time.sleep(0.2)
        os.killpg(procs[1].pid, signal.SIGKILL)  # node 1's supervisor and all in its group
        t = time.monotonic()
        codes, logs = finish(procs)
        took = time.monotonic() - t
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    assert codes[0] not in (0, None), logs[0][-3000:]
    assert "NodeLostError" in logs[0] or "node 1" in logs[0], logs[0][-3000:]
    assert took < 60, took  # the heartbeat's staleness, not the 60 s probe timeout
    assert read(out, "decision") == {} and read(out, "trained") == {}  # no worker started
    end = time.monotonic() + deadline(15)  # node 1's probe workers see their parent gone (watchdog)
    while processes_of(tmp_path) and time.monotonic() < end:
        time.sleep(0.2)
    assert_clean(tmp_path, temp_files=False)  # a SIGKILLed node cannot remove its own


def test_node_link_from_torchrun_options() -> None:
    from resilient_strategy.errors import InvalidOptionError
    from resilient_strategy.run.cmdline import options_from_args

    def link(*argv: str) -> Any:
        from resilient_strategy.run.peers import NodeLink

        return NodeLink.from_torchrun(options_from_args([*argv, str(JOB)]).torchrun, 2)

    assert link() is None and link("--nnodes", "1") is None
    got = link("--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "10.0.0.5:29411", "--rdzv-id", "job7")
    assert (got.node, got.nodes, got.nproc, got.host, got.port) == (1, 2, 2, "10.0.0.5", 29411)
    job = got.job(3)
    assert (job.node, job.nodes, job.rank, job.agent_store) == (1, 2, 2, False)
    assert job.prefix == "resilient_strategy/v1/run-job7/attempt3/"
    assert got.job(0).prefix != job.prefix  # each launch attempt agrees under its own keys
    # a fixed count starts with every node and goes on down to node 0 alone
    assert (got.min_nodes, got.floor, got.present) == (2, 1, (0, 1))
    # MIN:MAX: torch elastic's range; the job starts with MIN or more, never goes below MIN
    elastic = link("--nnodes", "2:4", "--node-rank", "3", "--rdzv-endpoint", "10.0.0.5:29411")
    assert (elastic.nodes, elastic.min_nodes, elastic.floor) == (4, 2, 2)
    # after a membership round, the node's place among the members is its GROUP_RANK
    fewer = elastic.with_members((0, 3))
    assert (fewer.position, fewer.job(5).node, fewer.job(5).nodes) == (1, 1, 2)
    assert fewer.env({}, 5)["WORLD_SIZE"] == "4"  # 2 nodes x 2 processes
    assert fewer.roster(5).node == 3 and fewer.roster(5).prefix.endswith("attempt5/members/")
    with pytest.raises(InvalidOptionError):
        link("--nnodes", "3:2", "--rdzv-endpoint", "10.0.0.5:29411")
