"""Probe worker for TensorFlow: one process that proves a strategy over its devices works.

Slightly over ~450 lines: one script per framework, run as ``python -m``; its strategy
building, checked collectives, multi-worker verdict and training step share one process.

    python -m resilient_strategy.probing.workers.tf_worker --backend B [--devices 0,1] [--logical-cpus N] \\
        --message-bytes N --report PATH [--no-train-step] [--parent-pid PID]

Backends: ``nccl``, ``hierarchical_copy``, ``reduction_to_one_device`` (a MirroredStrategy with
that cross-device op), ``single_device`` (OneDeviceStrategy on the first device) and ``cpu``.
Building a strategy or calling ``strategy.reduce`` proves nothing: NcclAllReduce constructs
fine on CPU devices and fails only when a step runs. So this runs a replica-context all-reduce
checked exactly, times one of ``--message-bytes``, and trains a tiny Keras model, after which
every replica's copy of every variable must be identical: across TF_CONFIG workers with
``model.fit`` (Keras calls the strategy's ``reduce`` on the first batch there, which is where
Keras 3 and MultiWorkerMirroredStrategy part ways), on one worker with ``model.train_on_batch``:
the same traced train function (``strategy.run`` of the train step, the per-replica loss
reduced, the gradients all-reduced by the optimizer) without building the distributed input
pipeline three times, which cost 0.7 s of a 1.4 s ``fit`` on 2 logical CPUs.

``--logical-cpus N`` splits the CPU into N logical devices (a test mode for machines without
GPUs); it must happen before anything starts the TF runtime, so it is the first TF call.
``RESILIENT_STRATEGY_PROBE_FAULT``: ``hang:0`` (before the first all-reduce), ``hang_setup:0``
(in strategy creation), ``hang_collective:0`` (inside the first all-reduce) act on this process;
``wrong:<r>`` / ``nan:<r>`` / ``zero:<r>`` corrupt replica r's contribution or result (see
``torch_worker``). Progress goes to ``--progress`` (`resilient_strategy.records.progress`); each
all-reduce is checked exactly at the sizes ``torch_worker`` checks.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
import zlib
from collections.abc import Sequence
from typing import Any

from ...records.progress import (
    COMM_READY,
    COMM_SETUP,
    DEVICE_READY,
    FINISHED,
    IMPORTED,
    ProgressWriter,
)
from ...vocab import MIRRORED_BACKENDS, ONE_REPLICA_BACKENDS
from .common import (
    CHECK_ITERS,
    PATTERN_MOD,
    ProbeFailure,
    act_on_fault,
    add_common_arguments,
    check_sizes,
    expected_sum,
    fault_for,
    human,
    mismatch_failure,
    record_bandwidth,
    run_worker,
    spread,
)
from .watchdog import watch_parent

WARMUP, ITERS = 2, 10
TRACE_ALLOW_S = 10.0  # the first call at a size traces and compiles a tf.function
FIT_ALLOW_S = 20.0  # model.fit builds, traces and compiles its train function
PER_REPLICA_BATCH = 8
MIRRORED = MIRRORED_BACKENDS
#: Across the TF_CONFIG workers: MultiWorkerMirroredStrategy with this CommunicationImplementation
MULTI_WORKER = {"mw_nccl": "NCCL", "mw_ring": "RING", "mw_auto": "AUTO"}
#: A worker with less than this left of its probe's time votes "fail" in the verdict, so that
#: the verdict completes well inside every worker's deadline (see resilient_strategy.nodes.tfworkers)
VERDICT_MARGIN_S = 3.0
#: After the verdict, one more all-reduce whose outcome is ignored ("goodbye"), waited on for at
#: most this long (and never past the probe's time less a second). TensorFlow's collectives pull
#: each buffer from its sender (RecvBuf over gRPC), so a worker that exits as soon as its own
#: verdict all-reduce returns can close the socket a slower peer is still pulling from; that
#: peer's verdict then fails with "Socket closed" (seen in CI under load; the same error in
#: https://github.com/yahoo/TensorFlowOnSpark/issues/607). A worker leaves the goodbye only once
#: every peer has entered it, i.e. has its verdict, or once a peer has gone.
GOODBYE_MAX_S = 10.0
#: The first all-reduce across workers carries the candidate key's CRC in two 16-bit halves
#: (exact in float32 for up to 2**8 workers).
KEY_HALF = 1 << 16


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m resilient_strategy.probing.workers.tf_worker")
    p.add_argument("--backend", required=True,
                   choices=[*MIRRORED, *MULTI_WORKER, *ONE_REPLICA_BACKENDS])
    p.add_argument("--devices", default="", help="GPU ordinals (logical CPU ones in test mode)")
    p.add_argument("--logical-cpus", type=int, default=0)
    p.add_argument("--workers", type=int, default=1,
                   help="TF_CONFIG workers running this probe together (mw_* backends)")
    p.add_argument("--worker-rank", type=int, default=0, help="this worker's id (chief 0)")
    p.add_argument("--round-key", default="", help="the candidate's key: the same on every worker")
    p.add_argument("--budget", type=float, default=0.0,
                   help="seconds the runner gives this probe (the verdict keeps a margin)")
    p.add_argument("--collective-timeout", type=float, default=None,
                   help="CommunicationOptions.timeout_seconds of MultiWorkerMirroredStrategy")
    add_common_arguments(p)
    return p.parse_args(argv)


def probe(args: argparse.Namespace, report: dict[str, Any]) -> None:
    started = time.monotonic()
    os.environ["KERAS_BACKEND"] = "tensorflow"  # a MirroredStrategy trains only TF-backed models
    progress = ProgressWriter(args.progress)
    across = args.backend in MULTI_WORKER
    me = args.worker_rank if across else 0  # the rank a fault names: the worker's id
    fault0 = fault_for(me, os.environ, args.backend)
    import tensorflow as tf

    progress.phase(IMPORTED)
    names = _configure_worker_devices(tf, args) if across else _configure_devices(tf, args)
    progress.phase(DEVICE_READY)
    progress.phase(COMM_SETUP)
    act_on_fault(fault0, me, "hang_setup")
    strategy = _strategy(tf, args.backend, names, args.collective_timeout)
    progress.phase(COMM_READY)
    act_on_fault(fault0, me)
    replicas = int(strategy.num_replicas_in_sync)
    local = len(names) if across else replicas
    if across and replicas != args.workers * local:
        raise ProbeFailure("no_device", f"MultiWorkerMirroredStrategy has {replicas} replicas, "
                           f"not {args.workers} workers x {local} device(s): TF_CONFIG names "
                           "another cluster than the one planned for, or the workers differ")
    # a fault names a worker across workers (each of its replicas), else a replica
    faults = [fault_for(r // local if across else r, os.environ, args.backend)
              for r in range(replicas)]
    used = ", ".join(names[:local])
    where = (f"across {args.workers} workers x {local} replica(s) on {used}" if across
             else f"over {replicas} replica(s) on {used}")
    parts = [f"{args.backend} {where}; TF {tf.__version__}"]
    checker = _Checker(tf, strategy, replicas, faults, progress, first=me * local if across else 0,
                       own_fault=fault0, across=across)

    def left_s() -> float:
        return args.budget - (time.monotonic() - started) if args.budget else float("inf")

    marks: dict[str, float] = {}
    try:
        if across:
            checker.same_round(args.round_key, args.workers, local)
            parts.append(f"all {args.workers} workers on the same round")
        sizes = check_sizes(args.check_bytes)
        for nbytes in sizes:
            checker.checked(nbytes, CHECK_ITERS)
        marks["checked"] = time.monotonic()
        parts.append(f"all-reduce exact at {len(sizes)} sizes "
                     f"({human(min(sizes))}..{human(max(sizes))}) x{CHECK_ITERS}")
        if replicas > 1:
            per_op, noise = checker.timed(args.message_bytes, ITERS, warmup=WARMUP)
            nbytes = max(1, args.message_bytes // 4) * 4
            parts.append(record_bandwidth(report, args.message_bytes, nbytes, per_op, noise,
                                          replicas))
            marks["measured"] = time.monotonic()
        weights = 0.0
        if args.train_step:
            checker.k += 1
            with progress.collective(checker.k, 0, allow_s=FIT_ALLOW_S):  # builds and traces
                seconds, weights = _fit(tf, strategy, replicas, whole_fit=across)
            marks["stepped"] = time.monotonic()
            report["step_seconds"] = round(seconds, 6)
            parts.append(f"{'fit' if across else 'train_on_batch'} step {seconds * 1e3:.1f} ms")
        if across:
            left = left_s()
            agreed = checker.verdict(args.workers, local, me, report, left >= VERDICT_MARGIN_S,
                                     weights, linger_s=_linger(left))
            parts.append(agreed)
    except ProbeFailure:
        # every worker saw the same failed check after a completed all-reduce (the same sums):
        # each parts as after a verdict, so that none exits while a peer still pulls from it
        if across and checker.k and not checker.parted:
            checker.goodbye(local, _linger(left_s()))
        raise
    progress.phase(FINISHED)
    report["phase_at"] = {**progress.marks, **marks}
    report["detail"] = "; ".join(parts)


def _linger(left_s: float) -> float:
    """How long the goodbye may wait with ``left_s`` of the probe's time left."""
    return min(GOODBYE_MAX_S, max(0.5, left_s - 1.0))


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
    return _use_gpus(tf, wanted)


