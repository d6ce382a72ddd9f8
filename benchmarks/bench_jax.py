"""JAX speed and memory, measured side by side in one run.

Speed: `DistributedModel` DataParallel `fit` against the hand-written `jax.jit`
loop of the Keras guide "Multi-GPU distributed training with JAX" (same
convnet, same optimizer and loss, `training=True`, same 8 devices and global
batches), interleaved A B B A in every round, printing time per sample and
the median over rounds of the ratio fit / loop (target: at most 1.00).

Memory: under ModelParallel with every large kernel split over a `model` axis
of 8, the bytes per device of model plus optimizer variables, as `describe()`
reports them and as the arrays' own shards confirm, against 1/8 of the total
plus the replicated small variables.

Run: `python benchmarks/bench_jax.py [--rounds 8] [--epochs 1] [--batches 64 512]`.
"""

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import (
    Mesh,  # noqa: E402
    NamedSharding,  # noqa: E402
)
from jax.sharding import PartitionSpec as P  # noqa: E402

import keras_parallel  # noqa: E402
from keras_parallel import demo  # noqa: E402
from keras_parallel.keras_seam.model_state import binding_of


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def data(num_samples):
    (x, y), _ = demo.load_digits_28()
    reps = -(-num_samples // len(x))
    return np.tile(x, (reps, 1, 1, 1))[:num_samples], np.tile(y, reps)[:num_samples]


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def guide_train_step(model, optimizer, loss):
    """The guide's `compute_loss` and jitted `train_step`, as written there.

    Args:
        model: a built Keras model.
        optimizer: its optimizer, built for `model.trainable_variables`.
        loss: the loss function.

    Returns:
        `train_step(state, x, y) -> (loss, state)`, `state` being
        `(trainable, non_trainable, optimizer variables)` values.
    """

    def compute_loss(trainable, non_trainable, x, y):
        y_pred, non_trainable = model.stateless_call(
            trainable, non_trainable, x, training=True
        )
        return loss(y, y_pred), non_trainable

    grad_fn = jax.value_and_grad(compute_loss, has_aux=True)

    @jax.jit
    def train_step(state, x, y):
        trainable, non_trainable, opt_vars = state
        (loss_value, non_trainable), grads = grad_fn(trainable, non_trainable, x, y)
        trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
        return loss_value, (trainable, non_trainable, opt_vars)

    return train_step


class GuideLoop:
    """The guide's hand-written loop, as written there.

    With `devices=1` it is the same loop on one device, with no sharding.
    """

    def __init__(self, x, y, batch_size, devices=None):
        self.x, self.y, self.batch_size = x, y, batch_size
        keras.utils.set_random_seed(0)
        model = demo.get_model()
        optimizer = keras.optimizers.Adam(1e-3)
        loss = loss_fn()
        model.build((None, 28, 28, 1))
        optimizer.build(model.trainable_variables)
        train_step = guide_train_step(model, optimizer, loss)

        devices = np.array(jax.devices()[:devices])
        replicated = NamedSharding(Mesh(devices, ("_",)), P())
        self.data_sharding = NamedSharding(Mesh(devices, ("batch",)), P("batch"))
        self.state = (
            jax.device_put([v.value for v in model.trainable_variables], replicated),
            jax.device_put(
                [v.value for v in model.non_trainable_variables], replicated
            ),
            jax.device_put([v.value for v in optimizer.variables], replicated),
        )
        self.train_step = train_step
        # On simulated CPU devices, overlapping steps can deadlock XLA:CPU's
        # collectives (keras_parallel waits for each step there too, see
        # executors/jax.py), so the loop waits as well: same work, no hang.
        self.one_step_at_a_time = jax.devices()[0].platform == "cpu"

    def epochs(self, n):
        for _ in range(n):
            for start in range(0, len(self.x) - self.batch_size + 1, self.batch_size):
                xb = jax.device_put(
                    self.x[start : start + self.batch_size], self.data_sharding
                )
                yb = self.y[start : start + self.batch_size]
                loss_value, self.state = self.train_step(self.state, xb, yb)
                if self.one_step_at_a_time:
                    loss_value.block_until_ready()
        jax.block_until_ready(loss_value)


class KerasParallelFit:
    """`DistributedModel.fit` under `DataParallel()`; `distributed=False`: Keras's
    own `fit` on one device, with no keras_parallel in the way."""

    def __init__(self, x, y, batch_size, distributed=True):
        self.x, self.y, self.batch_size = x, y, batch_size
        keras.utils.set_random_seed(0)
        self.model = demo.get_model(Net)
        self.model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=loss_fn(),
            distribution=keras_parallel.DataParallel() if distributed else None,
        )

    def epochs(self, n):
        self.model.fit(
            self.x,
            self.y,
            batch_size=self.batch_size,
            epochs=n,
            shuffle=False,
            verbose=0,
        )


