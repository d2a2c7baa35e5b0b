"""frameworks/teardown.py: the process group is ended at exit, also when the script forgets
``sel.shutdown()``; and after an uncaught exception, without waiting for the peers."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import deadline

from resilient_strategy.frameworks import teardown

ROOT = Path(__file__).parents[1]
HAS_TORCH = importlib.util.find_spec("torch") is not None

#: Registered before the library's hook, so it runs after it (atexit is last in, first out):
#: it records whether a process group was still up when the interpreter was about to exit.
SCRIPT = '''
import atexit, json, os, sys
def _record():
    import torch.distributed as dist
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"initialized": dist.is_initialized()}, f)
atexit.register(_record)
import resilient_strategy, torch
sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=8)
model, opt, _ = sel.prepare(torch.nn.Linear(4, 2), None, None)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with sel.accumulate(model):
    sel.backward(model(torch.randn(4, 4)).sum())
sel.step(opt)
# no sel.shutdown(): the library ends the group at exit
'''


def test_nothing_to_end_without_torch_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)  # never imported here
    assert teardown.end_process_group() is False
    assert teardown.end_process_group(None) is False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_a_script_that_forgets_shutdown_ends_its_process_group_at_exit(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "RESILIENT_STRATEGY_CACHE_DIR": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("RESILIENT_STRATEGY_PROBE_FAULT", None)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(_free_port()), str(script), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=deadline(240))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    seen = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert seen == {"rank0.json": {"initialized": False}, "rank1.json": {"initialized": False}}


def test_garbage_is_collected_once_per_group_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """The group's end collects (gloo's abort at exit, pytorch/pytorch#179291); the exit hook
    after it collects again only if a group began since or ended without us (it had collected
    three times per exit: 0.076 s each with torch imported)."""
    import types

    collected: list[int] = []
    up = [True]
    dist = types.SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: up[0],
        destroy_process_group=lambda: up.__setitem__(0, False),
        barrier=lambda async_op: types.SimpleNamespace(wait=lambda timeout: True))
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    monkeypatch.setattr(teardown, "_COLLECTED", [])
    monkeypatch.setattr(teardown, "_REGISTERED", [True])  # no real atexit hook from a test
    monkeypatch.setattr(teardown.gc, "collect", lambda: collected.append(1) or 0)
    teardown.end_at_exit()  # a group began
    assert teardown.end_process_group(None) is True and len(collected) == 1  # sel.shutdown()
    assert teardown.end_process_group(None) is False and len(collected) == 1  # the exit hook
    teardown.end_at_exit()  # a group began again, and was destroyed by someone else
    up[0] = False
    assert teardown.end_process_group(None) is False and len(collected) == 2
