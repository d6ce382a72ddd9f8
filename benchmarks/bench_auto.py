"""What `Auto` costs, and how close its prediction is (JAX, 8 CPU devices).

For an MLP and a small KerasHub Llama (the layout tests' models), with the
budget of the first candidate after plain data parallelism that needs less:

- the seconds from `fit`'s call to its first train batch, with
  `Auto(device_memory=budget)` and with the chosen distribution given by
  hand, interleaved `--rounds` times (medians), and their difference: the
  choosing;
- the chosen candidate's predicted bytes per device against XLA's analysis
  of the step `fit` compiled and ran (`memory_analysis().peak_memory_in_bytes`),
  and the relative error;
- the first step's seconds (its compilation and run), with `Auto` and by
  hand: whether the step `Auto` compiled to predict is compiled again;
- the candidates' table.

`--large` adds an MLP of 107 M parameters (256 -> 5120 x 5 -> 256), with
the budget of `DataParallel(shard="full")`, one round (its state takes
about 1.3 GB of host memory per copy).

Usage:

    python benchmarks/bench_auto.py [--rounds 3] [--large]
"""

import argparse
import os
import statistics
import sys

os.environ["KERAS_BACKEND"] = "jax"
if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_parallel  # noqa: E402
from keras_parallel.auto import choice as auto_choice  # noqa: E402
from keras_parallel.backends import executor_class  # noqa: E402
from keras_parallel.backends.jax import batches  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from first_batch_timing import seconds_to_first_batch  # noqa: E402


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def _mlp():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((256,))
    x = keras.layers.Dense(2048, activation="relu", name="d1")(inputs)
    x = keras.layers.Dense(2048, activation="relu", name="d2")(x)
    return Net(inputs, keras.layers.Dense(256, name="d3")(x))


def _mlp_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 256)).astype("float32")
    return x, rng.normal(size=(256, 256)).astype("float32")


def _large_mlp():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((256,))
    x = inputs
    for index in range(5):
        x = keras.layers.Dense(5120, activation="relu", name=f"d{index}")(x)
    return Net(inputs, keras.layers.Dense(256, name="out")(x))


def _llama():
    import hub_models

    return hub_models.model("llama", model_class=Net)


def _llama_data():
    import hub_models

    return hub_models.batch("llama", 64)


def _compiled(build, distribution):
    model = build()
    model.compile(optimizer="adam", loss="mse", distribution=distribution)
    return model


def _budget(build, x, y, name=None):
    model = _compiled(build, keras_parallel.DataParallel())
    model.optimizer.build(model.trainable_variables)
    needs = auto_choice.choose(
        keras_parallel.Auto(device_memory=2**50),
        model,
        (
            x[:64] if not isinstance(x, dict) else {k: v[:64] for k, v in x.items()},
            y[:64],
            None,
        ),
        executor_class(),
        keras.distribution.list_devices(),
        predict_all=True,
    ).candidates
    if name is not None:
        return next(c for c in needs if c.name == name).bytes_per_device
    second = next(
        c for c in needs[1:] if c.bytes_per_device < needs[0].bytes_per_device
    )
    return second.bytes_per_device


def _measured_peak(model, x, y):
    """XLA's peak of the train step `fit` compiled for `model`."""
    recorded = []
    original = batches.jit_splitting_batches

    def recording(function, *args, **kwargs):
        jitted = original(function, *args, **kwargs)

        def call(*step_args):
            recorded[:] = [(jitted, step_args)]
            return jitted(*step_args)

        return call

    batches.jit_splitting_batches = recording
    try:
        model.fit(x, y, batch_size=64, epochs=1, steps_per_epoch=1, verbose=0)
    finally:
        batches.jit_splitting_batches = original
    jitted, args = recorded[-1]
    return jitted.lower(*args).compile().memory_analysis().peak_memory_in_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--large", action="store_true")
    args = parser.parse_args()
    models = [
        ("MLP", _mlp, _mlp_data, None, args.rounds),
        ("Llama", _llama, _llama_data, None, args.rounds),
    ]
    if args.large:
        full = 'DataParallel(shard="full")'
        models.append(("MLP, 107 M parameters", _large_mlp, _mlp_data, full, 1))
    for name, build, data, candidate, rounds in models:
        x, y = data()
        budget = _budget(build, x, y, candidate)
        by_auto, by_hand = [], []
        chosen = None
        for _ in range(rounds):
            chooser = keras_parallel.Auto(device_memory=budget, headroom=0)
            model = _compiled(build, chooser)
            by_auto.append(seconds_to_first_batch(model, x, y, with_step=True))
            chosen = chooser.choice
            model = _compiled(build, chosen.chosen.distribution)
            by_hand.append(seconds_to_first_batch(model, x, y, with_step=True))
        measured = _measured_peak(_compiled(build, chosen.chosen.distribution), x, y)
        predicted = chosen.chosen.bytes_per_device
        parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        auto_first, auto_step = (
            statistics.median(t) for t in zip(*by_auto, strict=True)
        )
        hand_first, hand_step = (
            statistics.median(t) for t in zip(*by_hand, strict=True)
        )
        print(f"== {name} ({parameters:,} parameters)")
        print(chosen.table())
        print(
            f"fit to first batch: Auto {auto_first:.2f} s, "
            f"{chosen.chosen.name} by hand {hand_first:.2f} s "
            f"(choosing: {auto_first - hand_first:.2f} s)"
        )
        print(
            f"first step (compiled and run): Auto {auto_step:.2f} s, "
            f"by hand {hand_step:.2f} s"
        )
        print(
            f"predicted {predicted} bytes/device, measured {measured}: "
            f"error {100 * (predicted - measured) / measured:+.1f} %"
        )


if __name__ == "__main__":
    main()
