"""A Keras full-model checkpoint across a change of strategy (tests/test_keras_load.py), one
run per process (logical devices are fixed per process). ``argv``: the variant, the .keras path,
the output JSON; several triples run one after the other in this process (one
strategy each: a OneDeviceStrategy and a MirroredStrategy may share a process).

- ``save:<n>``: 2 mirrored logical CPU replicas (n=1) or one device accumulating n=2
  micro-batches, global batch 32: SGD with momentum and a decaying schedule, one epoch of 128
  samples (4 updates), ``model.save``; then one more epoch: the uninterrupted run's weights.
- ``load:<n>``: that strategy; ``runtime.load_model`` and one epoch through ``fit`` with the
  runtime's callbacks (``plain:<n>``: ``keras.models.load_model`` in the scope instead).
"""

import json
import sys

import numpy as np

from resilient_strategy.frameworks.tensorflow import TfRuntime


def run(variant: str, path: str, out: str) -> None:
    what, n = variant.split(":")
    rt = TfRuntime("reduction_to_one_device", (0, 1), 1, 32, 16, logical_cpus=2) if n == "1" \
        else TfRuntime("single_device", (0,), 2, 32, 16, logical_cpus=2)
    strategy = rt.strategy  # before any TF op: it configures the logical devices
    import keras
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(rt.batch_size_to_feed)
    result: dict = {"replicas": strategy.num_replicas_in_sync}
    if what == "save":
        with rt.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="tanh"),
                                      keras.layers.Dense(1)])
            model.set_weights([np.full(w.shape, 0.1, "float32") * (i + 1)
                               for i, w in enumerate(model.get_weights())])
            lr = keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.7)
            model.compile(optimizer=keras.optimizers.SGD(momentum=0.9,
                                                         **rt.optimizer_kwargs(learning_rate=lr)),
                          loss="mse")
        model.fit(data, epochs=1, verbose=0, callbacks=rt.callbacks())
        model.save(path)
        model.fit(data, epochs=1, verbose=0, callbacks=rt.callbacks())
    else:
        try:
            if what == "plain":  # as a script would (the schedule's class registered)
                from resilient_strategy.frameworks.tensorflow import update_step_schedule_class

                update_step_schedule_class()
                with rt.scope():
                    model = keras.models.load_model(path)
            else:
                model = rt.load_model(path)
            model.fit(data, epochs=1, verbose=0, callbacks=rt.callbacks())
        except Exception as exc:  # the test reads which
            import traceback

            traceback.print_exc()
            result["error"] = type(exc).__name__
            model = None
    if model is not None:
        opt = model.optimizer
        result.update(accumulation=opt.gradient_accumulation_steps or 1,
                      iterations=int(opt.iterations.numpy()),
                      weights=np.concatenate([np.ravel(w) for w in model.get_weights()]).tolist())
    with open(out, "w") as fh:
        json.dump(result, fh)


args = sys.argv[1:]
for i in range(0, len(args), 3):
    run(*args[i:i + 3])
