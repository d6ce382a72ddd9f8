"""A training script killed part way and started again, as a user's would be.

`python resume_script.py OUT BACKUP [KILL]` trains a small model with
dropout, Adam and a shuffled, uneven 203-sample epoch for 4 epochs under
`DataParallel`, with `keras.callbacks.BackupAndRestore(BACKUP)`, and writes
process 0's final weights to `OUT/weights.npz`. With `KILL="self"` process
0 writes `OUT/killpoint` at epoch 2, batch 3 and kills itself with
SIGKILL; with `KILL="wait"` it writes it and waits to be killed (the test
kills every process, or the launcher). With `KILL="SIGTERM:1"` (any signal,
any rank) that process writes it and sends itself the signal, a
preemption: the processes stop at one step, write the backup and exit with
75; with `KILL="SIGTERM:launcher"` process 0 sends it to its parent, the
launcher. Once `OUT/killpoint` exists, no
process is killed again (a restarted run trains to the end). The model's
first layer is a `split_probe` probe; each process writes the rows it
recorded to `OUT/records<rank>-<run>.json` (the run: how many killpoints
existed at its start, 0 or 1). With `RESUME_INPUT=pydataset` in the
environment it trains on a `PyDataset` instead of arrays. With
`KILL="wait:1"` process 1 writes the mark and sleeps in the callback
(a stall); with `KILL="getitem:1"` it sleeps in the PyDataset's
`__getitem__` instead, making a batch of epoch 2. `ALIKE_SLEEP=S` makes
every process sleep S seconds at epoch 1, batch 1 (all alike slow, which
is no stall). With `KILL="forge:1"` process 1 writes a stop notice under
the run's real key straight into the backend's store, without the run's
tag (as anyone who reached the store could). Run directly (one process) or through
`keras-parallel launch`. The tests import `build` and `train` for the
uninterrupted reference.
"""

import json
import os
import signal
import sys
import time

import keras
import numpy as np
import split_probe

import keras_parallel

KILL_AT = (2, 3)  # (epoch, batch)
EPOCHS = 4


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def build(distributed=True, probe=False, devices=None, dropout=True):
    """The model, compiled; `devices`: those its `DataParallel` spans
    (default: every one)."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((16,))
    x = split_probe.probe()(inputs) if probe else inputs
    x = keras.layers.Dense(32, activation="relu", name="d1")(x)
    if dropout:
        x = keras.layers.Dropout(0.3, seed=3)(x)
    model = Net(inputs, keras.layers.Dense(8, name="d2")(x), name="net")
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        distribution=(
            keras_parallel.DataParallel(devices=devices) if distributed else None
        ),
    )
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(203, 16)).astype("float32")
    y = rng.normal(size=(203, 8)).astype("float32")
    return x, y


def batches():
    """The data as a `keras.utils.PyDataset` of 13 batches of 16 (the last
    of 11), whose batches the processes make round-robin (divided input):
    an epoch long enough for a preemption agreed a few steps after the
    signal to stop in it."""
    x, y = data()

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 13

        def __getitem__(self, i):
            _made[0] += 1
            # Process 1 asleep making a batch of epoch 2 (it makes every
            # other batch: 6 or 7 an epoch).
            if _made[0] == 10 and _stall_at_getitem():
                asleep_making_a_batch()
            return x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16]

    return Batches()


#: The batches this process made so far.
_made = [0]


def _stall_at_getitem():
    how = os.environ.get("RESUME_KILL", "")
    name, _, rank = how.partition(":")
    if name != "getitem" or _rank() != int(rank):
        return False
    return not os.path.exists(os.path.join(os.environ["RESUME_OUT"], "killpoint"))


def asleep_making_a_batch():
    with open(os.path.join(os.environ["RESUME_OUT"], "killpoint"), "w") as f:
        f.write(f"{os.getpid()} {time.time()}")
    time.sleep(300)


def asleep_in_a_callback():
    time.sleep(300)


class AlikeSlow(keras.callbacks.Callback):
    """Every process sleeps `seconds` at epoch 1, batch 1: slow, no stall."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == (1, 1):
            time.sleep(self.seconds)


class Rows:
    """A map-style dataset of the rows, for a torch `DataLoader`; with
    `KILL="getitem:1"` process 1's loader worker sleeps at its 60th row."""

    def __init__(self, x, y):
        self.x, self.y = x, y
        self.loaded = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.loaded += 1
        if self.loaded == 60 and _stall_at_getitem():
            asleep_making_a_batch()
        return self.x[i], self.y[i]


