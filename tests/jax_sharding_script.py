"""The script the multi-process `shard=` tests launch, one per process.

`python jax_sharding_script.py OUT MODE` trains `builders.wide_mlp` with
Adam under `keras_parallel.DataParallel(shard=MODE)` over every device of
every process (2 processes x 4 devices), 1 step and then 9 more, and
writes, per process: the whole weights after each (gathered), the rows of
a global batch its devices hold, and the shapes of the shards it holds of
each large kernel and of its Adam slots. Each process builds its model
from another seed: only process 0's initial weights may count.

MODE `full_built`: `shard="full"`, the model built inside
`distribution.scope()` from the same seed on every process; the script
also records the shapes of every value gathered whole (`processes.fetch`)
while the model is built and compiled: none may be a large variable.
"""

import json
import os
import sys

import keras
import numpy as np
from builders import wide_data, wide_mlp

import keras_parallel
from keras_parallel.keras_seam.model_state import binding_of


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def main(out, modes):
    import case_batches
    import jax

    case_batches.serve(out, modes.split(","), run_case, jax.process_index())


def run_case(out, mode):
    import jax

    from keras_parallel.backends.jax import processes
    from keras_parallel.backends.jax.batches import distribute_batch

    process = jax.process_index()
    built = mode == "full_built"
    distribution = keras_parallel.DataParallel(shard="full" if built else mode)
    fetched = []
    fetch = processes.fetch

    def recorded_fetch(value):
        fetched.append(list(getattr(value, "shape", ())))
        return fetch(value)

    processes.fetch = recorded_fetch
    if built:
        with distribution.scope():
            model = wide_mlp(Net, seed=1)
    else:
        model = wide_mlp(Net, seed=1 + process)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss="mse", distribution=distribution
    )
    x, y = wide_data(640)
    weights = {}
    for steps, rows in ((1, slice(0, 64)), (10, slice(64, 640))):
        model.fit(x[rows], y[rows], batch_size=64, shuffle=False, verbose=0)
        # What applying the plan fetched (as the first fit began), not what
        # gathering the weights below does.
        processes.fetch = fetch
        weights[f"step{steps}"] = model.get_weights()  # Whole, every process.
    for name, values in weights.items():
        np.savez(os.path.join(out, f"{name}_{process}.npz"), *values)
    layout = binding_of(model).executor._planned.get_data_layout((64, 256))
    batch = distribute_batch(x[:64], layout.backend_layout, "batch", previous=None)
    rows = sorted({i for s in batch.addressable_shards for i in range(64)[s.index[0]]})
    held = {}
    for variable in model.weights + model.optimizer.variables:
        if variable.path.startswith(("d1/kernel", "d2/kernel")) or "kernel_" in (
            variable.path
        ):
            value = variable.value
            held[variable.path] = [
                [list(s.data.shape) for s in value.addressable_shards],
                list(value.shape),
            ]
    with open(os.path.join(out, f"info{process}.json"), "w") as f:
        json.dump({"rows": rows, "held": held, "fetched": fetched}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
