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
- the candidates' table.

Usage:

    python benchmarks/bench_auto.py [--rounds 3]
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


def _budget(build, x, y):
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
    args = parser.parse_args()
    for name, build, data in (("MLP", _mlp, _mlp_data), ("Llama", _llama, _llama_data)):
        x, y = data()
        budget = _budget(build, x, y)
        by_auto, by_hand = [], []
        chosen = None
        for _ in range(args.rounds):
            chooser = keras_parallel.Auto(device_memory=budget, headroom=0)
            model = _compiled(build, chooser)
            by_auto.append(seconds_to_first_batch(model, x, y))
            chosen = chooser.choice
            by_hand.append(
                seconds_to_first_batch(
                    _compiled(build, chosen.chosen.distribution), x, y
                )
            )
        measured = _measured_peak(_compiled(build, chosen.chosen.distribution), x, y)
        predicted = chosen.chosen.bytes_per_device
        print(f"== {name}")
        print(chosen.table())
        print(
            f"fit to first batch: Auto {statistics.median(by_auto):.2f} s, "
            f"{chosen.chosen.name} by hand {statistics.median(by_hand):.2f} s "
            f"(choosing: {statistics.median(by_auto) - statistics.median(by_hand):.2f} s)"
        )
        print(
            f"predicted {predicted} bytes/device, measured {measured}: "
            f"error {100 * (predicted - measured) / measured:+.1f} %"
        )


if __name__ == "__main__":
    main()
