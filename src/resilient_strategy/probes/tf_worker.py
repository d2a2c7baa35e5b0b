"""Probe worker for TensorFlow: one process that proves a strategy over its devices works.

    python -m resilient_strategy.probes.tf_worker --backend B [--devices 0,1] [--logical-cpus N] \\
        --message-bytes N --report PATH [--no-train-step] [--parent-pid PID]

Backends: ``nccl``, ``hierarchical_copy``, ``reduction_to_one_device`` (a MirroredStrategy with
that cross-device op), ``single_device`` (OneDeviceStrategy on the first device) and ``cpu``.
Building a strategy or calling ``strategy.reduce`` proves nothing: NcclAllReduce constructs
fine on CPU devices and fails only when a step runs. So this runs a replica-context all-reduce
checked exactly, times one of ``--message-bytes``, and trains a tiny Keras model with
``model.fit``, after which every replica's copy of every variable must be identical.

``--logical-cpus N`` splits the CPU into N logical devices (a test mode for machines without
GPUs); it must happen before anything starts the TF runtime, so it is the first TF call.
``RESILIENT_STRATEGY_PROBE_FAULT``: ``hang:0`` / ``exit:0`` act on this process, ``wrong:<r>``
corrupts replica r's contribution (see ``torch_worker``).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Sequence
from typing import Any

from ._common import ProbeFailure, act_on_fault, add_common_arguments, fault_for, run_worker
from ._watchdog import watch_parent

CHECK_NUMEL = 1024
WARMUP, ITERS = 2, 10
PER_REPLICA_BATCH = 8
MIRRORED = ("nccl", "hierarchical_copy", "reduction_to_one_device")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m resilient_strategy.probes.tf_worker")
    p.add_argument("--backend", required=True, choices=[*MIRRORED, "single_device", "cpu"])
    p.add_argument("--devices", default="", help="GPU ordinals (logical CPU ones in test mode)")
    p.add_argument("--logical-cpus", type=int, default=0)
    add_common_arguments(p)
    return p.parse_args(argv)


def probe(args: argparse.Namespace, report: dict[str, Any]) -> None:
    os.environ["KERAS_BACKEND"] = "tensorflow"  # a MirroredStrategy trains only TF-backed models
    act_on_fault(fault_for(0, os.environ, args.backend), 0)
    import tensorflow as tf

    names = _configure_devices(tf, args)
    strategy = _strategy(tf, args.backend, names)
    replicas = int(strategy.num_replicas_in_sync)
    faults = [fault_for(r, os.environ, args.backend) for r in range(replicas)]
    wrong = faults.index("wrong") if "wrong" in faults else -1
    used = ", ".join(names[:replicas])
    parts = [f"{args.backend} over {replicas} replica(s) on {used}; TF {tf.__version__}"]
    _check_all_reduce(tf, strategy, replicas, wrong)
    parts.append("all-reduce exact")
    if replicas > 1:
        gbps = _bus_bandwidth(tf, strategy, replicas, args.message_bytes)
        report.update(bus_bandwidth_gbps=round(gbps, 3), message_bytes=args.message_bytes)
        parts.append(f"{gbps:.2f} GB/s bus at {args.message_bytes / 2**20:g} MiB")
    if args.train_step:
        seconds = _fit(tf, strategy, replicas)
        report["step_seconds"] = round(seconds, 6)
        parts.append(f"fit step {seconds * 1e3:.1f} ms")
    report["detail"] = "; ".join(parts)


def _configure_devices(tf: Any, args: argparse.Namespace) -> list[str]:
    if args.logical_cpus:
        tf.config.set_visible_devices([], "GPU")
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(args.logical_cpus)]
        )
        wanted = [int(d) for d in args.devices.split(",") if d.strip()]
        if args.backend == "cpu":
            return ["/cpu:0"]
        return [f"/cpu:{i}" for i in (wanted or range(args.logical_cpus))]
    wanted = [int(d) for d in args.devices.split(",") if d.strip()]
    if not wanted or args.backend == "cpu":
        tf.config.set_visible_devices([], "GPU")
        return ["/cpu:0"]
    gpus = tf.config.list_physical_devices("GPU")
    missing = [d for d in wanted if d >= len(gpus)]
    if missing:
        raise ProbeFailure(
            "no_device", f"TensorFlow {tf.__version__} sees {len(gpus)} GPU(s), not GPU(s) "
            f"{missing} (built with CUDA: {tf.test.is_built_with_cuda()})")
    chosen = [gpus[d] for d in wanted]
    tf.config.set_visible_devices(chosen, "GPU")
    for gpu in chosen:
        tf.config.experimental.set_memory_growth(gpu, True)
    return [f"/gpu:{i}" for i in range(len(chosen))]  # visible GPUs renumber from 0


def _strategy(tf: Any, backend: str, names: list[str]) -> Any:
    if backend in ("cpu", "single_device"):
        return tf.distribute.OneDeviceStrategy(names[0])
    ops = {
        "nccl": tf.distribute.NcclAllReduce,
        "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce,
        "reduction_to_one_device": tf.distribute.ReductionToOneDevice,
    }[backend]()
    return tf.distribute.MirroredStrategy(devices=names, cross_device_ops=ops)


def _check_all_reduce(tf: Any, strategy: Any, replicas: int, wrong: int) -> None:
    def run() -> Any:
        def fn() -> Any:
            ctx = tf.distribute.get_replica_context()
            rid = ctx.replica_id_in_sync_group
            x = tf.range(CHECK_NUMEL, dtype=tf.float32) + 1000.0 * tf.cast(rid + 1, tf.float32)
            if wrong >= 0:
                x += tf.cast(tf.equal(rid, wrong), tf.float32) * tf.one_hot(
                    CHECK_NUMEL // 2, CHECK_NUMEL)
            return ctx.all_reduce(tf.distribute.ReduceOp.SUM, x)

        return strategy.run(fn)

    import numpy as np

    expected = (np.arange(CHECK_NUMEL, dtype=np.float32) * replicas
                + 1000.0 * replicas * (replicas + 1) / 2).astype(np.float32)
    for r, value in enumerate(strategy.experimental_local_results(tf.function(run)())):
        got = np.asarray(value)
        bad = np.flatnonzero(got != expected)
        if bad.size:
            i = int(bad[0])
            raise ProbeFailure(
                "wrong_result",
                f"replica {r}: all-reduce of {CHECK_NUMEL} float32 over {replicas} replicas: "
                f"{bad.size} values wrong, first at index {i}: {float(got[i])!r} instead of "
                f"{float(expected[i])!r}",
            )


def _bus_bandwidth(tf: Any, strategy: Any, replicas: int, message_bytes: int) -> float:
    numel = max(1, message_bytes // 4)
    values = strategy.experimental_distribute_values_from_function(
        lambda _ctx: tf.zeros([numel], tf.float32))

    def run(v: Any) -> Any:
        def fn(x: Any) -> Any:
            ctx = tf.distribute.get_replica_context()
            return ctx.all_reduce(tf.distribute.ReduceOp.SUM, x)[:1]  # small fetch to wait on

        return strategy.run(fn, args=(v,))

    compiled = tf.function(run)

    def once() -> None:
        for part in strategy.experimental_local_results(compiled(values)):
            part.numpy()

    for _ in range(WARMUP):
        once()
    t0 = time.perf_counter()
    for _ in range(ITERS):
        once()
    per_op = (time.perf_counter() - t0) / ITERS
    return numel * 4 / per_op * 2 * (replicas - 1) / replicas / 1e9


def _fit(tf: Any, strategy: Any, replicas: int) -> float:
    """Two ``fit`` batches of a tiny model; the time of the second; replicas must agree after."""
    import numpy as np

    keras = tf.keras
    with strategy.scope():
        model = keras.Sequential([
            keras.Input(shape=(16,)),
            keras.layers.Dense(32, activation="gelu"),
            keras.layers.Dense(4),
        ])
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05), loss="mse")
    batch = PER_REPLICA_BATCH * replicas
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2 * batch, 16)).astype(np.float32)
    y = rng.standard_normal((2 * batch, 4)).astype(np.float32)
    times: dict[int, float] = {}

    def begin(batch: int, logs: Any = None) -> None:
        times[batch] = time.perf_counter()

    def end(batch: int, logs: Any = None) -> None:
        float((logs or {}).get("loss", 0.0))  # a tensor here would wait for the step
        times[batch] = time.perf_counter() - times[batch]

    timer = keras.callbacks.LambdaCallback(on_train_batch_begin=begin, on_train_batch_end=end)
    history = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                        callbacks=[timer])
    loss = float(history.history["loss"][-1])
    if not math.isfinite(loss):
        raise ProbeFailure("wrong_result", f"model.fit gave a non-finite loss {loss}")
    for var in model.trainable_variables:
        copies = _replica_copies(var)
        first = np.asarray(copies[0])
        if any(not np.array_equal(first, np.asarray(c)) for c in copies[1:]):
            raise ProbeFailure("wrong_result",
                               f"after model.fit the replicas' copies of {var.name} differ")
    return times.get(1, times.get(0, 0.0))


def _replica_copies(var: Any) -> Sequence[Any]:
    """Each replica's copy of a variable (Keras 3 wraps the distributed one in ``.value``)."""
    values = getattr(var, "values", None)
    if values is None:
        values = getattr(getattr(var, "value", None), "values", None)
    return tuple(values) if values is not None else (var,)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    watch_parent(args.parent_pid)
    run_worker(args.report, lambda report: probe(args, report))


if __name__ == "__main__":
    main()
