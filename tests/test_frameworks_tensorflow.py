"""TfRuntime: 2 mirrored logical CPU replicas train exactly like 1 device accumulating 2 steps.

Logical devices are fixed per process, so every TensorFlow run happens in its own subprocess
(all started at once, one deadline); this pytest process never imports TensorFlow.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline

import resilient_strategy.frameworks.tensorflow as runtime_module
from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.frameworks.tensorflow import StrategyRegistry, TfRuntime, replica_devices

np = pytest.importorskip("numpy")

SRC = Path(runtime_module.__file__).parents[2]  # the package the tests import
PER_REPLICA = 16

# `python -c TRAIN variant out.npz per_replica`: 2 epochs of SGD on 128 samples, one global batch
# of 32 per update, from fixed initial weights, once per learning rate: "const" (0.5) and
# "schedule" (ExponentialDecay(0.5, decay_steps=2, decay_rate=0.5) through the runtime), and for
# "accumulate" also "unwrapped" (the schedule given straight to the optimizer, as before the fix).
# Saves the final weights of each, and the initial ones.
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

strategy = rt.strategy  # before any TF op: it configures the logical devices
rng = np.random.default_rng(0)
x = rng.normal(size=(128, 8)).astype("float32")
y = rng.integers(0, 4, size=128)
w0 = [rng.normal(size=s).astype("float32") * 0.3 for s in ((8, 16), (16,), (16, 4), (4,))]
flat = lambda ws: np.concatenate([np.ravel(w) for w in ws])
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(rt.batch_size_to_feed)
results = {"initial": flat(w0)}
for lr in ("const", "schedule") + (("unwrapped",) if variant == "accumulate" else ()):
    rate = 0.5 if lr == "const" else keras.optimizers.schedules.ExponentialDecay(0.5, 2, 0.5)
    with rt.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(4)])
        model.set_weights(w0)
        if lr == "unwrapped":
            opt = keras.optimizers.SGD(rate, **rt.optimizer_kwargs())
        elif variant == "wrap":
            opt = rt.wrap_optimizer(keras.optimizers.SGD(rate))
        else:
            opt = keras.optimizers.SGD(**rt.optimizer_kwargs(learning_rate=rate))
        model.compile(optimizer=opt,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert rt.strategy is strategy and strategy.num_replicas_in_sync == rt.num_replicas
    model.fit(ds, epochs=2, shuffle=False, verbose=0, callbacks=rt.callbacks())
    results[lr] = flat(model.get_weights())
np.savez(out, **results)
"""

