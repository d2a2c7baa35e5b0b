"""The examples train for real on CPU: Keras on 2 logical CPU devices (the NCCL probe fails at fit
and a host-staged reduction trains), PyTorch under torchrun on 2 CPU processes over gloo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import deadline

ROOT = Path(__file__).parents[1]


def _run(argv: list[str], tmp_path: Path) -> str:
    """Run an example on CPU: on a GPU machine too, CUDA_VISIBLE_DEVICES="" hides the GPUs (these
    tests check the CPU paths; an empty value hides GPUs on purpose, see visible.py)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "RESILIENT_STRATEGY_CACHE_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2",
           "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=deadline(300))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
@pytest.mark.tensorflow
def test_keras_example_on_two_logical_cpus(tmp_path: Path) -> None:
    out = _run([sys.executable, "examples/keras_train.py", "--cpu-replicas", "2", "--epochs", "2",
                "--samples", "8192"], tmp_path)
    assert re.search(r"chose: MirroredStrategy \+ (HierarchicalCopyAllReduce|ReductionToOneDevice)", out)
    assert "Probe of MirroredStrategy + NCCL" not in out  # no CPU kernel: never probed on CPUs
    assert "2 replica(s) x 128 samples x 1 accumulation step(s) = global batch 256" in out
    losses = [float(x) for x in re.findall(r"epoch \d: loss ([0-9.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0]


@pytest.mark.slow
@pytest.mark.torch
def test_torch_example_under_torchrun_on_cpu_uses_gloo_then_the_cache(tmp_path: Path) -> None:
    # torchrun itself, run by this interpreter (a `torchrun` script may not be on PATH)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            # a rendezvous on a port it binds itself (a free port picked before and passed as
            # --master_port may be taken by another job in between; 29500 may be held)
            "--standalone",
            "examples/torch_train.py", "--epochs", "2", "--samples", "8192"]
    out = _run(argv, tmp_path)
    assert "chose: gloo on 2 CPU processes" in out
    assert "2 replica(s) x 128 samples x 1 accumulation step(s) = global batch 256" in out
    losses = [float(x) for x in re.findall(r"epoch \d: loss ([0-9.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0]
    again = _run([*argv[:7], "--epochs", "1", "--samples", "2048"], tmp_path)
    assert "from the cache" in again  # the decision line names its one source


@pytest.mark.slow
@pytest.mark.torch
def test_torch_example_plain_python_on_cpu(tmp_path: Path) -> None:
    out = _run([sys.executable, "examples/torch_train.py", "--epochs", "1", "--samples", "4096"],
               tmp_path)
    assert "chose: CPU" in out and "epoch 1:" in out
