"""JAX `shard=`: per-device bytes of the state, and step time, side by side.

An MLP of four 1024 x 1024 hidden layers (4.2 M parameters, 16 MiB; Adam's
two slots add 32 MiB) on 8 simulated CPU devices, trained by `fit` with
`keras_parallel.DataParallel()`, `DataParallel(shard="full")` and
`DataParallel(shard="optimizer")`. For each it prints:

- the bytes of model + optimizer variables one device holds, as
  `describe()` plans them and as the arrays' shards on device 0 confirm,
  against the target: 1/8 of the replicated state plus the largest
  variable that is gathered whole inside the step;
- the compiled step's own `memory_analysis()` (per device: arguments,
  outputs, temporaries);
- time per step, interleaved round by round (A B C C B A), and the median
  ratio of each mode to plain DataParallel.

Run: `python benchmarks/bench_jax_sharding.py [--rounds 5] [--steps 10]`.
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

import keras_parallel  # noqa: E402
from keras_parallel.backends.jax import batches  # noqa: E402
from keras_parallel.keras_seam.model_state import binding_of

MODES = (None, "full", "optimizer")
WIDTH = 1024
BATCH = 256


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def build(mode):
    keras.utils.set_random_seed(1)
    distribution = keras_parallel.DataParallel(shard=mode)
    with distribution.scope():
        inputs = keras.Input((WIDTH,))
        x = inputs
        for index in range(4):
            x = keras.layers.Dense(WIDTH, activation="relu", name=f"h{index}")(x)
        model = Net(inputs, keras.layers.Dense(16, name="out")(x))
    model.compile(optimizer="adam", loss="mse", distribution=distribution)
    return model


def held_on_device_0(model):
    device = jax.devices()[0]
    total = 0
    for variable in model.variables + model.optimizer.variables:
        for shard in variable.value.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total


def compiled_memory(model, x, y):
    """The compiled train step's `memory_analysis()` (one device's)."""
    calls = []
    original = batches.jit_splitting_batches

    def recording(function, *args, **kwargs):
        compiled = original(function, *args, **kwargs)

        def call(*step_args):
            calls[:] = [(compiled, step_args)]  # Holds one step's state only.
            return compiled(*step_args)

        return call

    batches.jit_splitting_batches = recording
    try:
        model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)
    finally:
        batches.jit_splitting_batches = original
    compiled, args = calls.pop()
    # The next `fit` makes its step again, unrecorded.
    model.train_function = None
    return compiled.lower(*args).compile().memory_analysis()


def mib(n):
    return f"{n / 2**20:.2f} MiB"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    print(
        f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}, "
        f"keras {keras.__version__}, {len(jax.devices())} devices"
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * args.steps, WIDTH)).astype("float32")
    y = rng.normal(size=(BATCH * args.steps, 16)).astype("float32")
    models = {}
    for mode in MODES:
        model = build(mode)
        memory = compiled_memory(model, x, y)
        plan = binding_of(model).plan
        replicated = plan.bytes_total()
        largest = max(v.bytes_total for v in plan.variables if v.kind == "model")
        target = replicated / 8 + largest
        print(
            f"shard={mode!s:9}  state per device: planned {mib(plan.bytes_per_device())}"
            f", held on device 0 {mib(held_on_device_0(model))} of "
            f"{mib(replicated)} replicated (target <= {mib(target)}: 1/8 + the "
            f"largest variable, {mib(largest)})"
        )
        if memory is not None:
            print(
                f"                 compiled step per device: arguments "
                f"{mib(memory.argument_size_in_bytes)}, outputs "
                f"{mib(memory.output_size_in_bytes)}, temporaries "
                f"{mib(memory.temp_size_in_bytes)}"
            )
        models[mode] = model
    times = {mode: [] for mode in MODES}
    for index in range(args.rounds):
        order = list(MODES) + list(reversed(MODES))
        if index % 2:
            order = order[::-1]
        spent = dict.fromkeys(MODES, 0.0)
        for mode in order:
            start = time.perf_counter()
            models[mode].fit(x, y, batch_size=BATCH, verbose=0, shuffle=False)
            spent[mode] += time.perf_counter() - start
        for mode in MODES:
            times[mode].append(spent[mode] / (2 * args.steps))
    base = times[None]
    for mode in MODES:
        ratios = [t / b for t, b in zip(times[mode], base, strict=True)]
        print(
            f"shard={mode!s:9}  {statistics.median(times[mode]) * 1e3:.1f} ms/step"
            f"  / DataParallel(): {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f} to {max(ratios):.3f})"
        )


if __name__ == "__main__":
    main()
