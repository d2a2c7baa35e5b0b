"""TensorFlow runtime: the one ``tf.distribute`` strategy a Selection trains with.

Longer than ~450 lines on purpose: one runtime per framework; the Keras pieces (callbacks,
accumulating optimizer, multi-worker strategy) share the one strategy object.

    rt = TfRuntime("single_device", (0,), 2, 256, 128)   # 1 GPU standing in for 2
    with rt.scope():                      # model build, optimizer, compile, load_weights
        model = build_model()
        lr = keras.optimizers.schedules.ExponentialDecay(0.1, 1000, 0.9)
        opt = keras.optimizers.SGD(**rt.optimizer_kwargs(learning_rate=lr))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(dataset.batch(rt.batch_size_to_feed), epochs=3, callbacks=rt.callbacks())

TensorFlow is imported inside functions only: importing this module starts no TF runtime, so
``CUDA_VISIBLE_DEVICES`` set by the selection still takes effect.

One strategy per process: a second ``MirroredStrategy`` in one process caused NCCL errors in the
field (seed report 000). Strategies live in a process-wide registry keyed by (backend, replica
devices, logical CPUs): every TfRuntime with the same key (a second ``resilient_strategy()`` call,
a second Selection) gets the same strategy object, and building a ``MirroredStrategy`` for a
different key while one exists logs a warning on the ``resilient_strategy`` logger.

Across the workers of a ``TF_CONFIG`` cluster (backends ``mw_nccl`` / ``mw_ring`` / ``mw_auto``) the strategy
is a ``MultiWorkerMirroredStrategy`` with that ``CommunicationImplementation`` and the
``process_group_timeout`` as ``CommunicationOptions.timeout_seconds``; it is a subclass that
makes Keras 3's ``fit`` work under it (`keras_multi_worker_class`). Every worker feeds the
global batch (``batch_size_to_feed``: per-replica batch x every worker's replicas): the strategy
rebatches it and shards it between the workers (measured: with a global batch of 16 on two CPU
workers each step saw 8 rows on each worker, different rows, and the weights equalled those of
one process training batches of 16). When worker 0 trains alone it builds a
``OneDeviceStrategy``, which ignores ``TF_CONFIG`` (measured: it trains with ``TF_CONFIG``
naming an absent second worker).

Gradient accumulation (the one-device fallback) uses Keras 3's optimizer argument
``gradient_accumulation_steps``: the optimizer adds each micro-batch gradient to an accumulator
and applies their mean every n-th step. It works under ``OneDeviceStrategy`` only: under
``MirroredStrategy`` its ``ops.cond`` around the update raises "merge_call called while defining
a new graph" (keras-team/keras#20582, open; reproduced with Keras 3.15), so a mirrored runtime
with accumulation is refused at construction.

Keras's learning-rate schedules see micro-steps (``optimizer._iterations``), not optimizer
updates (Keras ``BaseOptimizer`` docstring), so under accumulation a schedule would advance n times
faster than in the mirrored run it replaces. ``optimizer_kwargs(learning_rate=...)`` and
``wrap_optimizer`` therefore wrap a ``LearningRateSchedule`` in ``UpdateStepSchedule``, which
evaluates it at ``floor(step / n)``: the k-th update runs at micro-step ``k * n + n - 1``, so it
sees the schedule at k, as the mirrored run's k-th update does.

Forgetting ``**optimizer_kwargs()`` on the fallback would silently train with 1/n of the global
batch per update. The check is a Keras callback (``callbacks()``, passed to ``model.fit``) whose
``on_train_begin`` runs `TfRuntime.check_optimizer` on the compiled model and raises
``InvalidOptionError`` before the first step; Keras offers no fit-time hook short of
monkeypatching it, which this library does not do.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..errors import InvalidOptionError, ResilientStrategyError
from ..process import PROCESS
from ..vocab import ONE_REPLICA_BACKENDS, Backend
from .stepmeter import StepMeter

log = logging.getLogger("resilient_strategy")

#: Backend -> the ``tf.distribute`` cross-device ops class MirroredStrategy reduces with.
MIRRORED_OPS: dict[Backend, str] = {
    "nccl": "NcclAllReduce",
    "hierarchical_copy": "HierarchicalCopyAllReduce",
    "reduction_to_one_device": "ReductionToOneDevice",
}
ONE_DEVICE = ONE_REPLICA_BACKENDS
#: Backend -> the ``CommunicationImplementation`` of a MultiWorkerMirroredStrategy (TF_CONFIG).
MULTI_WORKER_IMPL: dict[Backend, str] = {"mw_nccl": "NCCL", "mw_ring": "RING", "mw_auto": "AUTO"}
#: Fallbacks whose cross-device op an XLA-compiled train step would bypass.
XLA_BYPASSED = ("hierarchical_copy", "reduction_to_one_device")


class LogicalDevicesError(ResilientStrategyError, RuntimeError):
    """The TF runtime started before the logical CPU devices could be configured."""

    def __init__(self, wanted: int, have: int) -> None:
        self.wanted = wanted
        self.have = have
        super().__init__(
            f"TensorFlow already started with {have} logical CPU device(s), so {wanted} can no "
            "longer be configured. Logical devices are fixed when the TF runtime starts: run "
            "nothing in TensorFlow (no tensors, no list_logical_devices) before the selection "
            "builds its strategy, or use a fresh process."
        )


StrategyKey = tuple[str, tuple[str, ...], int]  # (backend, replica devices, logical CPUs)


class StrategyRegistry:
    """The process's ``tf.distribute`` strategies: one per key, built once, never replaced.

    A second MirroredStrategy in one process caused NCCL errors in the field (seed report 000),
    so a key seen before returns the same object, and a MirroredStrategy for a new key while
    another exists is built (refusing would break code that worked) but logged as a warning.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._built: dict[StrategyKey, Any] = {}

    def get(self, key: StrategyKey, build: Callable[[], Any]) -> Any:
        """The strategy for ``key``; ``build()`` makes it the first time (under the lock)."""
        with self._lock:
            if key in self._built:
                return self._built[key]
            family = (*MIRRORED_OPS, *MULTI_WORKER_IMPL)
            mirrored = [k for k in self._built if k[0] in family]
            if key[0] in family and mirrored:
                log.warning(
                    "building a second MirroredStrategy in this process (%s over %s) while %s "
                    "exists: two MirroredStrategy objects in one process have caused NCCL errors. "
                    "Call resilient_strategy() once per process and reuse its "
                    "Selection, or train the other configuration in a new process.",
                    key[0], ", ".join(key[1]),
                    "; ".join(f"{k[0]} over {', '.join(k[1])}" for k in mirrored),
                )
            strategy = self._built[key] = build()
            return strategy

    def keys(self) -> tuple[StrategyKey, ...]:
        with self._lock:
            return tuple(self._built)


