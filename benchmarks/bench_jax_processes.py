"""JAX across processes: 2 processes x 4 devices against 1 process x 8 devices.

The Keras guide's convnet (`keras_parallel.demo.get_model`), DataParallel,
the same global batch (64 and 512), `fit` on the digits data tiled to 8,192
samples. One round runs each layout once, order swapped every round; each
run reports its throughput (samples per second) over epochs 2.. (epoch 1
compiles). Prints every round and the median ratio of throughputs
(2 x 4 / 1 x 8; target at least 0.85 at batch 512 on a 2-core machine).

Run: `python benchmarks/bench_jax_processes.py [--rounds 3] [--epochs 3]`;
`--against-loop` compares 2 x 4 `fit` with the JAX guide's hand-written
`jax.jit` training loop on the same 2 x 4 launch (same model, data, global
batch, per-process rows, each step waited for on CPU as `fit` does; the
honest anchor: XLA:CPU's cross-process collectives cost the same to any
program; target: `fit` at least 0.95 of the loop's throughput);
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

    model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,  # As the loops it is compared with.
        verbose=0,
        callbacks=[clock],
    )
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


def loop_worker(out, batch_size, epochs):
    """The JAX guide's hand-written training loop, in each process of 2 x 4.

    As `bench_jax.GuideLoop` writes it (the guide's `compute_loss`,
    `jax.value_and_grad`, one `jax.jit` step over stateless calls), over
    the global 8-device mesh: each process puts its own rows of every
    global batch in (`jax.make_array_from_process_local_data`), as
    keras_parallel's `fit` does.
    """

    import time

    import jax
    import keras
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from keras_parallel import demo

    # The launcher runs this file without putting its folder on the path.
    sys.path.insert(0, HERE)
    from bench_jax import guide_train_step

    (x, y), _ = demo.load_digits_28()
    x, y = np.tile(x, (6, 1, 1, 1))[:8192], np.tile(y, 6)[:8192]
    keras.utils.set_random_seed(0)  # The same initial weights in every process.
    model = demo.get_model()
    optimizer = keras.optimizers.Adam(1e-3)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.build((None, 28, 28, 1))
    optimizer.build(model.trainable_variables)
    train_step = guide_train_step(model, optimizer, loss)

    mesh = Mesh(np.array(jax.devices()), ("batch",))
    replicated = NamedSharding(mesh, P())
    data_sharding = NamedSharding(mesh, P("batch"))
    state = tuple(
        jax.device_put([v.value for v in variables], replicated)
        for variables in (
            model.trainable_variables,
            model.non_trainable_variables,
            optimizer.variables,
        )
    )
    rows = batch_size // jax.process_count()
    first = jax.process_index() * rows
    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        for begin in range(0, len(x) - batch_size + 1, batch_size):
            own = slice(begin + first, begin + first + rows)
            xb = jax.make_array_from_process_local_data(data_sharding, x[own])
            yb = jax.make_array_from_process_local_data(data_sharding, y[own])
            loss_value, state = train_step(state, xb, yb)
            # XLA:CPU's collectives can deadlock when steps overlap: wait
            # for each, as keras_parallel's executor does on CPU devices.
            loss_value.block_until_ready()
        times.append(time.perf_counter() - start)
    if jax.process_index() == 0:
        samples = (len(x) // batch_size) * batch_size
        with open(out, "w") as f:
            json.dump({"samples_per_s": samples / statistics.median(times[1:])}, f)


ROLES = {"2x4": "--worker", "1x8": "--worker", "keras2x4": "--keras-worker"}
ROLES["loop2x4"] = "--loop-worker"


def run(layout, batch_size, epochs):
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "result.json")
        env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=ROOT)
        role = ROLES[layout]
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
    workers = {"--worker": worker, "--keras-worker": keras_worker}
    workers["--loop-worker"] = loop_worker
    if len(sys.argv) > 1 and sys.argv[1] in workers:
        run_worker = workers[sys.argv[1]]
        return run_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 512])
    parser.add_argument(
        "--against-loop",
        action="store_true",
        help="compare 2x4 fit with the JAX guide's jit loop on the same 2x4",
    )
    parser.add_argument(
        "--against-keras",
        action="store_true",
        help="compare 2x4 with Keras's own multi-process fit instead of 1x8",
    )
    args = parser.parse_args()
    if args.against_keras:
        return compare(args, "keras2x4", "Keras's own")
    if args.against_loop:
        return compare(args, "loop2x4", "the guide's jit loop")
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


def compare(args, anchor, anchor_name):
    """keras_parallel's 2x4 `fit` against `anchor` on 2x4, interleaved rounds."""
    for batch_size in args.batches:
        ratios = []
        for round_ in range(args.rounds):
            order = ["2x4", anchor] if round_ % 2 == 0 else [anchor, "2x4"]
            speed = {layout: run(layout, batch_size, args.epochs) for layout in order}
            ratios.append(speed["2x4"] / speed[anchor])
            print(
                f"batch {batch_size} round {round_}: keras_parallel "
                f"{speed['2x4']:.0f}/s, {anchor_name} {speed[anchor]:.0f}/s, "
                f"ratio {ratios[-1]:.3f}",
                flush=True,
            )
        print(
            f"batch {batch_size}: median throughput ratio keras_parallel / "
            f"{anchor_name} = {statistics.median(ratios):.3f} (rounds "
            f"{min(ratios):.3f}-{max(ratios):.3f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
