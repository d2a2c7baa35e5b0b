"""Lightning and Accelerate from a Selection: the keyword arguments for simulated machines (no
GPU needed to build them), and the examples training for real under torchrun on 2 CPU processes
over gloo, and on the one-device fallback when the probe fault variable breaks the collective."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.integrations import launcher_hidden, precision
from resilient_strategy.testing import machine, simulate

ROOT = Path(__file__).parents[1]
HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None
HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None
needs_lightning = pytest.mark.skipif(not HAS_LIGHTNING, reason="lightning is not installed")
needs_accelerate = pytest.mark.skipif(not HAS_ACCELERATE, reason="accelerate is not installed")
TORCHRUN_ENV = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}


def _sel(outcomes: dict[str, str], *, cc: tuple[int, int] = (9, 0), rank: int = 0,
         **kw: Any) -> Any:
    facts = machine(2, cc=cc)
    env = {**facts.env_map, **TORCHRUN_ENV, "RANK": str(rank), "LOCAL_RANK": str(rank)}
    return simulate(facts, outcomes, framework="torch", global_batch_size=256, env=env,
                    gradient_bytes=100 << 20, sample_seconds=0.01, **kw)


def test_precision_follows_the_gpu_and_the_request() -> None:
    assert precision(_sel({"nccl": "ok"})) == "bf16"
    assert precision(_sel({"nccl": "ok"}, cc=(7, 5))) == "fp16"
    assert precision(_sel({"nccl": "ok"}, precision="fp32")) == "fp32"


def test_launcher_variables_hidden_only_while_one_process_trains_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    alone = _sel({"*": "error:nccl_error"})
    assert alone.num_replicas == 1 and alone.accumulation_steps == 2
    with launcher_hidden(alone):
        assert not set(TORCHRUN_ENV) & set(os.environ)
    assert all(os.environ[k] == v for k, v in TORCHRUN_ENV.items())
    with launcher_hidden(_sel({"nccl": "ok"})):
        assert all(os.environ[k] == v for k, v in TORCHRUN_ENV.items())


@needs_lightning
def test_lightning_kwargs_for_ddp_and_for_the_fallback() -> None:
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from resilient_strategy.integrations.lightning import trainer_kwargs

    kw = trainer_kwargs(_sel({"nccl": "ok"}, process_group_timeout=120))
    assert (kw["accelerator"], kw["devices"], kw["num_nodes"]) == ("gpu", 2, 1)
    assert isinstance(kw["strategy"], DDPStrategy)
    assert kw["strategy"]._process_group_backend == "nccl"
    assert kw["strategy"]._timeout == timedelta(seconds=120)
    assert (kw["accumulate_grad_batches"], kw["precision"]) == (1, "bf16-mixed")

    gloo = trainer_kwargs(_sel({"nccl": "error:nccl_error", "nccl+*": "error:nccl_error", "gloo": "ok"}))
    assert gloo["strategy"]._process_group_backend == "gloo"

    one = trainer_kwargs(_sel({"*": "error:nccl_error"}))
    assert isinstance(one["strategy"], SingleDeviceStrategy)
    assert (one["devices"], one["accumulate_grad_batches"]) == (1, 2)
    with pytest.raises(SystemExit) as idle:  # rank 1 has nothing to train
        trainer_kwargs(_sel({"*": "error:nccl_error"}, rank=1))
    assert idle.value.code == 0


@needs_accelerate
def test_accelerate_kwargs_for_ddp_and_for_the_fallback() -> None:
    from accelerate.utils import InitProcessGroupKwargs

    from resilient_strategy.integrations.accelerate import accelerator_kwargs

    kw = accelerator_kwargs(_sel({"nccl": "ok"}, cc=(7, 5)))
    assert (kw["gradient_accumulation_steps"], kw["mixed_precision"], kw["cpu"]) == (1, "fp16", False)
    (handler,) = kw["kwargs_handlers"]
    assert isinstance(handler, InitProcessGroupKwargs)
    assert (handler.backend, handler.timeout) == ("nccl", timedelta(seconds=300))
    one = accelerator_kwargs(_sel({"*": "error:nccl_error"}))
    assert one["gradient_accumulation_steps"] == 2 and "kwargs_handlers" not in one


def test_integrations_refuse_a_tensorflow_selection() -> None:
    facts = machine(2, torch=None, tensorflow="2.21.0", tf_cuda="12.5")
    sel = simulate(facts, {"nccl": "ok"}, framework="tensorflow", global_batch_size=64)
    from resilient_strategy.integrations import require_torch_selection

    with pytest.raises(InvalidOptionError):
        require_torch_selection(sel, "Lightning")


def _torchrun(script: str, tmp_path: Path, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if k != "RESILIENT_STRATEGY_PROBE_FAULT"}
    full.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1",
                RESILIENT_STRATEGY_CACHE_DIR=str(tmp_path),
                CUDA_VISIBLE_DEVICES="",  # CPU tests: on a GPU machine too (empty hides GPUs)
                **env)
    out = subprocess.run(
        # torchrun itself, run by this interpreter (a `torchrun` script may not be on PATH)
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         f"examples/{script}", "--epochs", "2",
         "--samples", "4096"],
        cwd=ROOT, env=full, capture_output=True, text=True, timeout=deadline(300))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def _losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"epoch \d: loss ([0-9.]+)", out)]


@pytest.mark.slow
@pytest.mark.torch
@needs_lightning
def test_lightning_example_ddp_over_gloo_then_fallback(tmp_path: Path) -> None:
    out = _torchrun("lightning_train.py", tmp_path / "ok")
    assert "chose: gloo on 2 CPU processes" in out
    assert "devices=2, strategy=DDPStrategy, accumulate_grad_batches=1" in out
    losses = _losses(out)
    assert len(losses) == 2 and losses[1] < losses[0]
    broken = _torchrun("lightning_train.py", tmp_path / "broken",
                       RESILIENT_STRATEGY_PROBE_FAULT="exit:1")
    assert "chose: CPU" in broken
    assert "devices=1, strategy=SingleDeviceStrategy, accumulate_grad_batches=2" in broken
    assert "global batch 256" in broken and len(_losses(broken)) == 2


@pytest.mark.slow
@pytest.mark.torch
@needs_accelerate
def test_accelerate_example_ddp_over_gloo_then_fallback(tmp_path: Path) -> None:
    out = _torchrun("accelerate_train.py", tmp_path / "ok")
    assert "Accelerator: 2 process(es), DistributedType.MULTI_CPU" in out
    losses = _losses(out)
    assert len(losses) == 2 and losses[1] < losses[0]
    broken = _torchrun("accelerate_train.py", tmp_path / "broken",
                       RESILIENT_STRATEGY_PROBE_FAULT="exit:1")
    assert "Accelerator: 1 process(es), DistributedType.NO, gradient_accumulation_steps=2" in broken
    assert len(_losses(broken)) == 2


def test_integrations_import_nothing_until_called() -> None:
    code = ("import sys\n"
            "import resilient_strategy.integrations.lightning, resilient_strategy.integrations.accelerate\n"
            "print(sorted(m for m in ('torch', 'lightning', 'accelerate') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=deadline(60),
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_a_missing_tool_is_a_typed_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient_strategy.errors import ExtraNotInstalledError
    from resilient_strategy.integrations import accelerate, lightning

    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.strategies",
                 "pytorch_lightning", "pytorch_lightning.strategies", "accelerate"):
        monkeypatch.setitem(sys.modules, name, None)  # import of it raises ImportError
    sel = _sel({"nccl": "ok"})
    with pytest.raises(ExtraNotInstalledError, match=r"resilient-strategy\[lightning\]"):
        lightning.trainer_kwargs(sel)
    with pytest.raises(ExtraNotInstalledError, match=r"resilient-strategy\[accelerate\]"):
        accelerate.accelerator_kwargs(sel)
