"""A Keras full-model checkpoint across a change of strategy (issue 43 item 4): saved on 2
mirrored logical CPU replicas and loaded on the one-device fallback that accumulates 2
micro-batches, and the other way round, ``load_model`` resumes as the uninterrupted run goes on
(same optimizer updates, same weights). Each run in its own process (tests/_keras_load_job.py:
logical devices are fixed per process); this pytest process never imports TensorFlow."""

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

ROOT = Path(__file__).parents[1]
JOB = ROOT / "tests" / "_keras_load_job.py"
pytestmark = [
    pytest.mark.slow, pytest.mark.tensorflow,
    pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                       reason="tensorflow is not installed"),
]


def _jobs(tmp: Path, runs: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """Every ``(variant, checkpoint)`` in one process, in order; their results by variant."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}
    env.update(PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3",
               OMP_NUM_THREADS="1")
    args = [str(a) for v, ckpt in runs
            for a in (v, tmp / ckpt, tmp / f"{v.replace(':', '-')}.json")]
    done = subprocess.run([sys.executable, str(JOB), *args], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=deadline(300))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return {v: json.loads((tmp / f"{v.replace(':', '-')}.json").read_text()) for v, _ in runs}


def test_a_full_model_checkpoint_resumes_across_a_change_of_strategy(tmp_path: Path) -> None:
    saved = _jobs(tmp_path, [("save:1", "mirrored.keras"), ("save:2", "fallback.keras")])
    # the uninterrupted runs: 2 epochs of 4 updates, the same weights on either strategy
    assert (saved["save:1"]["replicas"], saved["save:2"]["replicas"]) == (2, 1)
    assert saved["save:1"]["iterations"] == saved["save:2"]["iterations"] == 8
    assert saved["save:1"]["weights"] == pytest.approx(saved["save:2"]["weights"], abs=1e-6)
    loaded = _jobs(tmp_path, [("load:2", "mirrored.keras"), ("load:1", "fallback.keras"),
                              ("plain:2", "mirrored.keras"), ("plain:1", "fallback.keras")])
    onto_fallback, onto_mirrored = loaded["load:2"], loaded["load:1"]
    assert "error" not in onto_fallback and "error" not in onto_mirrored
    assert (onto_fallback["replicas"], onto_fallback["accumulation"]) == (1, 2)
    assert (onto_mirrored["replicas"], onto_mirrored["accumulation"]) == (2, 1)
    for run, uninterrupted in ((onto_fallback, saved["save:1"]),
                               (onto_mirrored, saved["save:2"])):
        assert run["iterations"] == 8  # 4 updates restored, 4 more: no update redone or lost
        assert run["weights"] == pytest.approx(uninterrupted["weights"], abs=1e-6)
    # keras.models.load_model alone: the fallback refuses the optimizer that does not
    # accumulate (the check before the first step); MirroredStrategy cannot run the one that
    # does (keras-team/keras#20582)
    assert loaded["plain:2"]["error"] == "InvalidOptionError"
    assert loaded["plain:1"]["error"] == "RuntimeError"
