"""The training script the multi-process JAX tests launch, one per process.

`python jax_processes_script.py OUT CASE[,CASE...]` trains the small model
under each CASE in turn (`case_batches.serve`: one launch, a folder
`OUT/CASE` each) and writes, per process, its weights (whole, gathered),
its rows of a global batch, its logs and its `describe()` there. Each process builds its
model from another seed: only process 0's initial weights may count. The
tests import `build` and `train` to make the one-process references.
"""

import json
import os
import sys
import time

import keras
import numpy as np

import keras_parallel
from keras_parallel.keras_seam.model_state import binding_of

CASES = (
    "data_parallel_one_step",
    "data_parallel_epoch",
    "model_parallel_one_step",
    "model_parallel_epoch",
    "model_parallel_across_one_step",
    "fail",
)


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def distribution(case):
    """The case's distribution over every device of every process."""
    if case.startswith("model_parallel"):
        devices = keras.distribution.list_devices()
        # "across": the model axis spans the processes (d1/kernel is split
        # between them), else the data axis does.
        names = ["model", "data"] if "across" in case else ["data", "model"]
        mesh = keras.distribution.DeviceMesh((2, 4), names, devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map["d1/kernel"] = (None, "model")
        layout_map["d2/output"] = ("data", None)
        return keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="data"
        )
    return keras_parallel.DataParallel()


def build(case, seed, distributed=True):
    """The small model, compiled (with the case's distribution)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, activation="relu", name="d1")(inputs)
    if case == "fail":
        x = keras.layers.BatchNormalization(name="bn")(x)
    model = Net(inputs=inputs, outputs=keras.layers.Dense(8, name="d2")(x), name="net")
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss="mse",
        distribution=distribution(case) if distributed else None,
    )
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1003, 16)).astype("float32")
    y = rng.normal(size=(1003, 8)).astype("float32")
    return x, y


def train(model, case, callbacks=()):
    """One step, or one shuffled epoch of 1003 samples (a 43-row last batch)."""
    x, y = data()
    one_step = case.endswith("one_step")
    return model.fit(
        x,
        y,
        batch_size=64,
        epochs=1,
        steps_per_epoch=1 if one_step else None,
        shuffle=not one_step,
        verbose=0,
        callbacks=list(callbacks),
    )


def main(out, cases):
    import case_batches
    import jax
    from builders import slow_writes

    if jax.process_index() == 0:
        slow_writes()  # A process that returned early would find no file.
    case_batches.serve(out, cases.split(","), run_case, jax.process_index())


def run_case(out, case):
    import jax

    from keras_parallel.backends.jax.batches import distribute_batch

    process = jax.process_index()

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if case == "fail" and process == 1 and batch == 3:
                # When it raised, for the test's bound on how long the
                # others then run (not on the launch's start-up).
                with open(os.path.join(out, "..", "raised_at"), "w") as f:
                    f.write(repr(time.time()))
                raise ValueError("boom on process 1")

    np.random.seed(5 + process)  # The shuffle must still be process 0's.
    if case == "disagree":
        # Process 1 asks for ModelParallel, process 0 for DataParallel.
        case = "model_parallel_one_step" if process == 1 else "data_parallel_one_step"
    model = build(case, seed=1 + process)
    checkpoint_path = os.path.join(out, "checkpoint.weights.h5")
    checkpoint = keras.callbacks.ModelCheckpoint(
        checkpoint_path, save_weights_only=True
    )
    history = train(model, case, callbacks=[Boom(), checkpoint])
    # What process 0 wrote in `fit` is there when `fit` returns, here too.
    checkpoint_there = os.path.exists(checkpoint_path)
    # Every process saves (a collective where variables span processes);
    # process 0 alone writes, and the call returns once it has.
    model.save(os.path.join(out, "model.keras"))
    loaded = keras.saving.load_model(os.path.join(out, "model.keras"))
    weights = model.get_weights()  # Whole on every process.
    loaded_as_saved = all(
        np.array_equal(a, b) for a, b in zip(loaded.get_weights(), weights, strict=True)
    )
    np.savez(os.path.join(out, f"weights{process}.npz"), *weights)
    x, y = data()
    np.save(
        os.path.join(out, f"predictions{process}.npy"),
        model.predict(x[:203], batch_size=64, verbose=0),
    )
    evaluation = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    # Which rows of a 64-row global batch this process's devices hold.
    layout = binding_of(model).executor._planned.get_data_layout((64, 16))
    batch = distribute_batch(
        data()[0][:64], layout.backend_layout, "data", previous=None
    )
    rows = sorted({i for s in batch.addressable_shards for i in range(64)[s.index[0]]})
    kernel = model.get_layer("d1").kernel.value
    info = {
        "rows": rows,
        "loss": history.history["loss"],
        "evaluation": {k: float(v) for k, v in evaluation.items()},
        "describe": keras_parallel.describe(model),
        "kernel_shards": [list(s.data.shape) for s in kernel.addressable_shards],
        "devices": len(jax.devices()),
        "local_devices": len(jax.local_devices()),
        "checkpoint_there_after_fit": checkpoint_there,
        "loaded_as_saved": loaded_as_saved,
    }
    if case.startswith("model_parallel"):
        from builders import sharding_ops

        x, y = data()
        info["sharding_ops"] = sharding_ops(model, x[:64], y[:64])
    with open(os.path.join(out, f"info{process}.json"), "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
