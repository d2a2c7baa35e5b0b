"""TfRuntime: 2 mirrored logical CPU replicas train exactly like 1 device accumulating 2 steps.

Logical devices are fixed per process, so every TensorFlow run happens in its own subprocess
(all started at once, one deadline); this pytest process never imports TensorFlow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import resilient_strategy.frameworks.tensorflow as runtime_module
from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.frameworks.tensorflow import TfRuntime, replica_devices

np = pytest.importorskip("numpy")

SRC = Path(runtime_module.__file__).parents[2]  # the package the tests import
PER_REPLICA = 16

# `python -c TRAIN variant out.npy per_replica`: 2 epochs of SGD on 128 samples, one global batch of 32 per
# update, from fixed initial weights; saves the final weights (and the initial ones).
TRAIN = """
import sys
import numpy as np
from resilient_strategy.frameworks.tensorflow import TfRuntime

variant, out, per = sys.argv[1], sys.argv[2], int(sys.argv[3])
if variant in ("hierarchical_copy", "reduction_to_one_device"):
    rt = TfRuntime(variant, (0, 1), 1, 2 * per, per, logical_cpus=2)
else:  # "accumulate" / "wrap": one device, 2 micro-batches per update
    rt = TfRuntime("single_device", (0,), 2, 2 * per, per, logical_cpus=1)
import keras
import tensorflow as tf

rng = np.random.default_rng(0)
x = rng.normal(size=(128, 8)).astype("float32")
y = rng.integers(0, 4, size=128)
w0 = [rng.normal(size=s).astype("float32") * 0.3 for s in ((8, 16), (16,), (16, 4), (4,))]
with rt.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(4)])
    model.set_weights(w0)
    if variant == "wrap":
        opt = rt.wrap_optimizer(keras.optimizers.SGD(0.5))
    else:
        opt = keras.optimizers.SGD(0.5, **rt.optimizer_kwargs())
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
assert rt.strategy.num_replicas_in_sync == rt.num_replicas
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(rt.batch_size_to_feed)
model.fit(ds, epochs=2, shuffle=False, verbose=0)
flat = lambda ws: np.concatenate([np.ravel(w) for w in ws])
np.save(out, np.stack([flat(model.get_weights()), flat(w0)]))
"""

# `python -c INSPECT out.json`: facts about one process's strategies, as JSON.
INSPECT = """
import json, sys
from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.frameworks.tensorflow import LogicalDevicesError, TfRuntime

out = {}
rt = TfRuntime("hierarchical_copy", (0, 1), 1, 64, 32, logical_cpus=2)
s = rt.strategy
import tensorflow as tf
with rt.scope():
    inside = tf.distribute.get_strategy()
out["same_object"] = s is rt.strategy is inside
out["replicas"] = s.num_replicas_in_sync
out["ops"] = {}
for backend in ("nccl", "hierarchical_copy", "reduction_to_one_device"):
    st = TfRuntime(backend, (0, 1), 1, 64, 32, logical_cpus=2).strategy
    out["ops"][backend] = type(st.extended._cross_device_ops).__name__
out["one_device"] = type(TfRuntime("cpu", (), 2, 64, 32).strategy).__name__
try:
    TfRuntime("hierarchical_copy", (0, 1, 2), 1, 96, 32, logical_cpus=3).strategy
except LogicalDevicesError as exc:
    out["late_logical_devices"] = str(exc)
import keras
acc = TfRuntime("single_device", (0,), 2, 64, 32, logical_cpus=2)
with acc.scope():
    dense = keras.layers.Dense(2)
    dense.build((None, 3))
    opt = keras.optimizers.SGD(0.1)
    opt.build(dense.trainable_variables)
try:
    acc.wrap_optimizer(opt)
