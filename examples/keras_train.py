"""Train a small MLP classifier with Keras 3 on whatever strategy resilient_strategy proves works.

    python examples/keras_train.py                      # GPUs if their collective works, else one
    python examples/keras_train.py --cpu-replicas 2     # CI: 2 replicas on logical CPU devices
    RESILIENT_STRATEGY_CPU_REPLICAS=2 python examples/keras_train.py
    resilient-strategy run --logical-cpus 2 examples/keras_train.py --cpu-replicas 2 \
        --checkpoint-dir backup     # supervised: a stalled or failed collective relaunches on
                                    # the next strategy, Keras' BackupAndRestore resumes
    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:20001", "127.0.0.1:20002"]},
                "task": {"type": "worker", "index": 0}}' python examples/keras_train.py
                                    # one of 2 workers (start the other with index 1):
                                    # MultiWorkerMirroredStrategy when proven across both, else
                                    # worker 0 alone with accumulation (worker 1 exits 0)

Importing TensorFlow earlier would be fine too, as long as nothing touches a GPU before the
selection (CUDA reads CUDA_VISIBLE_DEVICES, which the selection may narrow, when it first starts);
importing it after is the habit that cannot go wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import resilient_strategy

FEATURES, CLASSES = 32, 10


def synthetic_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian inputs labelled by a random linear teacher with noise: learnable, not trivial."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    teacher = rng.normal(size=(FEATURES, CLASSES))
    y = np.argmax(x @ teacher + 0.5 * rng.normal(size=(n, CLASSES)), axis=1).astype("int32")
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument(
        "--cpu-replicas", type=int, default=int(os.environ.get("RESILIENT_STRATEGY_CPU_REPLICAS", 0)),
        help="train on N logical CPU devices instead of GPUs (testing without GPUs)",
    )
    parser.add_argument("--checkpoint-dir", default=None,
                        help="Keras BackupAndRestore there (each epoch): a relaunch resumes")
    parser.add_argument("--result", default=None,
                        help="write the decision (sel.to_dict()) to RESULT.decision.json, and "
                        "what training did to RESULT.trained.json (for tests and scripts)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per probe")
    args = parser.parse_args()

    sel = resilient_strategy.resilient_strategy(
        framework="tensorflow", global_batch_size=args.global_batch_size,
        logical_cpus=args.cpu_replicas, timeout=args.timeout,
    )
    sel.print(sel.summary())  # one line (sel.explain() says why)
    if args.result:  # before scope(): a worker the decision leaves idle exits 0 there
        write_json(f"{args.result}.decision.json", sel.to_dict())

    import keras
    import tensorflow as tf

    x, y = synthetic_data(args.samples)
    with sel.scope():  # model, optimizer, compile (and load_weights) inside the one strategy
        model = keras.Sequential([
            keras.Input((FEATURES,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(CLASSES),
        ])
        # a schedule advances per optimizer update, also when the fallback accumulates
        lr = keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=args.epochs * 100)
        model.compile(
            optimizer=keras.optimizers.Adam(**sel.optimizer_kwargs(learning_rate=lr)),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    # sel.batch_size: one step over all replicas; a micro-batch when accumulating.
    data = (
        tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0)
        .batch(sel.batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
    )
    print(
        f"{sel.num_replicas} replica(s) x {sel.per_replica_batch_size} samples x "
        f"{sel.accumulation_steps} accumulation step(s) = global batch {sel.global_batch_size}"
    )
    samples = len(x) // sel.batch_size * sel.batch_size
    start = [0.0]

    def report(epoch: int, logs: dict[str, float]) -> None:
        rate = samples / (time.perf_counter() - start[0])
        print(f"epoch {epoch + 1}: loss {logs['loss']:.4f}, accuracy {logs['accuracy']:.3f}, "
              f"{rate:,.0f} samples/s")

    timing = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: start.__setitem__(0, time.perf_counter()),
        on_epoch_end=report,
    )
    # sel.callbacks() checks, before the first step, that the optimizer accumulates as needed,
    # reports progress under `resilient-strategy run`, and backs up to --checkpoint-dir
    history = model.fit(data, epochs=args.epochs, shuffle=False, verbose=0,  # shuffled above
                        callbacks=[timing, *sel.callbacks(backup_dir=args.checkpoint_dir)])
    if args.result:
        write_json(f"{args.result}.trained.json", {
            "strategy": type(sel.strategy).__name__,
            "replicas_in_sync": int(sel.strategy.num_replicas_in_sync),
            "optimizer_updates": int(model.optimizer.iterations.numpy()),
            "loss": [float(x) for x in history.history["loss"]],
            "weights_sum": float(sum(float(np.sum(w)) for w in model.get_weights())),
        })


def write_json(path: str, data: dict[str, object]) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