#: This process's strategies (see `StrategyRegistry`).
STRATEGIES = PROCESS.hold("frameworks.tensorflow.strategies", StrategyRegistry,
                          "the tf.distribute strategies of this process, one per key")


class TfRuntime:
    """The strategy, scope, optimizer arguments, checks and feed batch size for one Selection."""

    def __init__(
        self,
        backend: str,
        devices: tuple[int, ...],
        accumulation_steps: int,
        global_batch_size: int | None,
        per_replica_batch_size: int | None,
        logical_cpus: int = 0,
        *,
        workers: int = 1,
        timeout_s: float | None = None,
    ) -> None:
        if backend not in MIRRORED_OPS and backend not in ONE_DEVICE \
                and backend not in MULTI_WORKER_IMPL:
            raise InvalidOptionError(f"TensorFlow has no backend {backend!r}")
        if accumulation_steps < 1 or logical_cpus < 0 or workers < 1:
            raise InvalidOptionError("accumulation_steps and workers must be >= 1 and "
                                     "logical_cpus >= 0")
        if workers > 1 and backend not in MULTI_WORKER_IMPL:
            raise InvalidOptionError(f"{backend} runs in one process; only "
                                     f"{sorted(MULTI_WORKER_IMPL)} span {workers} workers")
        if (backend in MIRRORED_OPS or backend in MULTI_WORKER_IMPL) and accumulation_steps > 1:
            raise InvalidOptionError(
                f"Keras cannot accumulate gradients under MirroredStrategy ({backend}, "
                f"{accumulation_steps} steps; keras-team/keras#20582): use a larger "
                "per-replica batch or the one-device fallback"
            )
        self.backend = backend
        self.accumulation_steps = accumulation_steps
        self.global_batch_size = global_batch_size
        self.per_replica_batch_size = per_replica_batch_size
        self.logical_cpus = logical_cpus
        self.workers = workers
        self.timeout_s = timeout_s
        self.replica_devices = replica_devices(backend, tuple(devices), logical_cpus)
        #: measures the user's step over a window of ``fit`` (`measure_callback`): one
        #: replica's step is its compute; across replicas Keras reduces inside its compiled
        #: step, so the step's time is not split into compute and communication
        self.meter = StepMeter() if self.num_replicas == 1 else StepMeter(
            how="not_separated",
            note="Keras fit reduces the gradients inside its compiled train step: the "
                 "step's time only")

    @property
    def num_replicas(self) -> int:
        """Replicas in sync: this worker's devices times the workers."""
        return len(self.replica_devices) * self.workers

    @property
    def strategy_key(self) -> StrategyKey:
        """What identifies this runtime's strategy in the process-wide `STRATEGIES`."""
        return (self.backend, self.replica_devices, self.logical_cpus)

    @property
    def strategy(self) -> Any:
        """The process's one ``tf.distribute`` strategy for this key, built on first access
        (thread-safe; shared by every TfRuntime with the same `strategy_key`)."""
        return STRATEGIES.get(self.strategy_key, self._build)

    def _build(self) -> Any:
        import tensorflow as tf

        if self.logical_cpus:
            configure_logical_cpus(self.logical_cpus)
        if self.backend in ONE_DEVICE:
            return tf.distribute.OneDeviceStrategy(self.replica_devices[0])
        if self.backend in MULTI_WORKER_IMPL:
            return multi_worker_strategy(MULTI_WORKER_IMPL[self.backend], self.timeout_s)
        ops = getattr(tf.distribute, MIRRORED_OPS[self.backend])()
        return tf.distribute.MirroredStrategy(list(self.replica_devices), cross_device_ops=ops)

    def scope(self) -> Any:
        """``strategy.scope()``: build the model and optimizer, compile and load weights in it."""
        return self.strategy.scope()

    def optimizer_kwargs(self, learning_rate: Any = None) -> dict[str, Any]:
        """Arguments for a Keras 3 optimizer's constructor.

        On the accumulation fallback, ``gradient_accumulation_steps``. With ``learning_rate``,
        also ``learning_rate``: a Keras ``LearningRateSchedule`` is wrapped (when accumulating)
        so that it advances once per update, as in the mirrored run; anything else passes as is.
        """
        n = self.accumulation_steps
        kwargs: dict[str, Any] = {}
        if learning_rate is not None:
            kwargs["learning_rate"] = (
                update_step_schedule(learning_rate, n) if _is_schedule(learning_rate)
                else learning_rate
            )
        if n > 1:
            kwargs["gradient_accumulation_steps"] = n
        return kwargs

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """Set gradient accumulation on an existing Keras 3 optimizer, and make its learning-rate
        schedule advance per update; returns it (a ``LossScaleOptimizer``'s inner one is set).

        Works until the optimizer is built (its accumulators are created in ``build()``, at the
        first ``fit`` step); after that, pass `optimizer_kwargs` to its constructor.
        """
        n = self.accumulation_steps
        if n == 1:
            return optimizer
        inner = _innermost(optimizer)
        current = getattr(inner, "gradient_accumulation_steps", _MISSING)
        if current is _MISSING:
            raise InvalidOptionError(
                f"{type(optimizer).__name__} is not a Keras 3 optimizer (no "
                "gradient_accumulation_steps); build a keras.optimizers one with "
                "**optimizer_kwargs(), or accumulate gradients in your own train step"
            )
        if current and current != n:
            raise InvalidOptionError(
                f"the optimizer already accumulates {current} steps; this selection needs {n} "
                "to keep the global batch"
            )
        if current != n:
            if getattr(inner, "built", False):
                raise InvalidOptionError(
                    "the optimizer is already built, so gradient accumulation can no longer be "
                    "added; create it with **optimizer_kwargs() (or wrap it before compile/fit)"
                )
            inner.gradient_accumulation_steps = n
        schedule = getattr(inner, "_learning_rate", None)
        if _is_schedule(schedule):
            wrapped = update_step_schedule(schedule, n)
            if wrapped is not schedule:
                inner.learning_rate = wrapped  # Keras's setter takes a schedule as is
        return optimizer

    def load_model(self, path: Any, **kwargs: Any) -> Any:
        """``keras.models.load_model(path, **kwargs)`` inside the scope, its optimizer then made
        to accumulate as this runtime needs (`fit_optimizer`): a full-model checkpoint saved
        under another strategy (2 mirrored replicas, no accumulation) brings back an optimizer
        that `check_optimizer` refuses on the fallback, and one saved on the fallback an
        accumulating optimizer that MirroredStrategy cannot run (keras-team/keras#20582)."""
        import keras

        update_step_schedule_class()  # registered: a checkpoint of the fallback may hold one
        with self.scope():
            model = keras.models.load_model(path, **kwargs)
            if getattr(model, "optimizer", None) is not None:
                with keras.saving.CustomObjectScope(kwargs.get("custom_objects") or {}):
                    self.fit_optimizer(model)
        return model

    def fit_optimizer(self, model: Any) -> bool:
        """Give a compiled (loaded) model's optimizer this runtime's gradient accumulation,
        keeping its state: the optimizer is recompiled from its own configuration with
        ``gradient_accumulation_steps`` = n (None for 1) and its learning-rate schedule counted
        per update (`update_step_schedule`), its variables copied by path (momenta, the EMA,
        ...), and ``iterations`` (micro-steps under accumulation) converted so that the
        optimizer updates done stay the same; the accumulators start at zero (a partial
        accumulation saved mid-update is dropped, with a warning). Call it in the scope,
        before ``fit``. Returns whether it changed anything."""
        import keras

        old = model.optimizer
        inner = _innermost(old)
        if inner is not old:
            raise InvalidOptionError(
                f"{type(old).__name__} wraps the optimizer (mixed float16): its accumulation "
                "cannot be changed after loading; load with compile=False, then compile with "
                "keras.optimizers.<Name>(..., **sel.optimizer_kwargs(learning_rate=...))")
        had = getattr(inner, "gradient_accumulation_steps", None) or 1
        n = self.accumulation_steps
        schedule = getattr(inner, "_learning_rate", None)
        base = schedule.schedule if isinstance(schedule, update_step_schedule_class()) \
            else schedule
        if had == n and not (_is_schedule(schedule) and
                             not _is_update_step_schedule(schedule, n) and n > 1):
            return False
        if type(model).compile is not keras.Model.compile:
            raise InvalidOptionError(
                f"{type(model).__name__} overrides compile(), so its optimizer cannot be "
                "recompiled here: load with compile=False, then compile it with "
                "keras.optimizers.<Name>(..., **sel.optimizer_kwargs(learning_rate=...))")
        state = {v.path: v for v in inner.variables}
        # Keras counts micro-steps in ``_iterations`` (its schedules read it) and shows
        # ``iterations`` = updates (3.15: ``_iterations // gradient_accumulation_steps``)
        micro = getattr(inner, "_iterations", inner.iterations)
        updates, partial = divmod(int(micro.numpy()), had)
        config = inner.get_config()
        config["gradient_accumulation_steps"] = n if n > 1 else None
        if _is_schedule(base):
            config["learning_rate"] = update_step_schedule(base, n)
        compiled = model.get_compile_config()
        compiled["optimizer"] = keras.optimizers.serialize(type(inner).from_config(config))
        model.compile_from_config(compiled)  # builds the new optimizer on the model's variables
        new = model.optimizer
        if not getattr(new, "built", False):
            new.build(model.trainable_variables)
        counter = getattr(new, "_iterations", new.iterations)
        for variable in new.variables:
            if variable is counter:
                variable.assign(updates * n)
            elif variable.path in state:
                variable.assign(state[variable.path])
        if partial:
            log.warning(
                "resilient_strategy: the checkpoint was saved %d micro-step(s) into an update of "
                "%d; that partial accumulation is dropped (the optimizer resumes after update "
                "%d)", partial, had, updates)
        return True

    def check_optimizer(self, model_or_optimizer: Any) -> None:
        """Raise `InvalidOptionError` if a compiled model's (or an) optimizer does not
        accumulate this selection's ``accumulation_steps``: it would train with 1/n of the global
        batch per update. An unwrapped learning-rate schedule is logged as a warning. Does nothing
        without accumulation. `callbacks` runs this when ``fit`` starts."""
        n = self.accumulation_steps
        if n == 1:
            return
        optimizer = model_or_optimizer
        if not hasattr(optimizer, "gradient_accumulation_steps"):  # a model, not an optimizer
            optimizer = getattr(model_or_optimizer, "optimizer", None)
        if optimizer is None:
            raise InvalidOptionError(
                f"{type(model_or_optimizer).__name__} has no optimizer: compile the model "
                "before checking it (or pass the optimizer)"
            )
        inner = _innermost(optimizer)
        current = getattr(inner, "gradient_accumulation_steps", None) or 1
        if current != n:
            batch = f"{self.global_batch_size}" if self.global_batch_size else "wanted"
            raise InvalidOptionError(
                f"this selection trains on one device and accumulates {n} micro-batches of "
                f"{self.batch_size_to_feed} per update (the {batch} global batch), but the "
                f"optimizer ({type(inner).__name__}) has gradient_accumulation_steps="
                f"{getattr(inner, 'gradient_accumulation_steps', None)}, so each update would "
                f"average {current} micro-batch(es), {current}/{n} of the global batch. Create "
                "it inside the scope with "
                "keras.optimizers.<Name>(..., **sel.optimizer_kwargs(learning_rate=...)), or "
                "pass it through sel.wrap_optimizer(opt) before compile. If you accumulate "
                "gradients in your own train_step, leave out this check (callbacks())."
            )
        schedule = getattr(inner, "_learning_rate", None)
        if _is_schedule(schedule) and not _is_update_step_schedule(schedule, n):
            log.warning(
                "the optimizer's learning-rate schedule %s counts micro-steps: with %d-step "
                "gradient accumulation it advances %d times faster than in the multi-replica "
                "run this fallback replaces. Pass the schedule through "
                "sel.optimizer_kwargs(learning_rate=schedule) or wrap the optimizer with "
                "sel.wrap_optimizer(opt) before compile.",
                type(schedule).__name__, n, n,
            )

    def callbacks(self) -> list[Any]:
        """Keras callbacks for ``model.fit(..., callbacks=rt.callbacks())``: on the accumulation
        fallback, or a fallback whose cross-device op XLA would bypass, one that runs
        `check_model` when training begins; otherwise none (so this never imports Keras
        then)."""
        if self.accumulation_steps == 1 and self.backend not in XLA_BYPASSED:
            return []
        return [_check_callback_class()(self)]

    def check_model(self, model: Any) -> None:
        """The fit-time checks: `check_optimizer` (accumulation) and `check_xla`."""
        if self.accumulation_steps > 1:
            self.check_optimizer(model)
        self.check_xla(model)

    def check_xla(self, model: Any) -> bool:
        """Make a HierarchicalCopy / ReductionToOneDevice fallback real under ``jit_compile``.

        A train step compiled with XLA reduces its gradients with XLA's own all-reduce and
        ignores ``cross_device_ops``, so the fallback chosen because NCCL failed would not take
        effect. When the model compiled with ``jit_compile=True``, this turns XLA off for that
        model (the numbers are the same; XLA only changes speed), rebuilds its train function,
        and warns; returns whether it did. Keras's ``jit_compile="auto"`` already resolves to
        False under a ``tf.distribute`` strategy."""
        if self.backend not in XLA_BYPASSED or getattr(model, "jit_compile", False) is not True:
            return False
        model.jit_compile = False
        rebuild = getattr(model, "make_train_function", None)
        if callable(rebuild):
            rebuild(force=True)
        log.warning(
            "resilient_strategy: the model was compiled with jit_compile=True, but under XLA "
            "MirroredStrategy reduces with its own all-reduce and ignores cross_device_ops, so "
            "the %s fallback (chosen because NCCL failed) would not take effect. Turned XLA off "
            "for this model; compile with jit_compile=False to keep it off without this warning.",
            MIRRORED_OPS[self.backend],
        )
        return True

    @property
    def batch_size_to_feed(self) -> int | None:
        """The batch for ``dataset.batch`` / ``model.fit``: one step across all replicas
        (Keras splits it between them); with accumulation, one micro-batch."""
        if self.per_replica_batch_size is not None:
            return self.per_replica_batch_size * self.num_replicas
        if self.global_batch_size is not None:
            return self.global_batch_size // self.accumulation_steps
        return None


