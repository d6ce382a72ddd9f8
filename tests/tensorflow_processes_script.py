"""The training script the multi-worker TensorFlow tests launch, one per worker.

`python tensorflow_processes_script.py OUT CASE` (under `keras-parallel
launch --backend tensorflow`) writes, per worker, what the tests compare:

- `train`: one SGD step (no shuffle), then one shuffled epoch of 1003
  samples (a 43-row last batch), each on a fresh model; per model its
  weights, the rows of each global batch this worker's replicas computed
  (recorded by the model's first layer), its predictions, evaluation and
  `describe()`.
- `fail`: a model with BatchNormalization; worker 1 raises at step 3.
- `features`: two unshuffled epochs with `global_clipnorm`,
  `gradient_accumulation_steps=2` and `steps_per_execution=4`; its weights,
  History and the rows each replica step computed.

Each worker builds its model from another seed and seeds NumPy differently:
only worker 0's initial weights and shuffle may count. The tests import
`build`, `data` and `Recorder` to make the one-device references.
"""

import json
import os
import sys
import threading

import keras
import numpy as np
import tensorflow as tf

# The multi-process JAX tests' data: 1003 samples, a 43-row last batch.
from jax_processes_script import data

import keras_parallel


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


#: `(replica id, first feature of each row)` per replica step, in order.
RECORDED = []
_lock = threading.Lock()


def _record(replica, values):
    with _lock:
        RECORDED.append((int(replica), [float(v) for v in values.numpy()]))


class Recorder(keras.layers.Layer):
    """The identity; in training, records which rows its replica computed."""

    def call(self, inputs, training=None):
        if training:
            context = tf.distribute.get_replica_context()
            replica = 0 if context is None else context.replica_id_in_sync_group
            tf.py_function(_record, [replica, inputs[:, 0]], [])
        return inputs


def build(seed, batchnorm=False, distributed=True, features=False):
    """The small model, compiled (with `DataParallel()` if `distributed`).

    With `features`, its optimizer clips the global gradient norm and
    accumulates 2 steps, and Keras runs 4 steps per execution.
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16,))
    x = Recorder(name="recorder")(inputs)
    x = keras.layers.Dense(32, activation="relu", name="d1")(x)
    if batchnorm:
        x = keras.layers.BatchNormalization(name="bn")(x)
    model = Net(inputs=inputs, outputs=keras.layers.Dense(8, name="d2")(x), name="net")
    extra = {}
    if features:
        extra = {"global_clipnorm": 0.5, "gradient_accumulation_steps": 2}
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, **extra),
        loss="mse",
        steps_per_execution=4 if features else 1,
        distribution=keras_parallel.DataParallel() if distributed else None,
    )
    return model


def train(model, one_step, callbacks=(), verbose=0):
    """One step, or one shuffled epoch (a 43-row last batch)."""
    x, y = data()
    return model.fit(
        x,
        y,
        batch_size=64,
        epochs=1,
        steps_per_epoch=1 if one_step else None,
        shuffle=not one_step,
        verbose=verbose,
        callbacks=list(callbacks),
    )


def rows_per_step(recorded, replicas_per_worker):
    """This worker's row indices of each global batch, step by step."""
    x, _ = data()
    index = {float(v): i for i, v in enumerate(x[:, 0])}
    steps = []
    for at in range(0, len(recorded), replicas_per_worker):
        step = recorded[at : at + replicas_per_worker]
        steps.append([index[v] for _, values in sorted(step) for v in values])
    return steps


def run_case(out, name, model, one_step, process, replicas_per_worker):
    RECORDED.clear()
    # Progress and files: worker 0's only (the tests count them).
    log = keras.callbacks.CSVLogger(os.path.join(out, f"{name}_log{process}.csv"))
    checkpoint_path = os.path.join(out, f"{name}_checkpoint.weights.h5")
    checkpoint = keras.callbacks.ModelCheckpoint(
        checkpoint_path, save_weights_only=True
    )
    history = train(model, one_step, callbacks=[log, checkpoint], verbose=2)
    rows = rows_per_step(list(RECORDED), replicas_per_worker)
    # Worker 0's files land late (`slow_writes`): `fit` and `model.save`
    # return once they are in place, on every worker.
    checkpoint_there = os.path.exists(checkpoint_path)
    shared = os.path.join(out, f"{name}_model.keras")
    model.save(shared)
    loaded = keras.saving.load_model(
        shared, custom_objects={"Recorder": Recorder, "Net": Net}
    )
    loaded_as_saved = all(
        np.array_equal(a, b)
        for a, b in zip(loaded.get_weights(), model.get_weights(), strict=True)
    )
    model.save(os.path.join(out, f"{name}_model{process}.keras"))
    np.savez(os.path.join(out, f"{name}_weights{process}.npz"), *model.get_weights())
    x, y = data()
    np.save(
        os.path.join(out, f"{name}_predictions{process}.npy"),
        model.predict(x[:203], batch_size=64, verbose=0),
    )
    evaluation = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    return {
        "rows": rows,
        "loss": history.history["loss"],
        "evaluation": {k: float(v) for k, v in evaluation.items()},
        "describe": keras_parallel.describe(model),
        "checkpoint_there_after_fit": checkpoint_there,
        "loaded_as_saved": loaded_as_saved,
    }


def main(out, case):
    from keras_parallel.backends.tensorflow import workers

    strategy = workers.strategy()
    process = strategy.worker_index
    local = len(strategy.extended.worker_devices)
    if process == 0:
        from builders import slow_writes

        slow_writes()
    np.random.seed(5 + process)  # The shuffle must still be worker 0's.

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if process == 1 and batch == 3:
                raise ValueError("boom on worker 1")

    if case == "features":
        model = build(seed=1 + process, features=True)
        x, y = data()
        RECORDED.clear()
        history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
        np.savez(
            os.path.join(out, f"features_weights{process}.npz"), *model.get_weights()
        )
        info = {
            "loss": history.history["loss"],
            "rows": [len(values) for _, values in RECORDED],
        }
        with open(os.path.join(out, f"info{process}.json"), "w") as f:
            json.dump(info, f)
        return
    if case == "fail":
        model = build(seed=1 + process, batchnorm=True)
        x, y = data()
        model.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[Boom()])
        return
    info = {
        "local_devices": local,
        "devices": len(keras_parallel.DataParallel().device_mesh.devices.flat),
    }
    for name, one_step in (("one_step", True), ("epoch", False)):
        model = build(seed=1 + process)
        info[name] = run_case(out, name, model, one_step, process, local)
    with open(os.path.join(out, f"info{process}.json"), "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
