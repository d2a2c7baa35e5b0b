"""A Keras training script in the shape of the Keras guide "Multi-GPU distributed training
with TensorFlow".

Our own code, in the shape of keras-team/keras-io ``guides/distributed_training_with_tensorflow.py``
(Apache-2.0, https://keras.io/guides/distributed_training_with_tensorflow/), written here, not
copied: a function that builds and compiles the model, one that makes the datasets (their
global batch size set there), a ``tf.distribute.MirroredStrategy`` whose ``scope()`` holds the
model's creation, ``fit`` then ``evaluate``; then the guide's fault-tolerance part: each
``run_training`` makes a new strategy, restores the latest ``ModelCheckpoint`` file with
``keras.models.load_model`` (or builds a fresh model) and fits one epoch, checkpointing each
epoch; it runs twice. What differs: no MNIST download: 512 training, 100 validation and 100
test seeded vectors of MNIST's 784 features, 10 classes; a smaller model.

    python original.py
"""
# (end of header)
import os

import keras
import numpy as np
import tensorflow as tf


def get_compiled_model():
    model = keras.Sequential([keras.Input(shape=(784,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    return model


def get_dataset():
    batch_size = 32
    rng = np.random.default_rng(0)
    x = rng.random((712, 784), dtype=np.float32)
    y = np.arange(712) % 10
    splits = [(x[:512], y[:512]), (x[512:612], y[512:612]), (x[612:], y[612:])]
    return [tf.data.Dataset.from_tensor_slices(split).batch(batch_size) for split in splits]


# train on every device the strategy sees
strategy = tf.distribute.MirroredStrategy()
print(f"devices: {strategy.num_replicas_in_sync}")
with strategy.scope():
    model = get_compiled_model()
train_dataset, val_dataset, test_dataset = get_dataset()
model.fit(train_dataset, epochs=2, validation_data=val_dataset)
model.evaluate(test_dataset)

# fault tolerance: restart from the latest checkpoint
checkpoint_dir = "./ckpt"
os.makedirs(checkpoint_dir, exist_ok=True)


def make_or_restore_model():
    found = [os.path.join(checkpoint_dir, name) for name in os.listdir(checkpoint_dir)]
    if found:
        latest = max(found, key=os.path.getctime)
        print(f"restoring {latest}")
        return keras.models.load_model(latest)
    print("building a new model")
    return get_compiled_model()


def run_training(epochs=1):
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        model = make_or_restore_model()
    callbacks = [keras.callbacks.ModelCheckpoint(
        filepath=os.path.join(checkpoint_dir, "ckpt-{epoch}.keras"), save_freq="epoch")]
    model.fit(
        train_dataset,
        epochs=epochs,
        callbacks=callbacks,
        validation_data=val_dataset,
        verbose=2,
    )


run_training(epochs=1)
run_training(epochs=1)
