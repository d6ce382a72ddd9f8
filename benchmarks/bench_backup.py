"""`BackupAndRestore` every epoch: its cost per epoch, side by side.

The Keras guide's convnet (`keras_parallel.demo.get_model`), DataParallel
over the backend's devices, the digits data tiled to 8,192 samples, batch
256. Each round fits the same model without and with
`keras.callbacks.BackupAndRestore(save_freq="epoch")` (order swapped every
round) and times epochs 2.. (epoch 1 compiles). Prints the median epoch
times, the ratio (with / without) and the time of one backup (weights,
optimizer state, random state; written atomically by process 0), and the
time to restore it at the start of a `fit`.

Run (JAX, 8 simulated CPU devices):
`KERAS_BACKEND=jax XLA_FLAGS=--xla_force_host_platform_device_count=8
python benchmarks/bench_backup.py [--rounds 3] [--epochs 4]`.
"""

import argparse
import statistics
import tempfile
import time

import keras
import numpy as np

import keras_parallel
from keras_parallel import demo
from keras_parallel.persistence import backup


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


class EpochClock(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self.start)


def model():
    keras.utils.set_random_seed(1)
    net = demo.get_model(Net)
    net.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        distribution=keras_parallel.DataParallel(),
    )
    return net


def timed(function, log):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            log.append(time.perf_counter() - start)

    return wrapper


def run(with_backup, x, y, epochs):
    """Median epoch time (epochs 2..), backup and restore times."""
    clock = EpochClock()
    callbacks = [clock]
    saves, loads = [], []
    with tempfile.TemporaryDirectory() as directory:
        if with_backup:
            callbacks.append(
                keras.callbacks.BackupAndRestore(directory, delete_checkpoint=False)
            )
        save, load = backup._save, backup._load
        backup._save, backup._load = timed(save, saves), timed(load, loads)
        try:
            net = model()
            net.fit(x, y, batch_size=256, epochs=epochs, verbose=0, callbacks=callbacks)
            if with_backup:
                # Restore: a fresh model resumes from the last backup.
                again = model()
                again.fit(
                    x,
                    y,
                    batch_size=256,
                    epochs=epochs,
                    verbose=0,
                    callbacks=[keras.callbacks.BackupAndRestore(directory)],
                )
        finally:
            backup._save, backup._load = save, load
    return statistics.median(clock.times[1:]), saves, loads


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    (x, y), _ = demo.load_digits_28()
    x, y = np.tile(x, (6, 1, 1, 1))[:8192], np.tile(y, 6)[:8192]
    ratios, saves, loads = [], [], []
    for round_ in range(args.rounds):
        order = [False, True] if round_ % 2 == 0 else [True, False]
        epoch = {}
        for with_backup in order:
            epoch[with_backup], s, l_ = run(with_backup, x, y, args.epochs)
            saves += s
            loads += l_[-1:]  # The resuming fit's load (the first has none).
        ratios.append(epoch[True] / epoch[False])
        print(
            f"round {round_}: epoch {epoch[False]:.3f} s without, "
            f"{epoch[True]:.3f} s with a backup every epoch; ratio "
            f"{ratios[-1]:.3f}",
            flush=True,
        )
    print(
        f"{keras.backend.backend()}, {len(keras_parallel.DataParallel().device_mesh.devices.flatten())} devices, "
        f"{model().count_params()} parameters: median epoch ratio with / "
        f"without BackupAndRestore = {statistics.median(ratios):.3f} (rounds "
        f"{min(ratios):.3f}-{max(ratios):.3f}); one backup "
        f"{statistics.median(saves) * 1000:.0f} ms (median of {len(saves)}), "
        f"one restore {statistics.median(loads) * 1000:.0f} ms"
    )


if __name__ == "__main__":
    main()
