"""The tools as people use them (issue 43 item 4): LightningCLI through ``lightning_cli``, an
Accelerate loop that accumulates by hand, the idle rank of a fallback leaving before the
script's own start-up."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.testing import machine, simulate

ROOT = Path(__file__).parents[1]
HAS_CLI = all(importlib.util.find_spec(m) is not None for m in ("lightning", "jsonargparse"))
needs_cli = pytest.mark.skipif(not HAS_CLI, reason="lightning or jsonargparse is not installed")
# a machine with SLURM's tools (tests/slurm installs them): Lightning's hint is not ours
pytestmark = pytest.mark.filterwarnings("ignore:The `srun` command is available")
LAUNCHED = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}


def _cpu_sel(fallback: bool, rank: int = 0) -> Any:
    """A CPU decision for a global batch of 32: one process alone, or (``fallback``) the
    one-process fallback of a 2-process launch whose gloo failed (2 accumulation steps)."""
    facts = machine(0)
    if not fallback:
        return simulate(facts, {}, framework="torch", global_batch_size=32)
    env = {**facts.env_map, **LAUNCHED, "RANK": str(rank), "LOCAL_RANK": str(rank)}
    return simulate(facts, {"*": "error:gloo_connection"}, framework="torch",
                    global_batch_size=32, env=env)


@pytest.fixture
def bare_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when it is given ``args`` beside a command line (pytest's), and
    jsonargparse 4.53 of a Lightning 2.6 call it deprecates (off by its own variable)."""
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "off")


def _cli_classes() -> tuple[Any, Any]:
    import lightning as L
    import torch

    class Model(L.LightningModule):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Data(L.LightningDataModule):
        def __init__(self, batch_size: int = 8) -> None:
            super().__init__()
            self.batch_size = batch_size

    return Model, Data


@needs_cli
@pytest.mark.usefixtures("bare_argv")
def test_lightning_cli_builds_the_trainer_of_the_decision() -> None:
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from resilient_strategy.integrations.lightning import lightning_cli

    model, data = _cli_classes()
    sel = _cpu_sel(fallback=True)
    cli = lightning_cli(sel, model, data, batch_size_key="data.batch_size", run=False,
                        save_config_callback=None, announce=False, seed_everything_default=0,
                        args=["--trainer.max_epochs", "1", "--trainer.logger", "false"])
    assert isinstance(cli.trainer.strategy, SingleDeviceStrategy)
    assert cli.trainer.accumulate_grad_batches == sel.accumulation_steps == 2
    assert cli.datamodule.batch_size == sel.batch_size == 16
    assert cli.trainer.max_epochs == 1  # the command line's own arguments still apply


@needs_cli
@pytest.mark.usefixtures("bare_argv")
@pytest.mark.parametrize(("args", "option"), [
    (["--trainer.devices", "4"], "trainer.devices"),
    (["--trainer.accumulate_grad_batches", "3"], "trainer.accumulate_grad_batches"),
    (["--trainer.strategy", "ddp"], "trainer.strategy"),
    (["--data.batch_size", "32"], "data.batch_size"),
])
def test_lightning_cli_refuses_arguments_that_undo_the_decision(args: list[str],
                                                                 option: str) -> None:
    from resilient_strategy.integrations.lightning import lightning_cli

    model, data = _cli_classes()
    with pytest.raises(InvalidOptionError) as err:
        lightning_cli(_cpu_sel(fallback=True), model, data, batch_size_key="data.batch_size",
                      run=False, save_config_callback=None, announce=False,
                      seed_everything_default=0, args=["--trainer.logger", "false", *args])
    assert err.value.option == option


@needs_cli
@pytest.mark.usefixtures("bare_argv")
def test_lightning_cli_idle_rank_leaves_before_parsing() -> None:
    from resilient_strategy.integrations.lightning import lightning_cli

    model, data = _cli_classes()
    with pytest.raises(SystemExit) as idle:  # an argument the parser would refuse: not parsed
        lightning_cli(_cpu_sel(fallback=True, rank=1), model, data, announce=False,
                      args=["--no-such-argument"])
    assert idle.value.code == 0


