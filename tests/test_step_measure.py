"""The user's own step, measured during training (issue 41 items 3 and 6): the window of
optimizer steps after the warm-up (`frameworks.stepmeter`), its event in ``to_dict()``, and the
measured "another proven candidate is clearly faster" on a communication-heavy step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from resilient_strategy.frameworks.stepmeter import MEASURE_FROM, MEASURE_STEPS, StepMeter

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_measure_step.py"
STEPS = MEASURE_FROM + MEASURE_STEPS + 2  # the window closes within the run


def _torchrun(out: Path, mode: str, steps: int) -> dict[int, dict[str, Any]]:
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "RESILIENT_STRATEGY_CACHE_DIR": str(out / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("RESILIENT_STRATEGY_PROBE_FAULT", None)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(SCRIPT), str(out), mode, str(steps)],
        cwd=out, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def _kinds(d: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in d["events"] if e["kind"] == kind]


def test_meter_measures_one_window_after_the_warm_up() -> None:
    seen: list[Any] = []
    meter = StepMeter(on_done=seen.append, start=2, steps=3)
    steps = 0
    while meter.live and steps < 8:  # two micro-steps an optimizer step, 4 samples each
        meter.micro_step(False, 4)
        meter.update_begins()
        meter.micro_step(True, 4)
        steps += 1
    assert not meter.live and len(seen) == 1 and steps == 5
    m = seen[0]
    assert (m.first_step, m.steps, m.micro_steps, m.samples) == (3, 3, 6, 24)
    assert (m.how, m.comm_wait_s, m.comm_s) == ("no_collective", 0.0, None)
    assert m.wall_s >= m.update_s >= 0.0 and m.sample_compute_s is not None


def test_a_micro_step_of_unknown_samples_leaves_the_samples_unknown() -> None:
    meter = StepMeter(start=0, steps=2, how="not_separated", note="why")
    meter.micro_step(True, 8)  # opens the window (start=0: at once)
    meter.micro_step(True, None)
    meter.micro_step(True, 8)
    assert meter.result is not None and meter.result.samples is None
    assert meter.result.comm_wait_s is None and meter.result.sample_compute_s is None


@pytest.mark.slow
@pytest.mark.torch
def test_the_step_measured_is_in_to_dict_after_the_window(tmp_path: Path) -> None:
    """2 gloo processes through sel.prepare / sel.step: each rank's to_dict carries the window's
    measurement, DDP's wait told by the gradients' hooks."""
    ranks = _torchrun(tmp_path / "light", "light", STEPS)
    assert sorted(ranks) == [0, 1]
    params = (64 * 64 + 64 + 64 * 4 + 4) * 4
    for d in ranks.values():
        assert d["backend"] == "gloo" and d["num_replicas"] == 2
        m = d["measured_step"]
        assert m is not None and _kinds(d, "step_measured") == [m]
        assert m["candidate"]["key"] == "torch:gloo:cpu"
        assert (m["first_step"], m["steps"], m["micro_steps"]) == (
            MEASURE_FROM + 1, MEASURE_STEPS, MEASURE_STEPS * d["accumulation_steps"])
        assert m["samples"] == MEASURE_STEPS * d["global_batch_size"] // 2
        assert m["how"] == "ddp_wait_cpu" and m["gradient_bytes"] == params
        assert m["comm_s"] is None and 0 <= m["comm_wait_s"] <= m["step_s"]
        assert m["compute_s"] == pytest.approx(m["step_s"] - m["comm_wait_s"])
        assert m["sample_seconds"] > 0 and m["update_s"] > 0


@pytest.mark.slow
@pytest.mark.torch
def test_fewer_replicas_measured_faster_on_a_communication_heavy_step(tmp_path: Path) -> None:
    """32 MiB all-reduced over gloo each step for almost no compute, through sel.adopt: the
    measured step names one process (proven: it needs no probe) as clearly faster, with the
    planner's estimate from the measured compute."""
    ranks = _torchrun(tmp_path / "heavy", "heavy", STEPS)
    for d in ranks.values():
        m = d["measured_step"]
        assert m["how"] == "ddp_wait_cpu" and m["gradient_bytes"] >= 32 << 20
        assert m["comm_wait_s"] > m["compute_s"]
        (faster,) = _kinds(d, "measured_faster")
        assert faster["chosen"]["key"] == "torch:gloo:cpu"
        assert faster["faster"]["key"] == "torch:cpu:cpu"
        assert faster["chosen_step_s"] == m["step_s"]
        assert faster["speedup"] > 1 + faster["margin"]
        assert faster["faster_step_s"] * faster["speedup"] == pytest.approx(m["step_s"])
        assert faster["sample_seconds"] == m["sample_seconds"]


TF_FIT = """
import json, sys
import numpy as np
from resilient_strategy.frameworks.tensorflow import TfRuntime, measure_callback

backend, replicas = sys.argv[1], int(sys.argv[2])
rt = TfRuntime(backend, tuple(range(replicas)), 1, 8 * replicas, 8, logical_cpus=2)
import keras
strategy = rt.strategy
with rt.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
x, y = np.zeros((8 * replicas * 30, 8), "float32"), np.zeros((8 * replicas * 30, 4), "float32")
seen = []
rt.meter.on_done = seen.append
model.fit(x, y, batch_size=rt.batch_size_to_feed, epochs=1, verbose=0,
          callbacks=[measure_callback(rt.meter, 1, 8)])
m = seen[0]
print(json.dumps({"how": m.how, "note": m.note, "steps": m.steps, "samples": m.samples,
                  "wall": m.wall_s, "wait": m.comm_wait_s, "live": rt.meter.live}))
"""


@pytest.mark.slow
@pytest.mark.tensorflow
def test_keras_fit_measured_by_its_callback() -> None:
    """One replica: the step is its compute; two mirrored replicas: the step's time only, and
    the measurement says communication was not separated."""
    pytest.importorskip("tensorflow")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": "",
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    runs = {name: subprocess.Popen([sys.executable, "-c", TF_FIT, backend, replicas],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
            for name, backend, replicas in (("one", "single_device", "1"),
                                            ("mirrored", "hierarchical_copy", "2"))}
    got = {}
    for name, proc in runs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        got[name] = json.loads(out.strip().splitlines()[-1])
    for m in got.values():
        assert (m["steps"], m["samples"], m["live"]) == (MEASURE_STEPS, 8 * MEASURE_STEPS, False)
        assert m["wall"] > 0
    assert (got["one"]["how"], got["one"]["wait"]) == ("no_collective", 0.0)
    assert got["mirrored"]["how"] == "not_separated" and got["mirrored"]["wait"] is None
