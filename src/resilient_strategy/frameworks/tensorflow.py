"""TensorFlow runtime: the one ``tf.distribute`` strategy a Selection trains with.

    rt = TfRuntime("hierarchical_copy", (0, 1), 1, 256, 128)
    with rt.scope():                      # model build, optimizer, compile, load_weights
        model = build_model()
        opt = keras.optimizers.SGD(0.1, **rt.optimizer_kwargs())
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(dataset.batch(rt.batch_size_to_feed), epochs=3)

TensorFlow is imported inside methods only: importing this module starts no TF runtime, so
``CUDA_VISIBLE_DEVICES`` set by the selection still takes effect. The strategy is built once, on
first use, and the same object is returned ever after: a second ``MirroredStrategy`` in one
process caused NCCL errors in the field (seed report 000).

Gradient accumulation (the one-device fallback) uses Keras 3's optimizer argument
``gradient_accumulation_steps``: the optimizer adds each micro-batch gradient to an accumulator
and applies their mean every n-th step. Keras's learning-rate schedules see micro-steps
(``optimizer._iterations``), not optimizer updates (Keras ``BaseOptimizer`` docstring). It works
under ``OneDeviceStrategy`` only: under ``MirroredStrategy`` its ``ops.cond`` around the update
raises "merge_call called while defining a new graph" (keras-team/keras#20582, open; reproduced
with Keras 3.15), so a mirrored runtime with accumulation is refused at construction.
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import InvalidOptionError, ResilientStrategyError

#: Backend -> the ``tf.distribute`` cross-device ops class MirroredStrategy reduces with.
MIRRORED_OPS = {
    "nccl": "NcclAllReduce",
    "hierarchical_copy": "HierarchicalCopyAllReduce",
    "reduction_to_one_device": "ReductionToOneDevice",
}
ONE_DEVICE = ("single_device", "cpu")


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


class TfRuntime:
    """The strategy, scope, optimizer arguments and feed batch size for one Selection."""

    def __init__(
        self,
        backend: str,
        devices: tuple[int, ...],
        accumulation_steps: int,
        global_batch_size: int | None,
        per_replica_batch_size: int | None,
        logical_cpus: int = 0,
    ) -> None:
        if backend not in MIRRORED_OPS and backend not in ONE_DEVICE:
            raise InvalidOptionError(f"TensorFlow has no backend {backend!r}")
        if accumulation_steps < 1 or logical_cpus < 0:
            raise InvalidOptionError("accumulation_steps must be >= 1 and logical_cpus >= 0")
        if backend in MIRRORED_OPS and accumulation_steps > 1:
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
        self.replica_devices = replica_devices(backend, tuple(devices), logical_cpus)
        self._lock = threading.Lock()
        self._strategy: list[Any] = []  # filled once by .strategy

    @property
    def num_replicas(self) -> int:
        return len(self.replica_devices)

    @property
    def strategy(self) -> Any:
        """The one ``tf.distribute`` strategy, built on first access (thread-safe)."""
        with self._lock:
            if not self._strategy:
                self._strategy.append(self._build())
            return self._strategy[0]

    def _build(self) -> Any:
        import tensorflow as tf

        if self.logical_cpus:
            configure_logical_cpus(self.logical_cpus)
        if self.backend in ONE_DEVICE:
            return tf.distribute.OneDeviceStrategy(self.replica_devices[0])
        ops = getattr(tf.distribute, MIRRORED_OPS[self.backend])()
        return tf.distribute.MirroredStrategy(list(self.replica_devices), cross_device_ops=ops)

    def scope(self) -> Any:
        """``strategy.scope()``: build the model and optimizer, compile and load weights in it."""
        return self.strategy.scope()

    def optimizer_kwargs(self) -> dict[str, int]:
        """Arguments for a Keras 3 optimizer's constructor (accumulation on the fallback)."""
        n = self.accumulation_steps
        return {"gradient_accumulation_steps": n} if n > 1 else {}

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """Set gradient accumulation on an existing Keras 3 optimizer; returns it.

        Works until the optimizer is built (its accumulators are created in ``build()``, at the
        first ``fit`` step); after that, pass :meth:`optimizer_kwargs` to its constructor.
        """
        n = self.accumulation_steps
        if n == 1:
            return optimizer
        current = getattr(optimizer, "gradient_accumulation_steps", _MISSING)
        if current is _MISSING:
            raise InvalidOptionError(
                f"{type(optimizer).__name__} is not a Keras 3 optimizer (no "
                "gradient_accumulation_steps); build a keras.optimizers one with "
                "**optimizer_kwargs(), or accumulate gradients in your own train step"
            )
        if current == n:
            return optimizer
        if current:
            raise InvalidOptionError(
                f"the optimizer already accumulates {current} steps; this selection needs {n} "
                "to keep the global batch"
            )
        if getattr(optimizer, "built", False):
            raise InvalidOptionError(
                "the optimizer is already built, so gradient accumulation can no longer be "
                "added; create it with **optimizer_kwargs() (or wrap it before compile/fit)"
            )
        optimizer.gradient_accumulation_steps = n
        return optimizer

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


def replica_devices(backend: str, devices: tuple[int, ...], logical_cpus: int) -> tuple[str, ...]:
    """TF device names of the replicas: ``/gpu:i``, or ``/cpu:i`` in the logical-CPU test mode."""
    if backend == "cpu":
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
