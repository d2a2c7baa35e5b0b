"""`resilient-strategy run` with Keras on 2 logical CPU devices: a collective that hangs at step
12 relaunches on the next TensorFlow candidate and Keras' BackupAndRestore resumes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import deadline

pytest.importorskip("tensorflow")
pytest.importorskip("torch")  # the supervisor runs workers through torch's elastic agent

ROOT = Path(__file__).resolve().parents[1]


def test_keras_hang_relaunches_and_backup_and_restore_resumes(tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}
    env.update({
        "PYTHONPATH": str(ROOT / "src"), "TMPDIR": str(tmp_path / "tmp"),
        "RESILIENT_STRATEGY_CACHE_DIR": str(tmp_path / "cache"),
        "RESILIENT_STRATEGY_PREFER": "hierarchical_copy",  # a 2-replica first choice
        "RESILIENT_STRATEGY_TIMEOUT": "120",  # a loaded machine must not fail the probes
        "RESILIENT_STRATEGY_TRAIN_FAULT": "hang:0:hierarchical_copy:12",  # in epoch 2 of 3
        "TF_CPP_MIN_LOG_LEVEL": "2",
    })
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_strategy", "run", "--logical-cpus", "2",
         "--stall-timeout", "5", str(ROOT / "examples" / "keras_train.py"), "--cpu-replicas", "2",
         "--samples", "2048", "--epochs", "3", "--checkpoint-dir", str(tmp_path / "backup")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=deadline(600),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    chosen = re.findall(r"resilient_strategy chose: (.*?)[.(]", proc.stdout)
    # retried once on HierarchicalCopy (the same hang again), then stepped down
    assert len(chosen) == 3 and "HierarchicalCopy" in chosen[0] and "HierarchicalCopy" in \
        chosen[1] and "HierarchicalCopy" not in chosen[2]
    epochs = re.findall(r"^epoch (\d+):", proc.stdout, re.MULTILINE)
    assert epochs == ["1", "2", "3"]  # epoch 1 is not trained again after the relaunch
    [record] = (tmp_path / "resilient-strategy-evidence").glob("*/attempts.json")
    attempts = json.loads(record.read_text())["attempts"]
    assert [(a["verdict"]["kind"], a["action"]) for a in attempts] == [
        ("stall", "retry"), ("stall", "step_down"), ("ok", "finish")]
    assert not (tmp_path / "backup").exists()  # BackupAndRestore removes it when training ends
    # nothing of ours is left (TensorFlow's autograph leaves its generated sources there)
    assert [p.name for p in (tmp_path / "tmp").iterdir()
            if not p.name.startswith(("torchinductor_", "__autograph_generated_file"))] == []