# `python -c INSPECT out.json`: facts about one process's strategies, as JSON.
INSPECT = """
import json, logging, sys
from resilient_strategy.errors import InvalidOptionError
from resilient_strategy.frameworks.tensorflow import (
    STRATEGIES, LogicalDevicesError, TfRuntime, update_step_schedule, update_step_schedule_class)

class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []
    def emit(self, record):
        self.messages.append(record.getMessage())

records = Records()
logging.getLogger("resilient_strategy").addHandler(records)
out = {}
rt = TfRuntime("hierarchical_copy", (0, 1), 1, 64, 32, logical_cpus=2)
s = rt.strategy
import tensorflow as tf
with rt.scope():
    inside = tf.distribute.get_strategy()
out["same_object"] = s is rt.strategy is inside
out["replicas"] = s.num_replicas_in_sync
# a second Selection with the same key: the same strategy, no warning
out["second_runtime_shares"] = TfRuntime("hierarchical_copy", (0, 1), 1, 128, 64,
                                         logical_cpus=2).strategy is s
out["warnings_same_key"] = list(records.messages)
out["ops"] = {}
for backend in ("nccl", "hierarchical_copy", "reduction_to_one_device"):
    st = TfRuntime(backend, (0, 1), 1, 64, 32, logical_cpus=2).strategy
    out["ops"][backend] = type(st.extended._cross_device_ops).__name__
out["one_device"] = type(TfRuntime("cpu", (), 2, 64, 32).strategy).__name__
out["mirrored_warnings"] = list(records.messages)
out["registry"] = sorted(k[0] for k in STRATEGIES.keys())
try:
    TfRuntime("hierarchical_copy", (0, 1, 2), 1, 96, 32, logical_cpus=3).strategy
except LogicalDevicesError as exc:
    out["late_logical_devices"] = str(exc)
import keras
import numpy as np
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

# the fit-time check (callbacks()): a forgotten **optimizer_kwargs() fails before the first step
x = np.zeros((64, 3), "float32")
y = np.zeros((64, 2), "float32")
def fit(make_optimizer):
    with acc.scope():
        opt = make_optimizer()
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=opt, loss="mse")
    w = model.get_weights()
    try:
        model.fit(x, y, batch_size=acc.batch_size_to_feed, verbose=0, callbacks=acc.callbacks())
    except InvalidOptionError as exc:
        return str(exc), all(np.array_equal(a, b) for a, b in zip(w, model.get_weights()))
    return None, int(opt.iterations.numpy())
out["forgot_kwargs"] = fit(lambda: keras.optimizers.SGD(0.1))
out["with_kwargs"] = fit(lambda: keras.optimizers.SGD(0.1, **acc.optimizer_kwargs()))
del records.messages[:]
decay = keras.optimizers.schedules.ExponentialDecay(0.5, 2, 0.5)
out["unwrapped_schedule"] = fit(lambda: keras.optimizers.SGD(decay, **acc.optimizer_kwargs()))
out["unwrapped_schedule_warnings"] = list(records.messages)

# the wrapped schedule: floor(step / 2), and it survives get_config / from_config
opt = keras.optimizers.SGD(**acc.optimizer_kwargs(learning_rate=decay))
again = keras.optimizers.SGD.from_config(opt.get_config())
out["schedule"] = {
    "type": type(again._learning_rate).__name__,
    "steps": again._learning_rate.steps,
    "values": [float(again._learning_rate(i)) for i in range(6)],
    "expected": [float(decay(i // 2)) for i in range(6)],
    "idempotent": update_step_schedule(opt._learning_rate, 2) is opt._learning_rate,
    "unwraps": update_step_schedule(opt._learning_rate, 1) is decay,
    "registered": keras.saving.get_registered_object("resilient_strategy>UpdateStepSchedule")
    is update_step_schedule_class(),
}
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
    until = time.monotonic() + deadline(timeout)
    try:
        for p in procs.values():
            p.wait(timeout=max(0.1, until - time.monotonic()))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=deadline(10))
    for name, p in procs.items():
        assert p.returncode == 0, (logs / f"{name}.log").read_text()[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every TensorFlow subprocess of this module, run once (~20 s on 2 cores)."""
    out = tmp_path_factory.mktemp("tf")
    cmds = {v: [sys.executable, "-c", TRAIN, v, str(out / f"{v}.npz"), str(PER_REPLICA)] for v in VARIANTS}
    cmds["inspect"] = [sys.executable, "-c", INSPECT, str(out / "inspect.json")]
    _run_all(cmds, out)
    return out


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.parametrize("lr", ["const", "schedule"])
@pytest.mark.parametrize("variant", ["hierarchical_copy", "reduction_to_one_device", "wrap"])
def test_two_replicas_match_one_device_accumulating(runs: Path, variant: str, lr: str) -> None:
    # "schedule": ExponentialDecay advances once per update on both sides (UpdateStepSchedule)
    reference = np.load(runs / "accumulate.npz")
    weights = np.load(runs / f"{variant}.npz")
    np.testing.assert_allclose(weights[lr], reference[lr], rtol=1e-5, atol=1e-6)
    assert np.abs(reference[lr] - reference["initial"]).max() > 1e-2  # training moved the weights


@pytest.mark.slow
@pytest.mark.tensorflow
def test_an_unwrapped_schedule_would_not_match(runs: Path) -> None:
    # Without UpdateStepSchedule the schedule sees micro-steps and decays twice as fast: the
    # equivalence above would fail, which shows that it tests the wrapping.
    mirrored = np.load(runs / "hierarchical_copy.npz")["schedule"]
    unwrapped = np.load(runs / "accumulate.npz")["unwrapped"]
    assert np.abs(unwrapped - mirrored).max() > 1e-3
    assert not np.allclose(unwrapped, mirrored, rtol=1e-5, atol=1e-6)


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
@pytest.mark.tensorflow
def test_one_strategy_per_key_per_process(runs: Path) -> None:
    facts: dict[str, Any] = json.loads((runs / "inspect.json").read_text())
    assert facts["second_runtime_shares"] is True
    assert facts["warnings_same_key"] == []
    # nccl and reduction_to_one_device are new MirroredStrategy keys beside hierarchical_copy
    warned = facts["mirrored_warnings"]
    assert len(warned) == 2, warned
    assert all("second MirroredStrategy" in w for w in warned)
    assert "nccl over /cpu:0, /cpu:1" in warned[0]
    assert "reduction_to_one_device over" in warned[1]
    assert facts["registry"] == ["cpu", "hierarchical_copy", "nccl", "reduction_to_one_device"]


@pytest.mark.slow
@pytest.mark.tensorflow
def test_fit_checks_the_optimizer_accumulates(runs: Path) -> None:
    facts: dict[str, Any] = json.loads((runs / "inspect.json").read_text())
    message, untouched = facts["forgot_kwargs"]
    assert "gradient_accumulation_steps=None" in message and "optimizer_kwargs" in message
    assert "1/2 of the global batch" in message
    assert untouched is True  # raised before any training step
    assert facts["with_kwargs"] == [None, 1]  # 2 micro-batches of 32 = 1 update
    assert facts["unwrapped_schedule"] == [None, 1]  # a warning, not an error
    (warning,) = facts["unwrapped_schedule_warnings"]
    assert "ExponentialDecay counts micro-steps" in warning


