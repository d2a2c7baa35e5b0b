"""Advice only where it is true (issue 47): on a healthy machine, the README's PyTorch quick
start launched as its users launch it (a real torchrun, 2 CPU processes, with and without
``--master-port``, ``--standalone``) fires no known-issue rule on any rank; a port the user
chose inside the kernel's ephemeral range is still named. Who chose ``MASTER_PORT`` is read
from what the launcher set (`machine.host.parse_master_port_by`, pure)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import deadline

from resilient_strategy.core.knowledge.clauses import fact_values
from resilient_strategy.machine.host import parse_master_port_by, parse_port_range
from resilient_strategy.testing.simulation import machine

ROOT = Path(__file__).parents[1]

#: What each rank records after the quick start decided: the rules that fired, as data.
_RECORD = """
import json, os, sys
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"fired": [e["rule"] for e in sel.to_dict()["events"]
                         if e["kind"] == "rule_fired"],
               "master_port": os.environ["MASTER_PORT"],
               "by": sel.facts.host.master_port_by}, f)
"""


def _quick_start() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("<!-- --8<-- [start:torch] -->")[1].split("<!-- --8<-- [end:torch] -->")[0]
    code = re.search(r"```python[^\n]*\n(.*?)```", block, re.S)
    assert code is not None
    return code.group(1) + _RECORD


def _launch(tmp_path: Path, *flags: str) -> list[dict[str, object]]:
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(_quick_start(), encoding="utf-8")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MASTER_", "PET_", "TORCHELASTIC_", "RANK", "LOCAL_RANK",
                                "WORLD_SIZE", "LOCAL_WORLD_SIZE"))}
    env.update({"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
                "RESILIENT_STRATEGY_CACHE_DIR": str(tmp_path / "cache"),
                "CUDA_VISIBLE_DEVICES": ""})
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        *flags, str(script), str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=deadline(300))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("flags", [(), ("--standalone",)], ids=["plain", "standalone"])
def test_a_plain_torchrun_launch_of_the_quick_start_fires_no_rule(
        tmp_path: Path, flags: tuple[str, ...]) -> None:
    pytest.importorskip("torch.distributed.run")
    for rank in _launch(tmp_path, *flags):
        assert rank["fired"] == [], rank
        assert rank["by"] == "launcher"  # torchrun bound a port the kernel gave it


@pytest.mark.slow
@pytest.mark.torch
def test_a_master_port_the_user_gives_below_the_range_fires_no_rule(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.run")
    low = parse_port_range(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
                           if Path("/proc/sys/net/ipv4/ip_local_port_range").exists() else "")
    port = _free_port(range(20000, int(low.split("-")[0]) if low else 30000))
    for rank in _launch(tmp_path, "--master-port", str(port)):
        assert (rank["fired"], rank["by"], rank["master_port"]) == ([], "user", str(port))


def _free_port(ports: range) -> int:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip("no free port below the ephemeral range")


# ----- who chose MASTER_PORT: pure --------------------------------------------------------------
_AGENT = {"MASTER_PORT": "41163", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def test_a_port_torchrun_picked_is_the_launchers() -> None:
    argv = ["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "train.py"]
    assert parse_master_port_by(_AGENT, argv) == "launcher"
    # --master_port 0: the kernel picks it, so MASTER_PORT is not what was given
    assert parse_master_port_by(_AGENT, [*argv[:3], "--master_port", "0", "t.py"]) == "launcher"


def test_a_port_given_to_the_launcher_or_bound_by_the_job_is_the_users() -> None:
    for argv in (["torchrun", "--master-port", "41163", "t.py"],
                 ["torchrun", "--master_port=41163", "t.py"],
                 ["resilient-strategy", "run", "--master-port", "41163", "t.py"]):
        assert parse_master_port_by(_AGENT, argv) == "user", argv
    assert parse_master_port_by({**_AGENT, "PET_MASTER_PORT": "41163"}, ["torchrun"]) == "user"
    # no launcher store: the job's rank 0 listens on it itself (mp.spawn, srun, mpirun)
    assert parse_master_port_by({"MASTER_PORT": "41163"}, []) == "user"
    assert parse_master_port_by({}, ["torchrun"]) == ""


def test_the_rule_is_silent_for_a_port_the_launcher_picked() -> None:
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "41163"}
    from dataclasses import replace

    base = machine(2, port_range="32768-60999", env=env)
    picked = replace(base, host=replace(base.host, master_port_by="launcher"))
    chosen = replace(base, host=replace(base.host, master_port_by="user"))
    assert fact_values(picked, "torch")["host.master_port_ephemeral"] is False
    assert fact_values(chosen, "torch")["host.master_port_ephemeral"] is True