_MISSING = object()


def _innermost(optimizer: Any) -> Any:
    """The optimizer that does the work (Keras wraps it in a LossScaleOptimizer for float16)."""
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return optimizer


def _is_schedule(value: Any) -> bool:
    """Whether ``value`` is a Keras ``LearningRateSchedule`` (never imports Keras: an instance
    of one means Keras is imported already)."""
    keras = sys.modules.get("keras")
    if keras is None or value is None:
        return False
    return isinstance(value, keras.optimizers.schedules.LearningRateSchedule)


def _is_update_step_schedule(value: Any, steps: int) -> bool:
    return isinstance(value, update_step_schedule_class()) and value.steps == steps


def update_step_schedule(schedule: Any, steps: int) -> Any:
    """``schedule`` evaluated once per optimizer update of ``steps`` micro-steps: an
    ``UpdateStepSchedule`` (the same object back when ``steps`` is 1 or it is wrapped so)."""
    if steps < 1:
        raise InvalidOptionError(f"steps must be >= 1, got {steps}")
    cls = update_step_schedule_class()
    if isinstance(schedule, cls):
        if schedule.steps == steps:
            return schedule
        schedule = schedule.schedule
    return schedule if steps == 1 else cls(schedule, steps)


@functools.cache
def update_step_schedule_class() -> type[Any]:
    """The Keras class ``UpdateStepSchedule(schedule, steps)``, defined on first call (it
    subclasses ``keras.optimizers.schedules.LearningRateSchedule``, so Keras is imported then).

    It is registered for saving as ``resilient_strategy>UpdateStepSchedule``; to load a saved
    optimizer or model that holds one in a new process, call this function first (or pass
    ``custom_objects={"resilient_strategy>UpdateStepSchedule": update_step_schedule_class()}``).
    """
    import keras
    from keras import ops

    schedules = keras.optimizers.schedules

    @keras.saving.register_keras_serializable(package="resilient_strategy")
    class UpdateStepSchedule(keras.optimizers.schedules.LearningRateSchedule):  # type: ignore[misc]
        """Evaluates ``schedule`` at ``floor(step / steps)``: optimizer updates, not the
        micro-steps Keras counts under ``gradient_accumulation_steps=steps``."""

        def __init__(self, schedule: Any, steps: int) -> None:
            if not callable(schedule) or int(steps) < 1:
                raise InvalidOptionError("UpdateStepSchedule needs a schedule and steps >= 1")
            self.schedule = schedule
            self.steps = int(steps)

        def __call__(self, step: Any) -> Any:
            return self.schedule(ops.floor_divide(step, self.steps))

        def get_config(self) -> dict[str, Any]:
            return {"schedule": schedules.serialize(self.schedule), "steps": self.steps}

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> Any:
            return cls(schedules.deserialize(config["schedule"]), config["steps"])

    return UpdateStepSchedule