def _use_gpus(tf: Any, wanted: list[int]) -> list[str]:
    """Make exactly the GPUs ``wanted`` visible to TensorFlow (memory growing as used) and
    return their device names, which renumber from 0; a GPU it cannot see is ``no_device``."""
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


def _configure_worker_devices(tf: Any, args: argparse.Namespace) -> list[str]:
    """This worker's devices for MultiWorkerMirroredStrategy (it takes every visible GPU, else
    the CPU): the planned GPUs only; none for a CPU worker."""
    wanted = [int(d) for d in args.devices.split(",") if d.strip()]
    if not os.environ.get("TF_CONFIG"):
        raise ProbeFailure("worker_error", "TF_CONFIG is not set: a probe across workers needs "
                           "the cluster's addresses")
    if not wanted:
        if args.backend == "mw_nccl":
            raise ProbeFailure("no_device", "NCCL across workers needs GPUs; none were planned")
        tf.config.set_visible_devices([], "GPU")
        return ["/cpu:0"]
    return _use_gpus(tf, wanted)


def _strategy(tf: Any, backend: str, names: list[str], timeout_s: float | None = None) -> Any:
    if backend in MULTI_WORKER:
        from ...frameworks.tensorflow import multi_worker_strategy

        # the training's own class: Keras 3's fit needs its reduce (see its docstring)
        return multi_worker_strategy(MULTI_WORKER[backend], timeout_s)
    if backend in ("cpu", "single_device"):
        return tf.distribute.OneDeviceStrategy(names[0])
    ops = {
        "nccl": tf.distribute.NcclAllReduce,
        "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce,
        "reduction_to_one_device": tf.distribute.ReductionToOneDevice,
    }[backend]()
    return tf.distribute.MirroredStrategy(devices=names, cross_device_ops=ops)


