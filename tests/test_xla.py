"""XLA under a cross-device-op fallback: a jit_compile=True model would bypass
HierarchicalCopy / ReductionToOneDevice, so the fit-time check turns XLA off (and warns)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

from resilient_strategy.frameworks.tensorflow import TfRuntime

SRC = str(Path(__file__).resolve().parents[1] / "src")


class ModelLike:
    def __init__(self, jit: Any) -> None:
        self.jit_compile = jit
        self.rebuilt: list[bool] = []

    def make_train_function(self, force: bool = False) -> None:
        self.rebuilt.append(force)


@pytest.mark.parametrize("backend", ["hierarchical_copy", "reduction_to_one_device"])
def test_xla_is_turned_off_where_it_would_bypass_the_fallback(
        backend: str, caplog: pytest.LogCaptureFixture) -> None:
    rt = TfRuntime(backend, (0, 1), 1, 64, 32)
    model = ModelLike(True)
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        assert rt.check_xla(model) is True
    assert model.jit_compile is False and model.rebuilt == [True]
    assert any("jit_compile=True" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("backend", "jit"), [
    ("nccl", True),  # XLA's all-reduce is NCCL's anyway: nothing to make real
    ("single_device", True),
    ("hierarchical_copy", False),
    ("hierarchical_copy", "auto"),  # Keras resolves "auto" to False under tf.distribute
])
def test_xla_is_left_alone_elsewhere(backend: str, jit: Any) -> None:
    model = ModelLike(jit)
    assert TfRuntime(backend, (0, 1) if backend != "single_device" else (0,), 1, 64, 32
                     ).check_xla(model) is False
    assert model.jit_compile == jit and model.rebuilt == []


SCRIPT = """
import json, logging, sys
import numpy as np
from resilient_strategy.frameworks.tensorflow import TfRuntime
records = []
class H(logging.Handler):
    def emit(self, r): records.append(r.getMessage())
logging.getLogger("resilient_strategy").addHandler(H())
import keras
rt = TfRuntime("hierarchical_copy", (), 1, 16, 8, logical_cpus=2)
with rt.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True)
before = model.jit_compile
x = np.ones((32, 3), "float32"); y = np.zeros((32, 2), "float32")
model.fit(x, y, batch_size=rt.batch_size_to_feed, verbose=0, callbacks=rt.callbacks())
copies = [v.values if hasattr(v, "values") else v.value.values for v in model.trainable_variables]
same = all(np.array_equal(np.asarray(c[0]), np.asarray(c[1])) for c in copies)
json.dump({"before": before, "after": model.jit_compile, "warned": any("jit_compile=True" in m
           for m in records), "replicas_agree": bool(same)}, open(sys.argv[1], "w"))
"""


@pytest.mark.slow
@pytest.mark.tensorflow
def test_fit_with_jit_compile_on_the_fallback_trains_without_xla(tmp_path: Path) -> None:
    pytest.importorskip("tensorflow")
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": SRC, "KERAS_BACKEND": "tensorflow",
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], env=env, timeout=deadline(300),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got == {"before": True, "after": False, "warned": True, "replicas_agree": True}