@functools.cache
def _check_callback_class() -> type[Any]:
    """The Keras callback that `TfRuntime.callbacks` returns, defined on first use."""
    import keras

    class CheckAccumulation(keras.callbacks.Callback):  # type: ignore[misc]
        """Runs ``TfRuntime.check_model`` on the model before the first training step."""

        def __init__(self, runtime: TfRuntime) -> None:
            super().__init__()
            self.runtime = runtime

        def on_train_begin(self, logs: Any = None) -> None:
            self.runtime.check_model(self.model)

    return CheckAccumulation


def progress_callback(reporter: Any, accumulation_steps: int, backup_dir: str | None = None
                      ) -> Any:
    """A Keras callback reporting each batch to the supervisor (handoff.TrainingReporter): the
    train step of a multi-replica strategy reduces gradients across replicas, so it is
    collective ``k``; with accumulation, every ``accumulation_steps``-th batch is a step."""
    import keras

    class ReportProgress(keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.batches = 0

        def _last(self) -> bool:
            return (self.batches + 1) % accumulation_steps == 0

        def on_train_begin(self, logs: Any = None) -> None:
            # BackupAndRestore (listed before us) has restored the optimizer: count on from it
            done = getattr(getattr(self.model, "optimizer", None), "iterations", None)
            try:  # a MirroredVariable has no int(): its value through numpy()
                steps = 0 if done is None else int(done.numpy() if hasattr(done, "numpy")
                                                   else done)
            except (TypeError, ValueError):
                steps = 0
            if steps:
                reporter.restored(steps)

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            reporter.backward_begin(self._last())

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            last = self._last()
            self.batches += 1
            reporter.backward_end(last)
            reporter.stepped(last)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if backup_dir is not None:  # BackupAndRestore (listed before us) has backed up
                from ..records.handoff import note_checkpoint

                note_checkpoint(reporter.step, backup_dir)

    return ReportProgress()


def measure_callback(meter: StepMeter, accumulation_steps: int,
                     per_replica_batch_size: int | None) -> Any:
    """A Keras callback that feeds ``fit``'s batches to ``meter`` (`stepmeter`): every
    ``accumulation_steps``-th batch ends an optimizer step; each batch is
    ``per_replica_batch_size`` samples of one replica (None: unknown). With
    ``steps_per_execution`` > 1 Keras calls it once per execution, which it then counts as one
    batch. Once the window closed it does nothing (one attribute read a batch)."""
    import keras

    class MeasureStep(keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.batches = 0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if not meter.live:
                return
            self.batches += 1
            meter.micro_step(self.batches % accumulation_steps == 0, per_replica_batch_size)

    return MeasureStep()


def replica_devices(backend: str, devices: tuple[int, ...], logical_cpus: int) -> tuple[str, ...]:
    """TF device names of the replicas: ``/gpu:i``, or ``/cpu:i`` in the logical-CPU test mode."""
    if backend == "cpu" or (backend in MULTI_WORKER_IMPL and not devices):
        return ("/cpu:0",)
    kind = "cpu" if logical_cpus else "gpu"
    if backend in ONE_DEVICE:
        index: tuple[int, ...] = devices[:1] or ((0,) if logical_cpus else ())
    else:
        index = devices or tuple(range(logical_cpus))
    if not index:
        raise InvalidOptionError(f"backend {backend!r} needs GPU devices; none were given")
    if logical_cpus and max(index) >= logical_cpus:
        raise InvalidOptionError(
            f"devices {list(index)} do not exist among {logical_cpus} logical CPU devices"
        )
    return tuple(f"/{kind}:{i}" for i in index)


def configure_logical_cpus(n: int) -> None:
    """Split the host CPU into ``n`` logical devices; fine to repeat with the same ``n``."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
        )
    except RuntimeError as exc:  # "Virtual devices cannot be modified after being initialized"
        have = len(tf.config.list_logical_devices("CPU"))
        if have != n:
            raise LogicalDevicesError(n, have) from exc


def multi_worker_strategy(implementation: str, timeout_s: float | None) -> Any:
    """``MultiWorkerMirroredStrategy`` over the cluster in ``TF_CONFIG`` (TensorFlow reads it),
    all-reducing with ``implementation`` ("NCCL", "RING" or "AUTO"), each collective failing after
    ``timeout_s`` instead of hanging (``CommunicationOptions.timeout_seconds``).

    It is `keras_multi_worker_class`'s subclass, which Keras 3's ``fit`` needs."""
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=getattr(tf.distribute.experimental.CommunicationImplementation,
                               implementation),
        timeout_seconds=timeout_s)
    return keras_multi_worker_class()(communication_options=options)


@functools.cache
def keras_multi_worker_class() -> type[Any]:
    """``tf.distribute.MultiWorkerMirroredStrategy`` whose ``reduce`` works where Keras 3 calls it.

    Keras 3's TensorFlow trainer (3.15, ``keras/src/backend/tensorflow/trainer.py``) calls
    ``strategy.reduce("MEAN", batch, axis=None)`` on the first batch, a *structure* ``(x, y)`` of
    per-replica values (``_maybe_symbolic_build``), and ``strategy.reduce("MEAN", loss, axis=0)``
    on each step's per-replica *scalar* loss (``reduce_per_replica``). With 2 or more workers,
    MultiWorkerMirroredStrategy hands the structure to its cross-device ops whole (ValueError:
    "Attempt to convert a value (PerReplica...) to a Tensor") and reduces the scalar along axis 0
    ("Invalid reduction dimension 0 for input with 0 dimensions"), so ``model.fit`` fails before
    its first step (keras-team/keras#20585, tensorflow/tensorflow#72388; both reproduced with
    TF 2.21 + Keras 3.15, two CPU workers). This subclass reduces a structure element by
    element, as ``Strategy.reduce`` documents for nested values, and a per-replica scalar with
    ``axis=None`` (a MEAN of scalars over replicas, which is what Keras means on one worker).
    Keras itself is not changed. Measured: ``fit`` of a 2-worker job then gives the weights of
    one process training the same global batch (to float32 rounding).
    """
    import tensorflow as tf

    base = tf.distribute.MultiWorkerMirroredStrategy

    class KerasMultiWorkerMirroredStrategy(base):  # type: ignore[misc, valid-type]
        def reduce(self, reduce_op: Any, value: Any, axis: Any = None) -> Any:
            def one(v: Any) -> Any:
                ax = axis
                if ax is not None:
                    parts = self.experimental_local_results(v)
                    if parts and all(getattr(getattr(p, "shape", None), "rank", None) == 0
                                     for p in parts):
                        ax = None
                return base.reduce(self, reduce_op, v, ax)

            return tf.nest.map_structure(one, value)

    return KerasMultiWorkerMirroredStrategy
