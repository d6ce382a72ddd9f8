"""Orbax checkpoints across JAX processes; the multi-process test launches it.

`python orbax_processes_script.py OUT` on every process (2 x 4 devices):
trains a `(1, 8)` model, each kernel split over devices of both processes,
with `keras.callbacks.OrbaxCheckpoint` into `OUT/ckpt`; restores that
checkpoint into a fresh `(2, 4)` model with `restore_checkpoint`; and writes
per process the weights saved and restored (whole, gathered) and what it
saw of the restored layout to `OUT`.
"""

import json
import os
import sys

import jax
import keras
import numpy as np

import keras_parallel

STEPS = 4


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def build(shape, seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16,))
    x = keras.layers.Dense(64, activation="relu", name="d1")(inputs)
    model = Net(inputs=inputs, outputs=keras.layers.Dense(8, name="d2")(x), name="net")
    mesh = keras.distribution.DeviceMesh(
        shape, ["data", "model"], keras.distribution.list_devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="mse",
        distribution=keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="data"
        ),
    )
    return model


def main(out):
    process = jax.process_index()
    directory = os.path.join(out, "ckpt")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16 * STEPS, 16)).astype("float32")
    y = rng.normal(size=(16 * STEPS, 8)).astype("float32")
    # Another seed per process: process 0's initial weights count.
    model = build((1, 8), seed=1 + process)
    model.fit(
        x,
        y,
        batch_size=16,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.OrbaxCheckpoint(directory, save_freq=STEPS)],
    )
    restored = build((2, 4), seed=7)
    step = keras_parallel.restore_checkpoint(restored, directory)
    kernel = restored.get_layer("d1").kernel.value
    np.savez(
        os.path.join(out, f"weights{process}.npz"),
        **{f"saved{i}": w for i, w in enumerate(model.get_weights())},
        **{f"restored{i}": w for i, w in enumerate(restored.get_weights())},
    )
    info = {
        "step": step,
        "iterations": int(restored.optimizer.iterations),
        "mesh": list(kernel.sharding.mesh.shape.values()),
        "spec": [str(axis) for axis in kernel.sharding.spec],
        "local_shards": sorted(list(s.data.shape) for s in kernel.addressable_shards),
    }
    with open(os.path.join(out, f"info{process}.json"), "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    main(sys.argv[1])
