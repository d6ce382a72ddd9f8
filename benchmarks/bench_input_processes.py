"""An input-bound `fit` on 2 processes against 1: is the input divided?

Each input kind (a map-style torch `DataLoader`, a `PyDataset`, a
generator, a `tf.data` pipeline whose map does the work) does real per-row
CPU work, as decoding or augmentation does (a busy loop of `--row-ms` ms
per row), over 16 batches of 64 rows
and a small model; a fit of 3 epochs times its last 2 (the first compiles
and warms up). One process (plain Keras) and two (`keras_parallel.launch`,
torch ranks, `ShardingCallback(DataParallel())`) run interleaved,
`--rounds` times; the median epoch seconds and their ratio (2 processes /
1) are printed, with the rows each process prepared in an epoch. On this
2-core machine the ideal ratio is about 0.5: the target for an input the
processes divide is at most 0.6 (docs/benchmarks.md). A compute-bound
model (no per-row work, a wider model) shows what division costs where
the input is cheap.

On JAX and TensorFlow the processes are `keras-parallel launch --backend
jax` processes (TensorFlow workers) of one CPU device each (this file, run
as `--worker`), against one such process.

Usage:

    KERAS_BACKEND=torch python benchmarks/bench_input_processes.py [--rounds 3]
    KERAS_BACKEND=jax python benchmarks/bench_input_processes.py [--rounds 3]
    KERAS_BACKEND=tensorflow python benchmarks/bench_input_processes.py
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

ROWS, BATCH, FEATURES = 1024, 64, 32


def _busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class RowWork:
    """A map-style dataset doing `row_ms` of CPU work per row it loads."""

    def __init__(self, x, y, row_ms):
        self.x, self.y, self.row_ms = x, y, row_ms
        self.loaded = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        import torch

        _busy(self.row_ms / 1000)
        self.loaded += 1
        return torch.as_tensor(self.x[i]), torch.as_tensor(self.y[i])


def _inputs(kind, row_ms, counter):
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    y = rng.normal(size=(ROWS, 1)).astype("float32")
    if kind == "DataLoader":
        dataset = RowWork(x, y, row_ms)
        counter.append(dataset)
        return {"x": torch.utils.data.DataLoader(dataset, batch_size=BATCH)}
    if kind == "arrays":
        return {"x": x, "y": y, "batch_size": BATCH}
    import keras

    rows_made = RowWork(x, y, row_ms)  # Its count, for PyDataset and generator.
    counter.append(rows_made)

    def batch(i):
        _busy(row_ms / 1000 * BATCH)
        rows_made.loaded += BATCH
        return x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]

    if kind == "PyDataset":

        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return ROWS // BATCH

            def __getitem__(self, i):
                return batch(i)

        return {"x": Batches()}
    if kind == "generator":

        def batches():
            while True:
                for i in range(ROWS // BATCH):
                    yield batch(i)

        return {"x": batches(), "steps_per_epoch": ROWS // BATCH}
    if kind == "tf.data":
        import tensorflow as tf

        def work(x_row, y_row):
            def busy():
                _busy(row_ms / 1000)
                rows_made.loaded += 1
                return np.float32(0)

            zero = tf.reshape(tf.py_function(busy, [], tf.float32), [])
            return x_row + zero, y_row

        dataset = tf.data.Dataset.from_tensor_slices((x, y)).map(work)
        return {"x": dataset.batch(BATCH).prefetch(2)}
    raise ValueError(kind)


def epoch_seconds(kind, row_ms, width):
    """Runs in every process: the median epoch time of a 3-epoch fit."""
    import keras

    import keras_parallel

    # The launcher's variables (torch: the group itself starts with the
    # first distribution; JAX: the bootstrap joined the processes).
    world = _process_count_and_index()[0]
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(width, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile("sgd", "mse")
    times = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    callbacks = [Timer()]
    if world > 1:
        callbacks.append(keras_parallel.ShardingCallback(keras_parallel.DataParallel()))
    counter = []
    model.fit(
        **_inputs(kind, row_ms, counter), epochs=3, verbose=0, callbacks=callbacks
    )
    # What the last 2 epochs prepared (the first also builds the metrics).
    loaded = counter[0].loaded / 3 if counter else None
    return {"seconds": statistics.median(times[1:]), "rows_per_epoch": loaded}


def _process_count_and_index():
    import keras

    if keras.backend.backend() == "jax":
        import jax

        return jax.process_count(), jax.process_index()
    if keras.backend.backend() == "tensorflow":
        from keras_parallel.backends.tensorflow import workers

        strategy = workers.strategy()
        return (
            (1, 0)
            if strategy is None
            else (strategy.num_workers, strategy.worker_index)
        )
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def measure(kind, processes, row_ms, width):
    if os.environ["KERAS_BACKEND"] in ("jax", "tensorflow"):
        results = _launched_processes(kind, processes, row_ms, width)
    else:
        from keras_parallel.launcher.torch_processes import launch

        results = launch(
            epoch_seconds, processes, args=(kind, row_ms, width), timeout=600
        )
    return max(r["seconds"] for r in results), [r["rows_per_epoch"] for r in results]


def _launched_processes(kind, processes, row_ms, width):
    """`keras-parallel launch` of this file as `--worker`: JAX processes or
    TensorFlow workers."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "keras_parallel.cli", "launch"]
        backend = os.environ["KERAS_BACKEND"]
        command += ["--backend", backend, "--nproc-per-node", str(processes)]
        if backend == "tensorflow" and processes > 1:
            # Workers on one machine (their servers reachable: this machine's
            # own benchmark).
            command.append("--allow-reachable-workers")
        command += ["--devices-per-process", "1", os.path.abspath(__file__)]
        command += ["--worker", kind, str(row_ms), str(width), out]
        subprocess.run(command, check=True, timeout=600, stdout=subprocess.DEVNULL)
        results = []
        for name in sorted(os.listdir(out)):
            with open(os.path.join(out, name)) as f:
                results.append(json.load(f))
        return results


def _worker(kind, row_ms, width, out):
    result = epoch_seconds(kind, float(row_ms), int(width))
    index = _process_count_and_index()[1]
    with open(os.path.join(out, f"process{index}.json"), "w") as f:
        json.dump(result, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--row-ms", type=float, default=1.0)
    parser.add_argument("--only", default="", help="kinds, comma-separated")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(*args.worker)
    cases = [
        ("DataLoader", "input-bound", args.row_ms, 16),
        ("PyDataset", "input-bound", args.row_ms, 16),
        ("generator", "input-bound", args.row_ms, 16),
        ("tf.data", "input-bound", args.row_ms, 16),
        ("arrays", "compute-bound", 0.0, 1024),
    ]
    if args.only:
        cases = [case for case in cases if case[0] in args.only.split(",")]
    report = {}
    for kind, what, row_ms, width in cases:
        runs = {1: [], 2: []}
        rows = {}
        for _ in range(args.rounds):
            for processes in (1, 2):
                seconds, rows[processes] = measure(kind, processes, row_ms, width)
                runs[processes].append(seconds)
        one, two = statistics.median(runs[1]), statistics.median(runs[2])
        report[f"{kind} ({what})"] = {
            "1 process s/epoch": round(one, 3),
            "2 processes s/epoch": round(two, 3),
            "ratio": round(two / one, 3),
            "rows prepared per process per epoch": rows[2],
        }
        print(kind, what, json.dumps(report[f"{kind} ({what})"]), flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