def _cli_job(tmp_path: Path, name: str, processes: int, **env: str) -> dict[str, Any]:
    full = {k: v for k, v in os.environ.items() if k != "RESILIENT_STRATEGY_PROBE_FAULT"}
    full.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                RESILIENT_STRATEGY_CACHE_DIR=str(tmp_path / f"cache-{name}"), **env)
    out = tmp_path / f"{name}.json"
    launch = [sys.executable] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         str(processes)]
    done = subprocess.run(
        [*launch, str(ROOT / "tests" / "_lightning_cli_job.py"), str(out), "fit",
         "--trainer.max_epochs", "1"],
        cwd=tmp_path, env=full, capture_output=True, text=True, timeout=deadline(300))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.mark.slow
@pytest.mark.torch
@needs_cli
def test_lightning_cli_script_trains_alone_on_two_processes_and_on_the_fallback(
        tmp_path: Path) -> None:
    alone = _cli_job(tmp_path, "alone", 1)
    ddp = _cli_job(tmp_path, "ddp", 2)
    fallback = _cli_job(tmp_path, "fallback", 2, RESILIENT_STRATEGY_PROBE_FAULT="exit:1")
    assert (alone["world"], alone["accumulate"], alone["batch"]) == (1, 1, 32)
    assert (ddp["world"], ddp["accumulate"], ddp["batch"]) == (2, 1, 16)
    assert (fallback["world"], fallback["accumulate"], fallback["batch"]) == (1, 2, 16)
    for run in (alone, ddp, fallback):  # 128 samples: 4 optimizer steps of the global batch
        assert run["steps"] == 4 and run["per_step"] == [32, 32, 32, 32]
    assert fallback["weight"] == pytest.approx(alone["weight"], abs=1e-6)


HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None
needs_accelerate = pytest.mark.skipif(not HAS_ACCELERATE, reason="accelerate is not installed")


@pytest.fixture
def fresh_accelerate() -> Any:
    """Accelerate keeps its state process-wide: each test's Accelerator starts from none."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _accelerate_loop(sel: Any, by_hand: int | None) -> dict[str, Any]:
    """128 samples, one epoch, through ``make_accelerator(sel)``: with ``accelerator.accumulate``
    (``by_hand`` None), or a loop of its own stepping every ``by_hand``-th batch. Returns the
    optimizer steps really taken, the samples each saw and the final weights."""
    import torch

    from resilient_strategy.integrations.accelerate import make_accelerator

    accelerator = make_accelerator(sel, announce=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 4, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                         batch_size=sel.batch_size)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step: list[int] = []
    seen = [0]
    opt.register_step_post_hook(lambda *_: (per_step.append(seen[0]), seen.__setitem__(0, 0)))
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for i, (xb, yb) in enumerate(loader):
        seen[0] += len(xb)
        if by_hand is None:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(xb), yb))
                opt.step()
                opt.zero_grad()
        else:
            accelerator.backward(torch.nn.functional.mse_loss(model(xb), yb) / by_hand)
            if (i + 1) % by_hand == 0:
                opt.step()
                opt.zero_grad()
    return {"per_step": per_step, "weight": model.weight.detach().flatten().tolist()}


@needs_accelerate
@pytest.mark.usefixtures("fresh_accelerate")
@pytest.mark.parametrize("by_hand", [1, 2])
def test_accelerate_loop_accumulating_by_hand_is_refused_on_the_fallback(by_hand: int) -> None:
    from resilient_strategy.errors import AccumulateRequiredError

    sel = _cpu_sel(fallback=True)
    with pytest.raises(AccumulateRequiredError) as err:  # at the first step, before any update
        _accelerate_loop(sel, by_hand)
    assert (err.value.accumulation_steps, err.value.seen, err.value.expected) == (2, 16, 32)


@needs_accelerate
@pytest.mark.usefixtures("fresh_accelerate")
def test_accelerate_loops_that_keep_the_global_batch_train_as_the_uninterrupted_run() -> None:
    whole = _accelerate_loop(_cpu_sel(fallback=False), by_hand=1)  # 1 process, batch 32
    assert whole["per_step"] == [32, 32, 32, 32]
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    fallback = _accelerate_loop(_cpu_sel(fallback=True), by_hand=None)  # accumulate: 2 x 16
    assert fallback["per_step"] == whole["per_step"]
    assert fallback["weight"] == pytest.approx(whole["weight"], abs=1e-6)


def test_load_model_is_tensorflows() -> None:
    from resilient_strategy.errors import WrongFrameworkError

    with pytest.raises(WrongFrameworkError):
        _cpu_sel(fallback=False).load_model("model.keras")
