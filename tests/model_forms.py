"""Every form a Keras model takes, each with a `BatchProbe` first.

Shared by the in-process first-call tests (JAX, TensorFlow) and the torch
ranks (`first_call_run` is what each rank runs). Each builder returns a
fresh, unbuilt model unless the form is built by construction (functional,
Sequential with an `Input`).
"""

import os

import numpy as np
import split_probe

from keras_parallel.model import _ENTRY_POINTS as DISTRIBUTED_ENTRY_POINTS

FEATURES = 8
OUTPUTS = 4
#: The global batch every first call uses; every test's device count divides it.
BATCH = 16

FORMS = (
    "functional",
    "sequential_with_input",
    "sequential_without_input",
    "subclassed",
    "nested",
)
#: Every entry point `DistributedModel` distributes.
ENTRY_POINTS = DISTRIBUTED_ENTRY_POINTS
#: `*_on_batch` calls no callback: the callback door serves these.
CALLBACK_ENTRY_POINTS = ("fit", "evaluate", "predict")


def data(n=2 * BATCH):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = rng.normal(size=(n, OUTPUTS)).astype("float32")
    return x, y


def build(form, door):
    """A fresh model of `form` for `door` (`"mixin"` or `"callback"`)."""
    import keras

    import keras_parallel

    mixin = door == "mixin"
    functional_base = keras.Model
    sequential_base = keras.Sequential
    if mixin:

        class Net(keras_parallel.DistributedModel, keras.Model):
            pass

        class Seq(keras_parallel.DistributedModel, keras.Sequential):
            pass

        functional_base, sequential_base = Net, Seq

    class Subclassed(functional_base):
        def __init__(self, inner=None, **kwargs):
            super().__init__(**kwargs)
            self.inner = inner
            self.probe = split_probe.probe() if inner is None else None
            self.dense = keras.layers.Dense(OUTPUTS, name="d2")

        def call(self, x):
            x = self.inner(x) if self.inner is not None else self.probe(x)
            return self.dense(x)

    keras.utils.set_random_seed(1)
    if form == "functional":
        inputs = keras.Input((FEATURES,))
        x = split_probe.probe()(inputs)
        outputs = keras.layers.Dense(OUTPUTS, name="d2")(x)
        return functional_base(inputs=inputs, outputs=outputs)
    if form == "sequential_with_input":
        return sequential_base(
            [
                keras.Input((FEATURES,)),
                split_probe.probe(),
                keras.layers.Dense(OUTPUTS, name="d2"),
            ]
        )
    if form == "sequential_without_input":
        return sequential_base(
            [split_probe.probe(), keras.layers.Dense(OUTPUTS, name="d2")]
        )
    if form == "subclassed":
        return Subclassed()
    if form == "nested":
        # An unbuilt plain Sequential inside a subclassed model.
        inner = keras.Sequential(
            [split_probe.probe(), keras.layers.Dense(6, name="d1")], name="inner"
        )
        return Subclassed(inner=inner)
    raise ValueError(f"unknown model form. Received: {form!r}")


def first_call(form, door, entry_point, distribution):
    """Builds a fresh model and makes `entry_point` its first call.

    Returns:
        The probe's records of that call.
    """
    import keras

    import keras_parallel

    model = build(form, door)
    kwargs = {"distribution": distribution} if door == "mixin" else {}
    model.compile(optimizer="sgd", loss="mse", **kwargs)
    callbacks = []
    if door == "callback":
        callbacks = [keras_parallel.ShardingCallback(distribution)]
    x, y = data()
    split_probe.clear()
    if entry_point == "fit":
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=callbacks)
    elif entry_point == "evaluate":
        model.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=callbacks)
    elif entry_point == "predict":
        model.predict(x, batch_size=BATCH, verbose=0, callbacks=callbacks)
    elif entry_point == "train_on_batch":
        model.train_on_batch(x[:BATCH], y[:BATCH])
    elif entry_point == "test_on_batch":
        model.test_on_batch(x[:BATCH], y[:BATCH])
    elif entry_point == "predict_on_batch":
        model.predict_on_batch(x[:BATCH])
    recorded = split_probe.records()
    assert keras.distribution.distribution() is None
    return recorded


def cases():
    """Every `(form, door, entry_point)` combination."""
    return [
        (form, door, entry_point)
        for form in FORMS
        for door in ("mixin", "callback")
        for entry_point in (ENTRY_POINTS if door == "mixin" else CALLBACK_ENTRY_POINTS)
    ]


def first_call_run(selected, model_parallel=False):
    """A torch rank's part: every selected case's records on this rank.

    Args:
        selected: `(form, door, entry_point)` tuples.
        model_parallel: a `ModelParallel` over a `(world / 2, 2)` mesh,
            `d2`'s kernel split over the model axis (the batch is split
            `world / 2` ways); else `DataParallel()` (`world` ways).
    """
    import keras

    import keras_parallel

    results = []
    for form, door, entry_point in selected:
        if model_parallel:
            world = int(os.environ["WORLD_SIZE"])
            devices = keras_parallel.DataParallel().device_mesh.devices.ravel()
            mesh = keras.distribution.DeviceMesh(
                (world // 2, 2), ["batch", "model"], devices.tolist()
            )
            layout_map = keras.distribution.LayoutMap(mesh)
            layout_map[".*d2/kernel"] = (None, "model")
            distribution = keras.distribution.ModelParallel(
                layout_map=layout_map, batch_dim_name="batch"
            )
        else:
            distribution = keras_parallel.DataParallel()
        results.append(first_call(form, door, entry_point, distribution))
    return results