@pytest.mark.slow
@pytest.mark.tensorflow
def test_update_step_schedule(runs: Path) -> None:
    schedule = json.loads((runs / "inspect.json").read_text())["schedule"]
    assert schedule["type"] == "UpdateStepSchedule" and schedule["steps"] == 2
    assert schedule["registered"] is True
    assert schedule["idempotent"] is True and schedule["unwraps"] is True
    np.testing.assert_allclose(schedule["values"], schedule["expected"], rtol=1e-6)
    assert schedule["values"][0] == schedule["values"][1] != schedule["values"][2]


@pytest.mark.slow
def test_importing_the_runtimes_imports_no_framework() -> None:
    code = (
        "import sys, resilient_strategy.frameworks.tensorflow, resilient_strategy.frameworks.torch;"
        "print(sorted({'tensorflow', 'torch', 'keras'} & set(sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=deadline(60)
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


def test_optimizer_kwargs_pass_a_learning_rate() -> None:
    fallback = TfRuntime("single_device", (0,), 2, 64, 32)
    assert fallback.optimizer_kwargs(learning_rate=0.1) == {
        "learning_rate": 0.1, "gradient_accumulation_steps": 2}

    def by_step(step: int) -> float:  # not a Keras LearningRateSchedule: passed as is
        return 0.1

    assert fallback.optimizer_kwargs(learning_rate=by_step)["learning_rate"] is by_step
    mirrored = TfRuntime("hierarchical_copy", (0, 1), 1, 64, 32)
    assert mirrored.optimizer_kwargs(learning_rate=0.1) == {"learning_rate": 0.1}


def test_check_optimizer() -> None:
    class Keras3Like:
        def __init__(self, steps: int | None) -> None:
            self.gradient_accumulation_steps = steps

    class ModelLike:
        def __init__(self, optimizer: Any) -> None:
            self.optimizer = optimizer

    class LossScaleLike:  # Keras wraps the optimizer in a LossScaleOptimizer for float16
        gradient_accumulation_steps = None

        def __init__(self, inner: Any) -> None:
            self.inner_optimizer = inner

    rt = TfRuntime("single_device", (0,), 2, 64, 32)
    rt.check_optimizer(Keras3Like(2))
    rt.check_optimizer(ModelLike(Keras3Like(2)))
    rt.check_optimizer(ModelLike(LossScaleLike(Keras3Like(2))))
    with pytest.raises(InvalidOptionError, match=r"1/2 of the global batch.*optimizer_kwargs"):
        rt.check_optimizer(ModelLike(Keras3Like(None)))
    with pytest.raises(InvalidOptionError, match="gradient_accumulation_steps=4"):
        rt.check_optimizer(Keras3Like(4))
    with pytest.raises(InvalidOptionError, match="compile the model"):
        rt.check_optimizer(ModelLike(None))
    one = TfRuntime("nccl", (0, 1), 1, 64, 32)
    one.check_optimizer(ModelLike(Keras3Like(None)))  # nothing to check without accumulation
    assert one.callbacks() == []  # and no Keras callback (nor Keras import) then


def test_wrap_optimizer_sets_the_inner_optimizer() -> None:
    class Keras3Like:
        gradient_accumulation_steps: int | None = None
        built = False

    class LossScaleLike:
        def __init__(self, inner: Any) -> None:
            self.inner_optimizer = inner

    inner = Keras3Like()
    outer = LossScaleLike(inner)
    assert TfRuntime("single_device", (0,), 3, 96, 32).wrap_optimizer(outer) is outer
    assert inner.gradient_accumulation_steps == 3


def test_strategy_registry_builds_once_per_key(caplog: pytest.LogCaptureFixture) -> None:
    registry = StrategyRegistry()
    built: list[str] = []

    def build(name: str) -> Any:
        def make() -> object:
            time.sleep(0.01)
            built.append(name)
            return object()

        return make

    mirrored = ("hierarchical_copy", ("/gpu:0", "/gpu:1"), 0)
    got: list[Any] = []
    threads = [
        threading.Thread(target=lambda: got.append(registry.get(mirrored, build("a"))))
        for _ in range(8)
    ]
    with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert built == ["a"] and all(g is got[0] for g in got)
        one = registry.get(("single_device", ("/gpu:0",), 0), build("b"))
        assert registry.get(("single_device", ("/gpu:0",), 0), build("c")) is one
        assert caplog.records == []  # same key again, or a one-device strategy: no warning
        other = registry.get(("nccl", ("/gpu:0", "/gpu:1"), 0), build("d"))
    assert other is not got[0] and built == ["a", "b", "d"]
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "second MirroredStrategy" in record.getMessage()
    assert "hierarchical_copy over /gpu:0, /gpu:1" in record.getMessage()
    assert len(registry.keys()) == 3


def test_runtimes_of_one_configuration_share_a_key() -> None:
    a = TfRuntime("nccl", (0, 1), 1, 64, 32)
    b = TfRuntime("nccl", (0, 1), 1, 128, 64)  # batch sizes do not change the strategy
    assert a.strategy_key == b.strategy_key == ("nccl", ("/gpu:0", "/gpu:1"), 0)
    assert TfRuntime("nccl", (0, 1), 1, 64, 32, logical_cpus=2).strategy_key != a.strategy_key
