"""Two nodes simulated on this host: two `torchrun --nnodes 2 --rdzv-backend c10d` launches on
127.0.0.1 running tests/_two_node_job.py, for real (CPU, gloo between the nodes).

c10d rendezvous assigns node ranks by arrival (it ignores --node-rank), so a fault meant for
node 1 is given to both launches as ``hang:1:gloo``: it hits whichever became node 1. The
rendezvous store is hosted by whichever launch binds the endpoint first, and torchrun itself dies
when that launch dies; so where node 1 is killed, the rendezvous store is hosted by this test
(both launches ``--rdzv-conf is_host=0``), as by a dedicated rendezvous host.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.torch]

ROOT = Path(__file__).resolve().parent.parent
JOB = Path(__file__).resolve().parent / "_two_node_job.py"
LIMIT_S = 150  # a bound on each launch so that a bug fails the test instead of hanging it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])
            children.setdefault(ppid, []).append(int(pid))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class Pair:
    """Two torchrun launches forming one 2-node job; every process is killed at the end."""

    def __init__(self, out: Path, timeout_s: float, *, rdzv_host: bool = False,
                 **env: str) -> None:
        self.out = out
        self.run_id = f"rs-{uuid.uuid4().hex[:10]}"
        torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
        port = free_port()
        self.rdzv_store = None
        conf: list[str] = []
        if rdzv_host:
            import torch.distributed as dist

            self.rdzv_store = dist.TCPStore("127.0.0.1", port, is_master=True,
                                            wait_for_workers=False, multi_tenant=True)
            conf = ["--rdzv-conf", "is_host=0"]
        base = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                     or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}
        base.update({
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
            "RESILIENT_STRATEGY_TIMEOUT": str(timeout_s), "RESILIENT_STRATEGY_CACHE": "0",
            "OMP_NUM_THREADS": "1", **env})
        # temporary files of the launches (what a SIGKILLed node cannot remove) stay in out/
        (out / "tmp").mkdir()
        base["TMPDIR"] = str(out / "tmp")
        self.procs = [
            subprocess.Popen(
                [torchrun, "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "--rdzv-id", self.run_id, "--max-restarts", "0", *conf, str(JOB), str(out)],
                env=base, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            for n in (0, 1)
        ]
        self.logs: list[str] = ["", ""]

    def wait(self) -> list[int]:
        end = time.monotonic() + deadline(LIMIT_S)
        codes = []
        for i, p in enumerate(self.procs):
            try:
                out, _ = p.communicate(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                out, _ = p.communicate()
            self.logs[i] = out.decode(errors="replace")
            codes.append(p.returncode)
        return codes

    def kill(self, i: int | None = None) -> None:
        """SIGKILL launch ``i`` (default: both) and every process it started (torchrun starts
        its workers in sessions of their own: its process group does not reach them)."""
        for j, p in enumerate(self.procs):
            if i is None or i == j:
                for pid in [p.pid, *descendants(p.pid)]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)

    def read(self, name: str) -> dict[int, dict[str, Any]]:
        """rank -> the job's JSON file ``name`` (start / decision / trained)."""
        return {int(f.stem.rpartition("-")[2]): json.loads(f.read_text())
                for f in self.out.glob(f"{name}-*.json")}

    def leftovers(self) -> list[str]:
        """Processes of this job still alive (by its run id in their command line)."""
        left = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                if self.run_id in cmd or (str(self.out) in cmd and "torch_worker" not in cmd
                                          and "pytest" not in cmd):
                    left.append(cmd)
        return left

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        for p in self.procs:
            p.wait()


def by_node(pair: Pair, name: str) -> dict[int, dict[str, Any]]:
    start = pair.read("start")
    return {start[r]["node"]: v for r, v in pair.read(name).items()}


def test_healthy_pair_proves_gloo_across_both_nodes_and_trains(tmp_path: Path) -> None:
    with Pair(tmp_path, 45) as pair:  # generous: a loaded CI machine must not time the probe out
        codes = pair.wait()
    assert codes == [0, 0], pair.logs
    decisions = by_node(pair, "decision")
    assert set(decisions) == {0, 1}
    d0, d1 = decisions[0], decisions[1]
    assert (d0["backend"], d0["num_replicas"]) == ("gloo", 2)
    assert d1["label"] == d0["label"] and d1["candidates"][0]["key"] == d0["candidates"][0]["key"]
    for d in (d0, d1):
        probe = d["probes"]["torch:gloo:cpu"]
        assert probe["status"] == "ok" and probe["ranks"] == 2
        assert ["nodes", "2"] in probe["extra"] and probe["bus_bandwidth_gbps"] > 0
        assert d["proven"]
        # issue 31: the nodes' facts crossed torchrun's store; both "nodes" are this one host
        # (its boot id), a finding every node names (a warning: gloo was still proven)
        found = [e["finding"] for e in d["events"] if e["kind"] == "nodes_differ"]
        assert [(f["id"], f["nodes"]) for f in found if f["id"] == "nodes-one-host"] == [
            ("nodes-one-host", [0, 1])]
    trained = by_node(pair, "trained")
    assert trained[0]["optimizer_steps"] == trained[1]["optimizer_steps"] == 2
    assert trained[0]["weights"] == trained[1]["weights"]  # DDP kept both nodes in step
    assert pair.leftovers() == []


def test_a_hang_between_nodes_falls_back_to_node_0_on_both(tmp_path: Path) -> None:
    with Pair(tmp_path, 6, RESILIENT_STRATEGY_PROBE_FAULT="hang:1:gloo") as pair:
        codes = pair.wait()
    assert codes == [0, 0], pair.logs
    decisions = by_node(pair, "decision")
    assert set(decisions) == {0, 1}
    for d in decisions.values():  # the same fallback on both: no split
        assert (d["backend"], d["num_replicas"], d["accumulation_steps"]) == ("cpu", 1, 2)
        probe = d["probes"]["torch:gloo:cpu"]
        assert (probe["status"], probe["cause"]) == ("timeout", "inter_node")
    assert decisions[0]["active"] and not decisions[1]["active"]
    trained = by_node(pair, "trained")
    assert set(trained) == {0} and trained[0]["optimizer_steps"] == 2  # 4 micro-steps, 2 updates
    assert pair.leftovers() == []


def test_node_1_killed_mid_decision_stops_node_0_with_a_clear_error(tmp_path: Path) -> None:
    with Pair(tmp_path, 60, rdzv_host=True, RESILIENT_STRATEGY_PROBE_FAULT="hang:1:gloo") as pair:
        end = time.monotonic() + deadline(LIMIT_S)
        victim = None
        while victim is None and time.monotonic() < end:  # node 1's cross-node probe is up
            start = pair.read("start")
            node1 = [s["agent_pid"] for s in start.values() if s["node"] == 1]
            hanging = [c for c in pair.leftovers() if "torch_worker" in c and "--rank 1" in c]
            if node1 and hanging:
                victim = next(i for i, p in enumerate(pair.procs) if p.pid == node1[0])
            time.sleep(0.2)
        assert victim is not None, pair.logs
        pair.kill(victim)
        codes = pair.wait()
    survivor = 1 - victim
    assert codes[survivor] != 0
    assert "NodeLostError" in pair.logs[survivor], pair.logs[survivor][-3000:]
    assert pair.read("decision") == {} and pair.read("trained") == {}
    assert pair.leftovers() == []