def train(model, callbacks=(), source="arrays"):
    """Fits 4 shuffled epochs of arrays, or (`source="pydataset"`) of
    `batches()` (its batch order shuffled), or (`source="dataloader"`,
    torch) of a shuffled `DataLoader` with one worker process."""
    x, y = data()
    inputs = dict(x=x, y=y, batch_size=32)
    if source == "pydataset":
        inputs = dict(x=batches())
    if source == "dataloader":
        import torch

        inputs = dict(
            x=torch.utils.data.DataLoader(
                Rows(x, y), batch_size=32, shuffle=True, num_workers=1
            )
        )
    return model.fit(
        **inputs,
        epochs=EPOCHS,
        shuffle=True,
        verbose=0,
        callbacks=list(callbacks),
    )


class Kill(keras.callbacks.Callback):
    """Kills this process (or waits to be killed) at `KILL_AT`."""

    def __init__(self, out, how):
        super().__init__()
        self.out = out
        self.how = how
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        marker = os.path.join(self.out, "killpoint")
        name, _, rank = self.how.partition(":")
        chosen = _rank() == int(rank) if rank.isdigit() else _is_chief()
        if (self.epoch, batch) != KILL_AT or not chosen or name == "getitem":
            return
        if os.path.exists(marker):
            return  # Killed once already: this is the restarted run.
        with open(marker, "w") as f:
            f.write(f"{os.getpid()} {time.time()}")
        if self.how == "self":
            os.kill(os.getpid(), signal.SIGKILL)
        elif name == "forge":
            forge_stop_notice()
            # Every process's watch looks for a notice about every 2 s: this
            # step waits until each has read it (the others wait for this
            # process in the next step's collective).
            time.sleep(4)
            return
        elif name.startswith("SIG"):
            # One process (preempted at an agreed step), or the launcher
            # that started this one (`SIGTERM:launcher`, chosen: rank 0).
            target = os.getppid() if rank == "launcher" else os.getpid()
            os.kill(target, getattr(signal, name))
            return
        if name == "wait" and rank.isdigit():
            asleep_in_a_callback()  # A stall of one process.
        time.sleep(300)


def forge_stop_notice():
    """A stop notice under this `fit`'s real key, written to the backend's
    store itself (no tag: what an intruder can write)."""
    from keras_parallel.persistence.preemption import PreemptionWatch

    backend = keras.backend.backend()
    if backend == "jax":
        from keras_parallel.backends.jax.processes import CoordinationStore
    elif backend == "torch":
        from keras_parallel.backends.torch.group import (
            KeyValueStore as CoordinationStore,
        )
    else:
        from keras_parallel.backends.tensorflow.workers import CoordinationStore
    key = f"keras_parallel/stop/{PreemptionWatch._entries}/notice"
    CoordinationStore().set(key, "0:SIGTERM")


def _rank():
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.process_index()
    if backend == "torch":
        return int(os.environ.get("RANK", "0"))
    config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    return config.get("task", {}).get("index", 0)


def _is_chief():
    return _rank() == 0


def main(out, backup, kill=None):
    run = int(os.path.exists(os.path.join(out, "killpoint")))
    # `RESUME_DROPOUT=0`: no dropout, so that torch's ranks (each drawing
    # its own masks) train as one device does.
    model = build(probe=True, dropout=os.environ.get("RESUME_DROPOUT") != "0")
    callbacks = [keras.callbacks.BackupAndRestore(backup)]
    if kill:
        callbacks.append(Kill(out, kill))
        os.environ["RESUME_KILL"], os.environ["RESUME_OUT"] = kill, out
    if os.environ.get("ALIKE_SLEEP"):
        callbacks.append(AlikeSlow(float(os.environ["ALIKE_SLEEP"])))
    split_probe.clear()
    try:
        train(model, callbacks, os.environ.get("RESUME_INPUT", "arrays"))
    finally:
        with open(os.path.join(out, f"records{_rank()}-{run}.json"), "w") as f:
            json.dump(split_probe.records(), f)
    weights = model.get_weights()
    if _is_chief():
        np.savez(os.path.join(out, "weights.npz"), *weights)


if __name__ == "__main__":
    main(*sys.argv[1:])