except InvalidOptionError as exc:
    out["wrap_built"] = str(exc)
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
"""

VARIANTS = ("hierarchical_copy", "reduction_to_one_device", "accumulate", "wrap")


def _run_all(cmds: dict[str, list[str]], logs: Path, timeout: float = 100) -> None:
    """Run the commands at once under one deadline; kill the stragglers; fail with the log."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    procs = {}
    for name, cmd in cmds.items():
        with open(logs / f"{name}.log", "w") as log:
            procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    try:
        for p in procs.values():
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for name, p in procs.items():
        assert p.returncode == 0, (logs / f"{name}.log").read_text()[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every TensorFlow subprocess of this module, run once (~20 s on 2 cores)."""
    out = tmp_path_factory.mktemp("tf")
    cmds = {v: [sys.executable, "-c", TRAIN, v, str(out / f"{v}.npy"), str(PER_REPLICA)] for v in VARIANTS}
    cmds["inspect"] = [sys.executable, "-c", INSPECT, str(out / "inspect.json")]
    _run_all(cmds, out)
    return out


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.parametrize("variant", ["hierarchical_copy", "reduction_to_one_device", "wrap"])
def test_two_replicas_match_one_device_accumulating(runs: Path, variant: str) -> None:
    reference, initial = np.load(runs / "accumulate.npy")
    weights, _ = np.load(runs / f"{variant}.npy")
    np.testing.assert_allclose(weights, reference, rtol=1e-5, atol=1e-6)
    assert np.abs(reference - initial).max() > 1e-2  # training moved the weights


@pytest.mark.slow
@pytest.mark.tensorflow
def test_strategy_facts(runs: Path) -> None:
    facts: dict[str, Any] = json.loads((runs / "inspect.json").read_text())
    assert facts["same_object"] is True
    assert facts["replicas"] == 2
    assert facts["ops"] == {
        "nccl": "NcclAllReduce",
        "hierarchical_copy": "HierarchicalCopyAllReduce",
        "reduction_to_one_device": "ReductionToOneDevice",
    }
    assert facts["one_device"] == "OneDeviceStrategy"
    assert "already started with 2 logical CPU device(s), so 3" in facts["late_logical_devices"]
    assert "already built" in facts["wrap_built"]


@pytest.mark.slow
def test_importing_the_runtimes_imports_no_framework() -> None:
    code = (
        "import sys, resilient_strategy.frameworks.tensorflow, resilient_strategy.frameworks.torch;"
        "print(sorted({'tensorflow', 'torch', 'keras'} & set(sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_feed_batch_and_optimizer_kwargs() -> None:
    mirrored = TfRuntime("hierarchical_copy", (0, 1), 1, 64, 32)
    assert mirrored.batch_size_to_feed == 64 and mirrored.optimizer_kwargs() == {}
    assert mirrored.replica_devices == ("/gpu:0", "/gpu:1")
    fallback = TfRuntime("single_device", (1,), 4, 64, 16)
    assert fallback.batch_size_to_feed == 16  # 4 micro-batches make the global batch
    assert fallback.optimizer_kwargs() == {"gradient_accumulation_steps": 4}
    assert fallback.replica_devices == ("/gpu:1",)
    assert TfRuntime("cpu", (), 2, 64, None).batch_size_to_feed == 32
    assert TfRuntime("cpu", (), 1, None, None).batch_size_to_feed is None


def test_replica_devices_in_logical_cpu_mode() -> None:
    assert replica_devices("reduction_to_one_device", (), 2) == ("/cpu:0", "/cpu:1")
    assert replica_devices("single_device", (), 2) == ("/cpu:0",)
    assert replica_devices("cpu", (3,), 0) == ("/cpu:0",)
    with pytest.raises(InvalidOptionError):
        replica_devices("nccl", (0, 2), 2)
    with pytest.raises(InvalidOptionError):
        replica_devices("nccl", (), 0)


def test_mirrored_accumulation_is_refused() -> None:
    # keras-team/keras#20582: accumulation's ops.cond cannot merge_call under MirroredStrategy.
    with pytest.raises(InvalidOptionError, match="20582"):
        TfRuntime("hierarchical_copy", (0, 1), 2, 64, 16)


def test_wrap_optimizer_rules() -> None:
    class Keras3Like:
        gradient_accumulation_steps: int | None = None
        built = False

    rt = TfRuntime("single_device", (0,), 2, 64, 32)
    opt = Keras3Like()
    assert rt.wrap_optimizer(opt) is opt and opt.gradient_accumulation_steps == 2
    assert rt.wrap_optimizer(opt) is opt  # same value again is fine
    opt.gradient_accumulation_steps = 3
    with pytest.raises(InvalidOptionError, match="already accumulates 3"):
        rt.wrap_optimizer(opt)
    with pytest.raises(InvalidOptionError, match="not a Keras 3 optimizer"):
        rt.wrap_optimizer(object())
    assert TfRuntime("cpu", (), 1, 64, 64).wrap_optimizer(object()) is not None
