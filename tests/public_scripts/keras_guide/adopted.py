"""The Keras-guide-shaped script of ``original.py``, adopted as docs/how-to/keras.md says.

Our own code (see ``original.py``: in the shape of the keras-io guide "Multi-GPU distributed
training with TensorFlow", Apache-2.0), with the adoption's lines: the import and the selection
(the guide's global batch, 32), the optimizer's ``**sel.optimizer_kwargs()``, ``sel.batch_size``
for the datasets, ``sel.strategy`` for both strategies, ``sel.callbacks()`` in both fits and
``sel.load_model`` for the restore.

    resilient-strategy run adopted.py
"""
# (end of header)
import os

import keras
import numpy as np
import tensorflow as tf
import resilient_strategy
sel = resilient_strategy.resilient_strategy(framework="tensorflow", global_batch_size=32)


def get_compiled_model():
    model = keras.Sequential([keras.Input(shape=(784,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(
        optimizer=keras.optimizers.Adam(**sel.optimizer_kwargs()),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    return model


def get_dataset():
    batch_size = sel.batch_size
    rng = np.random.default_rng(0)
    x = rng.random((712, 784), dtype=np.float32)
    y = np.arange(712) % 10
    splits = [(x[:512], y[:512]), (x[512:612], y[512:612]), (x[612:], y[612:])]
    return [tf.data.Dataset.from_tensor_slices(split).batch(batch_size) for split in splits]


# train on every device the strategy sees
strategy = sel.strategy
print(f"devices: {strategy.num_replicas_in_sync}")
with strategy.scope():
    model = get_compiled_model()
train_dataset, val_dataset, test_dataset = get_dataset()
model.fit(train_dataset, epochs=2, validation_data=val_dataset, callbacks=sel.callbacks())
model.evaluate(test_dataset)

# fault tolerance: restart from the latest checkpoint
checkpoint_dir = "./ckpt"
os.makedirs(checkpoint_dir, exist_ok=True)


def make_or_restore_model():
    found = [os.path.join(checkpoint_dir, name) for name in os.listdir(checkpoint_dir)]
    if found:
        latest = max(found, key=os.path.getctime)
        print(f"restoring {latest}")
        return sel.load_model(latest)
    print("building a new model")
    return get_compiled_model()


def run_training(epochs=1):
    strategy = sel.strategy
    with strategy.scope():
        model = make_or_restore_model()
    callbacks = [keras.callbacks.ModelCheckpoint(
        filepath=os.path.join(checkpoint_dir, "ckpt-{epoch}.keras"), save_freq="epoch")]
    model.fit(
        train_dataset,
        epochs=epochs,
        callbacks=callbacks + sel.callbacks(),
        validation_data=val_dataset,
        verbose=2,
    )


run_training(epochs=1)
run_training(epochs=1)