class _Checker:
    """Replica-context all-reduces checked exactly (see ``torch_worker``), numbered and reported
    to the runner as they run."""

    def __init__(self, tf: Any, strategy: Any, replicas: int, faults: Sequence[str],
                 progress: ProgressWriter, first: int = 0, own_fault: str = "",
                 across: bool = False) -> None:
        self.tf, self.strategy, self.replicas = tf, strategy, replicas
        self.faults, self.progress = list(faults), progress
        self.first = first  # the global replica id of this process's first replica
        self.own_fault = own_fault
        self.across = across  # one process of a probe across TF_CONFIG workers
        self.k = 0
        self.parted = False  # the goodbye ran (see GOODBYE_MAX_S)

        wrong = self.faults.index("wrong") if "wrong" in self.faults else -1
        nan = self.faults.index("nan") if "nan" in self.faults else -1

        def step(numel: Any, it: Any) -> Any:
            def fn() -> Any:  # built on each replica's own device, as gradients are
                ctx = tf.distribute.get_replica_context()
                rid = ctx.replica_id_in_sync_group
                pattern = tf.cast(tf.range(numel) % PATTERN_MOD + 1, tf.float32)
                mine = pattern * tf.cast(rid + 1 + it * replicas, tf.float32)
                if wrong >= 0:
                    mine += tf.cast(tf.equal(rid, wrong), tf.float32) * tf.one_hot(
                        numel // 2, numel)
                if nan >= 0:
                    mine = tf.cond(tf.equal(rid, nan), lambda: tf.tensor_scatter_nd_update(
                        mine, [[numel // 3]], [float("nan")]), lambda: mine)
                return ctx.all_reduce(tf.distribute.ReduceOp.SUM, mine)

            return strategy.run(fn)

        self._compiled = tf.function(step, autograph=False)
        self._traced = False

    def checked(self, nbytes: int, iters: int, warmup: int = 0) -> tuple[float, float]:
        import numpy as np

        tf, strategy, replicas = self.tf, self.strategy, self.replicas
        numel = max(1, nbytes // 4)
        pattern = (np.arange(numel, dtype=np.int64) % PATTERN_MOD + 1).astype(np.float32)
        times: list[float] = []
        for it in range(warmup + iters):
            self.k += 1
            first, self._traced = not self._traced, True
            t0 = time.perf_counter()
            self.progress.enter(self.k, numel * 4, allow_s=TRACE_ALLOW_S if first else 0.0)
            if self.k == 1:
                act_on_fault(self.own_fault, self.first, "hang_collective")
            out = self._compiled(tf.constant(numel, tf.int32), tf.constant(it, tf.int32))
            results = [np.asarray(v) for v in strategy.experimental_local_results(out)]
            self.progress.leave(self.k, numel * 4)
            if it >= warmup:
                times.append(time.perf_counter() - t0)
            expected = pattern * np.float32(expected_sum(replicas, it))
            for i, got in enumerate(results):
                r = self.first + i
                if self.faults[r:r + 1] == ["zero"]:
                    got = got.copy()
                    got[numel // 4: numel // 2] = 0.0
                if not np.array_equal(got, expected):
                    _mismatch(got, expected, numel, replicas, it, r)
        return sum(times) / max(1, len(times)), spread(times)

    def _sum_over_workers(self, values: Sequence[float], local: int,
                          timeout_s: float | None = None) -> Any:
        """``values`` summed over the workers (each worker's first replica contributes them,
        its other replicas zeros): one all-reduce, numbered and reported like the others
        (``timeout_s``: TensorFlow's own deadline for it, else the strategy's)."""
        import numpy as np

        tf, strategy = self.tf, self.strategy
        vec = tf.constant(np.asarray(values, dtype=np.float32))
        options = (None if timeout_s is None else
                   tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_s))

        def run(v: Any) -> Any:
            def fn() -> Any:
                ctx = tf.distribute.get_replica_context()
                lead = tf.equal(ctx.replica_id_in_sync_group % local, 0)
                return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(lead, tf.float32) * v,
                                      options=options)

            return strategy.run(fn)

        self.k += 1
        allow = TRACE_ALLOW_S + (timeout_s or 0.0)
        with self.progress.collective(self.k, len(values) * 4, allow_s=allow):
            if self.k == 1:  # the first collective across workers: a fault may hang in it
                act_on_fault(self.own_fault, self.first, "hang_collective")
            out = strategy.experimental_local_results(tf.function(run, autograph=False)(vec))
            return np.asarray(out[0])

    def goodbye(self, local: int, timeout_s: float) -> None:
        """One last all-reduce whose outcome does not matter (see ``GOODBYE_MAX_S``): it fails
        only where a peer has already gone, or at its timeout."""
        self.parted = True
        with contextlib.suppress(Exception):  # every peer has its verdict, or has gone
            self._sum_over_workers([1.0], local, timeout_s)

    def same_round(self, key: str, workers: int, local: int) -> None:
        """The first all-reduce across workers: each worker's [1, CRC halves of the candidate's
        key]; every worker must have sent the same, else they probe different candidates (out
        of step) and the round fails here, whatever follows."""
        crc = zlib.crc32(key.encode("utf-8"))
        mine = [1.0, float(crc // KEY_HALF), float(crc % KEY_HALF)]
        got = self._sum_over_workers(mine, local)
        want = [workers * x for x in mine]
        if [float(x) for x in got] != want:
            raise ProbeFailure(
                "inter_worker", f"the workers are not probing the same candidate ({key}): the "
                f"all-reduce of [workers, key CRC] gave {got.tolist()} instead of {want}; they "
                "plan differently (other facts or options) or are a round out of step")

    def verdict(self, workers: int, local: int, me: int, report: dict[str, Any], vote: bool,
                weights: float, linger_s: float = GOODBYE_MAX_S) -> str:
        """The last checked all-reduce: every worker's pass vote and figures, so that every
        worker reports the same verdict and the same numbers (its planner then chooses the
        same); then the goodbye, so that no worker leaves while a peer still pulls from it."""
        bw, step = report.get("bus_bandwidth_gbps") or 0.0, report.get("step_seconds") or 0.0
        noise = report.get("bandwidth_spread") or 0.0
        slots = [0.0] * (4 * workers)
        for j, value in enumerate((bw, step, noise, weights)):
            slots[j * workers + me] = float(value)
        got = self._sum_over_workers([1.0, 0.0 if vote else 1.0, *slots], local)
        self.goodbye(local, linger_s)
        if float(got[0]) != workers:
            raise ProbeFailure("inter_worker", f"the verdict all-reduce counted {float(got[0])} "
                               f"workers, not {workers}: the workers are out of step")
        if float(got[1]) != 0.0:
            raise ProbeFailure("inter_worker", f"{int(got[1])} of {workers} worker(s) voted "
                               "fail (a probe step failed there, or its time ran short)")
        per = got[2:].reshape(4, workers)
        if len({float(x) for x in per[3]}) != 1:
            raise ProbeFailure("wrong_result", "after model.fit the workers' weights differ "
                               f"(sums {per[3].tolist()})")
        if bw:
            report["bus_bandwidth_gbps"] = round(float(per[0].min()), 3)
            report["bandwidth_spread"] = round(float(per[2].max()), 3)
        if step:
            report["step_seconds"] = round(float(per[1].max()), 6)
        return f"verdict agreed by {workers} workers"

    def timed(self, nbytes: int, iters: int, warmup: int = 0) -> tuple[float, float]:
        """All-reduces of zeros timed alone (a one-element fetch to wait on): the bandwidth figure
        and its spread. Checking values needs the whole result on the host, which would be timed
        too; the checked sizes (4 KiB..25 MiB) already span this one."""
        tf, strategy = self.tf, self.strategy
        numel = max(1, nbytes // 4)
        values = strategy.experimental_distribute_values_from_function(
            lambda _ctx: tf.zeros([numel], tf.float32))
        across = self.across

        def run(v: Any) -> Any:
            def fn(x: Any) -> Any:
                ctx = tf.distribute.get_replica_context()
                if across:  # an input has no device there: "destinations can not be empty"
                    x = tf.identity(x)
                return ctx.all_reduce(tf.distribute.ReduceOp.SUM, x)[:1]

            return strategy.run(fn, args=(v,))

        compiled = tf.function(run, autograph=False)
        times: list[float] = []
        for it in range(warmup + iters):
            self.k += 1
            t0 = time.perf_counter()
            with self.progress.collective(self.k, numel * 4,
                                          allow_s=TRACE_ALLOW_S if it == 0 else 0.0):
                for part in strategy.experimental_local_results(compiled(values)):
                    part.numpy()
            if it >= warmup:
                times.append(time.perf_counter() - t0)
        return sum(times) / max(1, len(times)), spread(times)


def _mismatch(got: Any, expected: Any, numel: int, replicas: int, it: int, r: int) -> None:
    import numpy as np

    bad = np.flatnonzero(got != expected)
    i = int(bad[0])
    where = (f"replica {r}: all-reduce of {numel} float32 ({human(numel * 4)}) over {replicas} "
             f"replicas, iteration {it + 1}: {bad.size} values wrong, first at index {i}: "
             f"{float(got[i])!r} instead of {float(expected[i])!r}")
    nans = int(np.isnan(got).sum())
    zeros = int(((got == 0) & (expected != 0)).sum())
    raise mismatch_failure(where, nans, zeros)


def _fit(tf: Any, strategy: Any, replicas: int, *, whole_fit: bool) -> tuple[float, float]:
    """Two training steps of a tiny model: the time of the second, and the sum of the trained
    weights (compared across workers by the verdict); replicas must agree after.

    ``whole_fit``: through ``model.fit`` (its distributed input pipeline and the strategy
    ``reduce`` of the first batch); otherwise ``model.train_on_batch``, each replica stepping on
    the same batch of `PER_REPLICA_BATCH` rows through the same train function."""
    import numpy as np

    keras = tf.keras
    with strategy.scope():
        model = keras.Sequential([
            keras.Input(shape=(16,)),
            keras.layers.Dense(32, activation="gelu"),
            keras.layers.Dense(4),
        ])
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05), loss="mse")
    batch = PER_REPLICA_BATCH * (replicas if whole_fit else 1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2 * batch, 16)).astype(np.float32)
    y = rng.standard_normal((2 * batch, 4)).astype(np.float32)
    times: dict[int, float] = {}
    if whole_fit:
        def begin(batch: int, logs: Any = None) -> None:
            times[batch] = time.perf_counter()

        def end(batch: int, logs: Any = None) -> None:
            float((logs or {}).get("loss", 0.0))  # a tensor here would wait for the step
            times[batch] = time.perf_counter() - times[batch]

        timer = keras.callbacks.LambdaCallback(on_train_batch_begin=begin,
                                               on_train_batch_end=end)
        history = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                            callbacks=[timer])
        loss = float(history.history["loss"][-1])
    else:
        for i in range(2):
            t0 = time.perf_counter()
            out = model.train_on_batch(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch])
            loss = float(out[0] if isinstance(out, (list, tuple)) else out)  # waits for the step
            times[i] = time.perf_counter() - t0
    if not math.isfinite(loss):
        raise ProbeFailure("wrong_result", f"the training step gave a non-finite loss {loss}")
    for var in model.trainable_variables:
        copies = _replica_copies(var)
        first = np.asarray(copies[0])
        if any(not np.array_equal(first, np.asarray(c)) for c in copies[1:]):
            raise ProbeFailure("wrong_result",
                               f"after training the replicas' copies of {var.name} differ")
    total = sum(float(np.asarray(_replica_copies(v)[0], dtype=np.float64).sum())
                for v in model.trainable_variables)
    return times.get(1, times.get(0, 0.0)), float(np.float32(total))


def _replica_copies(var: Any) -> Sequence[Any]:
    """Each replica's copy of a variable (Keras 3 wraps the distributed one in ``.value``)."""
    values = getattr(var, "values", None)
    if values is None:
        values = getattr(getattr(var, "value", None), "values", None)
    return tuple(values) if values is not None else (var,)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    watch_parent(args.parent_pid)
    private_temp(args.report)
    run_worker(args.report, lambda report: probe(args, report))


def private_temp(report_path: str) -> str:
    """Python's temporary files of this worker go to the probe's own directory (the one holding
    its report, removed with it by the runner), not to the user's temp directory: TensorFlow's
    autograph writes an ``__autograph_generated_file*.py`` there for every function it converts
    and never removes them. Sets ``tempfile.tempdir`` (the process's, not ``TMPDIR``)."""
    import tempfile

    tempfile.tempdir = os.path.dirname(os.path.abspath(report_path))
    return tempfile.tempdir


if __name__ == "__main__":
    main()
