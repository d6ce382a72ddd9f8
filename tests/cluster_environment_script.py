"""An unchanged training script, started by a cluster's own launcher.

The cluster tests start two processes of it as `srun`, `mpirun` or a
Kubernetes job would, with that launcher's variables and no launcher of ours; nothing in it
starts a runtime. Keras is imported before keras_parallel, as many scripts
do: keras_parallel must still join the processes before the first device
query (`keras_parallel.DataParallel()`).

`python cluster_environment_script.py OUT` trains one SGD step of 64 rows
(first calling `keras.distribution.initialize()` itself where
`SCRIPT_INITIALIZES=1`)
and writes, per process: its weights (`weights<rank>.npz`) and
`info<rank>.json`: the rows each device computed (`split_probe`), the
devices `DataParallel()` spans and the plan (`keras_parallel.describe`). Each process builds its model from another
seed: only process 0's initial weights may count. The tests import `build`
and `train` for the one-device reference.
"""

import json
import os
import sys

import keras
import numpy as np
import split_probe
from jax_processes_script import data

import keras_parallel

#: Where each launcher puts the rank (the script only names its files by it).
RANK_VARIABLES = ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "RANK")


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def build(seed, distributed=True):
    """The small model with a `BatchProbe` first, compiled."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16,))
    x = split_probe.probe()(inputs)
    x = keras.layers.Dense(32, activation="relu", name="d1")(x)
    model = Net(inputs=inputs, outputs=keras.layers.Dense(8, name="d2")(x), name="net")
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss="mse",
        distribution=keras_parallel.DataParallel() if distributed else None,
    )
    return model


def train(model):
    """One step over the first 64 rows."""
    x, y = data()
    model.fit(
        x, y, batch_size=64, epochs=1, steps_per_epoch=1, shuffle=False, verbose=0
    )


def main(out):
    if os.environ.get("SCRIPT_INITIALIZES") == "1":
        # A script written for its launcher, as Keras's documentation asks
        # (JAX): it must still run after keras_parallel's own.
        keras.distribution.initialize()
    rank = next(int(os.environ[v]) for v in RANK_VARIABLES if v in os.environ)
    # As most scripts: the model (its variables: TensorFlow runs) first.
    model = build(seed=1 + rank)
    split_probe.clear()
    train(model)
    devices = np.asarray(keras_parallel.DataParallel().device_mesh.devices).size
    np.savez(os.path.join(out, f"weights{rank}.npz"), *model.get_weights())
    info = {"records": split_probe.records(), "devices": int(devices)}
    info["plan"] = keras_parallel.describe(model)
    with open(os.path.join(out, f"info{rank}.json"), "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    main(sys.argv[1])