def timed(runner, epochs):
    start = time.perf_counter()
    runner.epochs(epochs)
    return time.perf_counter() - start


def speed(batch_size, rounds, epochs):
    x, y = data(batch_size * 16 if batch_size >= 512 else 4096)
    runners = {
        "loop": GuideLoop(x, y, batch_size),
        "fit": KerasParallelFit(x, y, batch_size),
        # One device, no keras_parallel: what Keras's own fit costs over the
        # guide's loop, which is not ours to cut.
        "loop_1": GuideLoop(x, y, batch_size, devices=1),
        "keras_1": KerasParallelFit(x, y, batch_size, distributed=False),
    }
    for runner in runners.values():
        runner.epochs(1)  # compile
    pairs = (("fit", "loop"), ("keras_1", "loop_1"))
    times = {name: [] for name in runners}
    ratios = {pair: [] for pair in pairs}
    for round_index in range(rounds):
        for pair in pairs:
            # A B B A, with A and B swapped every other round: the machine's
            # drift within a round cancels, and neither runner always goes
            # first or always follows the other (whose after-effects, caches,
            # allocator, XLA's threads, it would otherwise inherit).
            a, b = pair if round_index % 2 else pair[::-1]
            run = {a: 0.0, b: 0.0}
            for name in (a, b, b, a):
                seconds = timed(runners[name], epochs) / (epochs * len(x))
                times[name].append(seconds)
                run[name] += seconds
            ratios[pair].append(run[pair[0]] / run[pair[1]])
    median = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    ratio = statistics.median(ratios[pairs[0]])
    keras_ratio = statistics.median(ratios[pairs[1]])
    print(
        f"batch {batch_size:4d}: loop {median['loop']:7.1f} us/sample, fit "
        f"{median['fit']:7.1f} us/sample, ratio fit/loop {ratio:.3f} (rounds "
        f"{min(ratios[pairs[0]]):.3f} to {max(ratios[pairs[0]]):.3f})  |  one "
        f"device, no keras_parallel: loop {median['loop_1']:7.1f}, Keras fit "
        f"{median['keras_1']:7.1f}, ratio {keras_ratio:.3f}"
    )
    return ratio


def memory():
    keras.backend.clear_session()  # canonical layer names for the keys below
    mesh = keras.distribution.DeviceMesh((1, 8), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["conv2d_1/kernel"] = (None, None, None, "model")
    layout_map["large_k/kernel"] = (None, None, None, "model")
    layout_map["dense/kernel"] = (None, "model")
    layout_map["dense_1/kernel"] = ("model", None)
    model = demo.get_model(Net)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=loss_fn(),
        distribution=keras.distribution.ModelParallel(layout_map=layout_map),
    )
    x, y = data(64)
    model.fit(x, y, batch_size=64, verbose=0)
    plan = binding_of(model).plan
    kinds = ("model", "optimizer")
    planned = [v for v in plan.variables if v.kind in kinds]
    total = sum(v.bytes_total for v in planned)
    replicated = sum(v.bytes_total for v in planned if set(v.axes) <= {None})
    bound = (total - replicated) / 8 + replicated
    reported = plan.bytes_per_device(kinds)
    variables = list(model.variables) + list(model.optimizer.variables)
    device0 = jax.devices()[0]
    measured = sum(
        s.data.nbytes
        for v in variables
        for s in v.value.addressable_shards
        if s.device == device0
    )
    print(
        f"ModelParallel (1, 8): per device {reported} B reported by describe(), "
        f"{measured} B in device 0's shards; total {total} B; bound "
        f"1/8 of sharded + replicated = {bound:.0f} B; per device / total = "
        f"{reported / total:.3f}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 512])
    args = parser.parse_args()
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{len(jax.devices())} {jax.devices()[0].platform} devices, "
        f"jax {jax.__version__}, keras {keras.__version__}"
    )
    for batch_size in args.batches:
        speed(batch_size, args.rounds, args.epochs)
    memory()


if __name__ == "__main__":
    main()
