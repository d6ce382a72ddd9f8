"""JAX across processes: 2 processes x 4 devices against 1 process x 8 devices.

The Keras guide's convnet (`keras_parallel.demo.get_model`), DataParallel,
the same global batch (64 and 512), `fit` on the digits data tiled to 8,192
samples. One round runs each layout once, order swapped every round; each
run reports its throughput (samples per second) over epochs 2.. (epoch 1
compiles). Prints every round and the median ratio of throughputs
(2 x 4 / 1 x 8; target at least 0.85 at batch 512 on a 2-core machine).

Run: `python benchmarks/bench_jax_processes.py [--rounds 3] [--epochs 3]`;
`--against-keras` compares 2 x 4 with Keras's own multi-process `fit`
(the same seed in every process, a `tf.data` cut to each process's rows;
target: not slower).
The processes are started with `keras-parallel launch --backend jax`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def epoch_clock():
    """A callback that appends each epoch's wall time to its `times`."""
    import time

    import keras

    class EpochClock(keras.callbacks.Callback):
        times = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    return EpochClock()


def worker(out, batch_size, epochs):
    """One run (in each process): trains and writes its throughput."""

    import jax
    import keras
    import numpy as np

    import keras_parallel
    from keras_parallel import demo

    class Net(keras_parallel.DistributedModel, keras.Model):
        pass

    (x, y), _ = demo.load_digits_28()
    x, y = np.tile(x, (6, 1, 1, 1))[:8192], np.tile(y, 6)[:8192]
    model = demo.get_model(Net)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        distribution=keras_parallel.DataParallel(),
    )
    clock = epoch_clock()
    times = clock.times

    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, callbacks=[clock])
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump({"samples_per_s": len(x) / statistics.median(times[1:])}, f)


def keras_worker(out, batch_size, epochs):
    """Keras's own multi-process `fit` (no keras_parallel in the model).

    What Keras asks of a multi-process user: the same seed in every process
    (else "passed to device_put is not the same on each process"), and data
    each process has cut to its rows of every global batch (a `tf.data`
    dataset, or, with `auto_shard_dataset = False`, arrays; arrays here, as
    the jax env has no TensorFlow).
    """

    import jax
    import keras
    import numpy as np

    from keras_parallel import demo

    (x, y), _ = demo.load_digits_28()
    x, y = np.tile(x, (6, 1, 1, 1))[:8192], np.tile(y, 6)[:8192]
    keras.utils.set_random_seed(1)
    distribution = keras.distribution.DataParallel()
    distribution.auto_shard_dataset = False
    keras.distribution.set_distribution(distribution)
    model = demo.get_model(keras.Model)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rows = batch_size // jax.process_count()
    start = jax.process_index() * rows
    batches = len(x) // batch_size

    def own_rows(a):
        a = a[: batches * batch_size].reshape((batches, batch_size) + a.shape[1:])
        return a[:, start : start + rows].reshape((batches * rows,) + a.shape[2:])

    x_own, y_own = own_rows(x), own_rows(y)
    clock = epoch_clock()
    times = clock.times

    model.fit(
        x_own,
        y_own,
        batch_size=rows,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[clock],
    )
    if jax.process_index() == 0:
        samples = (len(x) // batch_size) * batch_size
        with open(out, "w") as f:
            json.dump({"samples_per_s": samples / statistics.median(times[1:])}, f)


def run(layout, batch_size, epochs):
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "result.json")
        env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=ROOT)
        role = "--keras-worker" if layout == "keras2x4" else "--worker"
        me = [os.path.abspath(__file__), role, out, str(batch_size), str(epochs)]
        if layout == "1x8":
            env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
            command = [sys.executable] + me
        else:
            command = [sys.executable, "-m", "keras_parallel.cli", "launch"]
            command += ["--backend", "jax", "--nproc-per-node", "2"]
            command += ["--devices-per-process", "4"] + me
        subprocess.run(command, env=env, check=True, capture_output=True, timeout=900)
        with open(out) as f:
            return json.load(f)["samples_per_s"]


def main():
    if len(sys.argv) > 1 and sys.argv[1] in ("--worker", "--keras-worker"):
        run_worker = worker if sys.argv[1] == "--worker" else keras_worker
        return run_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 512])
    parser.add_argument(
        "--against-keras",
        action="store_true",
        help="compare 2x4 with Keras's own multi-process fit instead of 1x8",
    )
    args = parser.parse_args()
    if args.against_keras:
        return compare_with_keras(args)
    for batch_size in args.batches:
        ratios = []
        for round_ in range(args.rounds):
            order = ["1x8", "2x4"] if round_ % 2 == 0 else ["2x4", "1x8"]
            speed = {layout: run(layout, batch_size, args.epochs) for layout in order}
            ratios.append(speed["2x4"] / speed["1x8"])
            print(
                f"batch {batch_size} round {round_}: 1x8 {speed['1x8']:.0f}/s, "
                f"2x4 {speed['2x4']:.0f}/s, ratio {ratios[-1]:.3f}",
                flush=True,
            )
        print(
            f"batch {batch_size}: median throughput ratio 2x4 / 1x8 = "
            f"{statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-"
            f"{max(ratios):.3f})",
            flush=True,
        )


def compare_with_keras(args):
    """keras_parallel 2x4 against Keras's own 2x4 `fit`, interleaved rounds."""
    for batch_size in args.batches:
        ratios = []
        for round_ in range(args.rounds):
            order = ["2x4", "keras2x4"] if round_ % 2 == 0 else ["keras2x4", "2x4"]
            speed = {layout: run(layout, batch_size, args.epochs) for layout in order}
            ratios.append(speed["2x4"] / speed["keras2x4"])
            print(
                f"batch {batch_size} round {round_}: keras_parallel "
                f"{speed['2x4']:.0f}/s, Keras's own {speed['keras2x4']:.0f}/s, "
                f"ratio {ratios[-1]:.3f}",
                flush=True,
            )
        print(
            f"batch {batch_size}: median throughput ratio keras_parallel / "
            f"Keras's own = {statistics.median(ratios):.3f} (rounds "
            f"{min(ratios):.3f}-{max(ratios):.3f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
