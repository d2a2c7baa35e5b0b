"""A resume is announced only when the script restored it (issue 43, item 2).

Real ``resilient-strategy run`` on the CPU, one process, a real SIGKILL of the rank in its first
attempt: a script whose checkpoint the supervisor saw noted (Accelerate ``save_state``) but which
never loads it is no resume; a script that keeps its own checkpoint and reports its restore
(``sel.resumed_from``) is one, and its steps count on from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from resilient_strategy.records.handoff import TrainingReporter, restored_step
from resilient_strategy.records.progress import ProgressWriter
from resilient_strategy.records.rundir import RunDir

ROOT = Path(__file__).parents[1]

#: The script: 30 optimizer steps of 8 samples; its rank SIGKILLs itself after step 12 of its
#: first attempt. ``accelerate``: saves with ``accelerator.save_state`` every 5 steps (the
#: supervisor sees it noted) and never loads it; ``own``: saves its own ``torch.save``
#: checkpoint every 5 steps, loads it when present and reports it with ``sel.resumed_from``.
SCRIPT = r'''
import os, signal, sys
from pathlib import Path
import resilient_strategy

mode, work, kills = sys.argv[1], Path(sys.argv[2]), [int(k) for k in sys.argv[3].split(",")]
sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=8)
import torch

torch.manual_seed(0)
x, y = torch.randn(240, 4), torch.randint(0, 2, (240,))
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
launch = len(list(work.glob("launch*")))
(work / f"launch{launch}").touch()
kill = kills[launch] if launch < len(kills) else None
start = 0
if mode == "accelerate":
    from resilient_strategy.integrations.accelerate import make_accelerator

    accelerator = make_accelerator(sel)
    model, optimizer = accelerator.prepare(model, optimizer)

    def step(xb, yb):
        accelerator.backward(torch.nn.functional.cross_entropy(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()

    def save(done):
        accelerator.save_state(str(work / "state"))
else:
    model, optimizer, _ = sel.prepare(model, optimizer)
    ckpt = work / "own.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
        sel.resumed_from(start)

    def step(xb, yb):
        sel.backward(torch.nn.functional.cross_entropy(model(xb), yb))
        sel.step(optimizer)

    def save(done):
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "step": done}, work / "own.tmp")
        os.replace(work / "own.tmp", ckpt)
for i in range(start, 30):
    step(x[8 * i:8 * i + 8], y[8 * i:8 * i + 8])
    if (i + 1) % 5 == 0:
        save(i + 1)
    if i + 1 == kill:
        os.kill(os.getpid(), signal.SIGKILL)
print(f"steps {start}..30", flush=True)
sel.shutdown()
'''


def _run(tmp: Path, mode: str, kills: str, *run_args: str) -> list[dict[str, Any]]:
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    work = tmp / "work"
    work.mkdir()
    (tmp / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}
    env.update(PYTHONPATH=str(ROOT / "src"), TMPDIR=str(tmp / "tmp"), CUDA_VISIBLE_DEVICES="",
               RESILIENT_STRATEGY_CACHE_DIR=str(tmp / "cache"), RESILIENT_STRATEGY_TIMEOUT="60")
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node", "1",
         *run_args, str(script), mode, str(work), kills],
        env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [record] = (tmp / "resilient-strategy-evidence").glob("*/attempts.json")
    return list(json.loads(record.read_text())["attempts"])


@pytest.mark.slow
@pytest.mark.torch
def test_a_checkpoint_saved_but_never_loaded_is_no_resume(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    attempts = _run(tmp_path, "accelerate", "12")
    assert [a["action"] for a in attempts] == ["retry", "finish"]
    # the supervisor saw save_state's note at step 10, but the script started over
    assert [a["resumed_from"] for a in attempts] == [None, None]


@pytest.mark.slow
@pytest.mark.torch
def test_a_script_that_restores_its_own_checkpoint_and_reports_it_resumes(
        tmp_path: Path) -> None:
    # killed after step 12, then after step 24: the second attempt got 12 steps further (from
    # the restored step 10), so the crash-loop bound (one attempt less than 10 steps further)
    # is not met
    attempts = _run(tmp_path, "own", "12,24", "--fault-window", "1",
                    "--max-attempts-without-progress", "1")
    assert [a["action"] for a in attempts] == ["retry", "retry", "finish"]
    assert [a["resumed_from"] for a in attempts] == [None, 10, 20]
    assert attempts[1]["verdict"]["step"] > attempts[0]["verdict"]["step"] > 10


def test_a_restore_is_noted_once_before_the_first_step_only(tmp_path: Path) -> None:
    where = RunDir(tmp_path)
    rep = TrainingReporter(ProgressWriter(str(where.progress(0))), rank=0, backend="cpu",
                           collective=False, restore_note=str(where.restore_note))
    assert restored_step(tmp_path) is None
    rep.restored(0)  # no step restored: no resume
    assert restored_step(tmp_path) is None
    rep.restored(7)
    assert (restored_step(tmp_path), rep.step) == (7, 7)
    rep.stepped(True)
    rep.restored(8)  # after a step (a second prepare, a second fit): no restore
    assert (restored_step(tmp_path), rep.step) == (7, 8)
    where.restore_note.write_text('{"step": "x"}')
    assert restored_step(tmp_path) is None
