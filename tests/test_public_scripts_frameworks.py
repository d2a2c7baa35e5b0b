"""The public-scripts suite (tests/test_public_scripts.py says how), its frameworks' part: scripts
in the shape of Lightning's LightningCLI example and of the Keras MirroredStrategy guide."""

from __future__ import annotations

from pathlib import Path

import pytest
from _public_scripts import BROKEN_GLOO, only, python, supervised_kill, torchrun

pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.torch]


# ----- in the shape of Lightning's LightningCLI example (backbone_image_classifier.py) ------------
LIGHTNING_ARGS = ("--trainer.max_epochs=2", "--trainer.enable_progress_bar=false",
                  "--trainer.enable_model_summary=false")
#: the original's own launch flags on 2 CPU processes (the adopted script has the decision's)
LIGHTNING_LAUNCH = ("--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp")


def _needs_lightning_cli() -> None:
    """Skip where LightningCLI cannot run: Lightning absent, or jsonargparse's signatures extra
    missing (Lightning's own requirement, checked as Lightning checks it)."""
    pytest.importorskip("lightning")
    imports = pytest.importorskip("lightning_utilities.core.imports")
    need = "jsonargparse[signatures]>=4.27.7"
    if not imports.RequirementCache(need):
        pytest.skip(f"LightningCLI needs {need}, not installed here")


def test_lightning_cli_healthy_broken_gloo_as_the_original(tmp_path: Path) -> None:
    """2 epochs of 500 samples, 32 per process: 8 optimizer steps an epoch on 2 gloo processes
    (250 samples a rank), the original (its own --trainer flags) and the adopted script alike;
    with gloo broken the adopted one trains on one process, 2 micro-batches a step, the same 16
    steps over all 1000 samples (test and predict are not training)."""
    _needs_lightning_cli()
    done, original = torchrun(tmp_path / "original", "lightning_cli", "original",
                              *LIGHTNING_ARGS, *LIGHTNING_LAUNCH)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = {rank: (r["steps"], r["samples"]) for rank, r in only(original).items()}
    assert counts == {0: (16, 500), 1: (16, 500)}
    done, adopted = torchrun(tmp_path / "adopted", "lightning_cli", "adopted", *LIGHTNING_ARGS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {rank: (r["steps"], r["samples"]) for rank, r in only(adopted).items()} == counts
    done, alone = torchrun(tmp_path / "broken", "lightning_cli", "adopted", *LIGHTNING_ARGS,
                           **BROKEN_GLOO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {rank: (r["steps"], r["samples"]) for rank, r in only(alone).items()} == {
        0: (16, 1000)}


def test_lightning_cli_a_rank_killed_starts_over_and_says_so(tmp_path: Path) -> None:
    """The example keeps no checkpoint to resume from (fit has no ckpt_path): rank 1 SIGKILLed
    under ``run`` mid-run, the relaunch trains all 16 steps again and is announced as a start
    from scratch (no resume claimed); the job ends 0 and leaves nothing running."""
    _needs_lightning_cli()
    proc, out, attempts, reports = supervised_kill(tmp_path, "lightning_cli", *LIGHTNING_ARGS,
                                                   at=10, step_s=0.1)
    assert proc.returncode == 0, out[-3000:]
    assert [(a["action"], a["resumed_from"]) for a in attempts] == [("retry", None),
                                                                     ("finish", None)]
    for rank in (0, 1):
        first, second = reports[rank]
        assert first["steps"] >= 10 and (second["steps"], second["samples"]) == (16, 500)


# ----- in the shape of the Keras guide "Multi-GPU distributed training with TensorFlow" -----------
@pytest.mark.tensorflow
def test_keras_guide_as_the_original_and_a_killed_run_starts_over(tmp_path: Path) -> None:
    """The guide's three fits (2 epochs; then 1, checkpointed; then 1 more from that checkpoint)
    on 512 samples of batch 32: 64 training batches, and the last model's optimizer at 32
    updates, for the original and the adopted script alike (one CPU device: MirroredStrategy
    has one replica, the decision is one CPU with no collective to break). Under ``run`` (one
    process, as run runs Keras) the training process SIGKILLed in the first fit: the relaunch
    runs the guide again from its start, the same 64 batches and 32 updates, no resume claimed
    (the guide restores its own checkpoint only between its fits); nothing is left running."""
    pytest.importorskip("tensorflow")
    done, original = python(tmp_path / "original", "keras_guide", "original")
    assert done.returncode == 0, done.stderr[-3000:]
    counts = {rank: (r["batches"], r["steps"]) for rank, r in only(original).items()}
    assert counts == {0: (64, 32)}
    done, adopted = python(tmp_path / "adopted", "keras_guide", "adopted")
    assert done.returncode == 0, done.stderr[-3000:]
    assert {rank: (r["batches"], r["steps"]) for rank, r in only(adopted).items()} == counts

    proc, out, attempts, reports = supervised_kill(
        tmp_path / "killed", "keras_guide", nproc=1, rank=0, at=10, step_s=0.05,
        framework_var="batches", TF_CPP_MIN_LOG_LEVEL="2")
    assert proc.returncode == 0, out[-3000:]
    assert [(a["action"], a["resumed_from"]) for a in attempts] == [("retry", None),
                                                                     ("finish", None)]
    first, second = reports[0]
    assert first["batches"] >= 10 and (second["batches"], second["steps"]) == (64, 32)
