"""Lightning and Accelerate report progress under `resilient-strategy run` like ``sel.step()``:
the hooks driven by the real tools in this process with a recording reporter (fast), the
pure pieces from data, and one supervised job of each example over gloo whose rank hangs at
step 20 (the supervisor sees the stall, retries, steps down and the job finishes with the
uninterrupted optimizer-step count). The Lightning one trains a small global batch (64) so that
its three attempts stay short; it resumes from the epoch-end checkpoint at step 16."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import deadline

from resilient_strategy.integrations.lightning import last_micro_step
from resilient_strategy.run.agent import raised_before

ROOT = Path(__file__).parents[1]
needs_lightning = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                     reason="lightning is not installed")
needs_accelerate = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                      reason="accelerate is not installed")


@dataclass
class Recorder:
    """A TrainingReporter's interface, recording the calls ("begin", last) / ("end", last) /
    ("step",) / ("restored", n)."""

    step: int = 0
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def backward_begin(self, last_micro_step: bool) -> None:
        self.calls.append(("begin", last_micro_step))

    def backward_end(self, last_micro_step: bool) -> None:
        self.calls.append(("end", last_micro_step))

    def stepped(self, stepped: bool) -> None:
        if stepped:
            self.step += 1
            self.calls.append(("step",))

    def restored(self, step: int) -> None:
        self.step = step
        self.calls.append(("restored", step))


#: Two optimizer steps of two micro-steps each, as the torch path reports them.
TWO_STEPS_OF_TWO = [("begin", False), ("end", False), ("begin", True), ("end", True), ("step",)] * 2


def test_last_micro_step_every_accumulate_th_batch_and_the_epochs_last() -> None:
    assert [last_micro_step(i, 2, 6) for i in range(6)] == [False, True] * 3
    assert [last_micro_step(i, 2, 5) for i in range(5)] == [False, True, False, True, True]
    assert [last_micro_step(i, 1, float("inf")) for i in range(3)] == [True] * 3


def test_only_errors_raised_before_the_stop_overrule_a_stall() -> None:
    assert not raised_before([None, None], 100.0)
    assert not raised_before([None, {"at": 101.5}], 100.0)  # what the stop did to a rank
    assert raised_before([{"at": 99.0}, {"at": 101.5}], 100.0)
    assert raised_before([{"message": "no time"}], 100.0)
    assert raised_before([{"at": 99.0}], float("inf"))  # no stall judged


@pytest.mark.slow
@pytest.mark.torch
@needs_lightning
@pytest.mark.filterwarnings(  # Lightning's own, about torch's pytree and a tiny loader
    "ignore:.*LeafSpec.*:FutureWarning", "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")
def test_lightning_callback_reports_each_step_and_the_resumed_count(tmp_path: Path) -> None:
    import lightning as L
    import torch

    from resilient_strategy.integrations.lightning import progress_callback

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    loader = torch.utils.data.DataLoader(data, batch_size=2)  # 4 batches: 2 steps of 2

    def fit(rec: Recorder, epochs: int, ckpt: Path | None = None) -> Any:
        trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1,
                            accumulate_grad_batches=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[progress_callback(rec)])  # type: ignore[arg-type]
        trainer.fit(Tiny(), loader, ckpt_path=ckpt)
        return trainer

    rec = Recorder()
    trainer = fit(rec, 1)
    assert rec.calls == TWO_STEPS_OF_TWO and rec.step == trainer.global_step == 2
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    resumed = Recorder()
    fit(resumed, 2, tmp_path / "one.ckpt")
    assert resumed.calls == [("restored", 2), *TWO_STEPS_OF_TWO] and resumed.step == 4


@pytest.mark.slow
@pytest.mark.torch
@needs_lightning
def test_lightning_kwargs_keep_your_callbacks_and_add_none_outside_run() -> None:
    from resilient_strategy.integrations.lightning import trainer_kwargs
    from resilient_strategy.testing import machine, simulate

    sel = simulate(machine(0), {"*": "ok"}, framework="torch", global_batch_size=8)
    mine = object()
    assert trainer_kwargs(sel)["callbacks"] == []
    assert trainer_kwargs(sel, callbacks=[mine])["callbacks"] == [mine]


@pytest.mark.slow
@pytest.mark.torch
@needs_accelerate
def test_accelerate_hook_reports_each_step_and_saves_and_resumes_the_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from accelerate import Accelerator

    from resilient_strategy.integrations.accelerate import STEPS_FILE, read_steps, report_progress

    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)

    def train(rec: Recorder, load: bool = False) -> Any:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        report_progress(accelerator, SimpleNamespace(progress=rec))  # type: ignore[arg-type]
        model = torch.nn.Linear(4, 2)
        data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
        model, opt, loader = accelerator.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1),
            torch.utils.data.DataLoader(data, batch_size=2))
        if load:
            accelerator.load_state(str(tmp_path / "state"))
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
                opt.step()
                opt.zero_grad()
        return accelerator

    rec = Recorder()
    accelerator = train(rec)
    assert rec.calls == TWO_STEPS_OF_TWO and rec.step == 2
    accelerator.save_state(str(tmp_path / "state"))
    assert read_steps(tmp_path / "state" / STEPS_FILE) == 2
    resumed = Recorder()
    train(resumed, load=True)
    assert resumed.calls == [("restored", 2), *TWO_STEPS_OF_TWO] and resumed.step == 4
    # outside `resilient-strategy run` (no reporter) nothing is added
    plain = Accelerator(cpu=True)
    report_progress(plain, SimpleNamespace(progress=None))  # type: ignore[arg-type]
    assert "backward" not in vars(plain)


def test_a_missing_or_foreign_steps_file_reads_as_zero(tmp_path: Path) -> None:
    from resilient_strategy.integrations.accelerate import read_steps

    assert read_steps(tmp_path / "absent.json") == 0
    for text in ("[1]", '{"optimizer_steps": -3}', '{"optimizer_steps": true}', "{", "x" * 9000):
        (tmp_path / "s.json").write_text(text)
        assert read_steps(tmp_path / "s.json") == 0
    (tmp_path / "s.json").write_text(json.dumps({"optimizer_steps": 7}))
    assert read_steps(tmp_path / "s.json") == 7


def _supervised(tmp: Path, example: str, *args: str, fault: str = "hang:1:gloo:20"
                ) -> tuple[list[str], list[dict[str, Any]]]:
    """``resilient-strategy run`` of an example on 2 gloo processes whose rank 1 hangs in the
    collective of optimizer step 20 (``fault``: on every gloo attempt by default): its
    ``optimizer steps:`` lines and its attempts."""
    (tmp / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}
    env.update(PYTHONPATH=str(ROOT / "src"), TMPDIR=str(tmp / "tmp"), CUDA_VISIBLE_DEVICES="",
               RESILIENT_STRATEGY_CACHE_DIR=str(tmp / "cache"),
               RESILIENT_STRATEGY_TIMEOUT="60",
               RESILIENT_STRATEGY_TRAIN_FAULT=fault,  # step 20: in epoch 3 of 3 (8 steps each)
               # the stop's grace after SIGTERM (torchrun's knob, 30 s by default): a rank hung
               # in the injected fault, and its peer blocked in the collective, never act on
               # SIGTERM, so each stall cost the whole grace before the SIGKILL
               TORCH_ELASTIC_SHUTDOWN_TIMEOUT="5")
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node", "2",
         "--stall-timeout", "3", str(ROOT / "examples" / example), "--samples", "2048",
         "--epochs", "3", "--checkpoint-dir", str(tmp / "ckpt"), *args],
        env=env, cwd=tmp, capture_output=True, text=True, timeout=deadline(400))
    assert proc.returncode == 0, proc.stderr[-3000:]
    [record] = (tmp / "resilient-strategy-evidence").glob("*/attempts.json")
    return ([line for line in proc.stdout.splitlines() if line.startswith("optimizer steps:")],
            json.loads(record.read_text())["attempts"])


def _story(attempts: list[dict[str, Any]]) -> list[tuple[str, str, str, int]]:
    """(backend, verdict kind, action, step it failed at) per attempt."""
    return [(a["candidate"].split(":")[1], a["verdict"]["kind"], a["action"], a["verdict"]["step"])
            for a in attempts]


#: Stalled at step 20, retried on gloo, the same stall again, stepped down to one process.
LADDER = [("gloo", "stall", "retry", 20), ("gloo", "stall", "step_down", 20),
          ("cpu", "ok", "finish", 0)]


@pytest.mark.slow
@pytest.mark.torch
@needs_accelerate
def test_an_accelerate_job_that_hangs_under_run_relaunches_and_finishes_its_steps(
        tmp_path: Path) -> None:
    steps, attempts = _supervised(tmp_path, "accelerate_train.py", "--checkpoint-every", "5")
    assert steps == ["optimizer steps: 24"]  # 3 epochs x 2048 / 256, as uninterrupted
    assert _story(attempts) == LADDER
    assert [a["resumed_from"] for a in attempts] == [None, 15, 15]



@pytest.mark.slow
@pytest.mark.torch
@needs_lightning
def test_a_lightning_job_that_hangs_under_run_relaunches_and_finishes_its_steps(
        tmp_path: Path) -> None:
    # the hang fires in the first launch only: stalled, retried on gloo, finished there (the
    # Accelerate test above walks the whole ladder; each Lightning launch costs its import)
    steps, attempts = _supervised(tmp_path, "lightning_train.py", "--samples", "512",
                                  "--global-batch-size", "64", fault="hang:1:gloo:20:1")
    assert steps == ["optimizer steps: 24"]  # 3 epochs x 512 / 64, as uninterrupted
    assert _story(attempts) == [("gloo", "stall", "retry", 20), ("gloo", "ok", "finish", 0)]
