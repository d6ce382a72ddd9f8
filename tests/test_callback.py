"""ShardingCallback on JAX: the same effect as DistributedModel, for any model."""

import keras
import numpy as np
import pytest
import split_probe
from builders import dense_model, max_relative_difference, regression_data, weights_of

import keras_parallel

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="JAX executor tests; run them under tox -e jax",
)


def test_callback_fit_equals_one_device_and_leaves_no_global_state():
    x, y = regression_data(1003)
    reference = dense_model(keras.Model, batchnorm=True, probe=True)
    reference.compile(optimizer="sgd", loss="mse")
    expected = reference.fit(x, y, batch_size=64, shuffle=False, verbose=0)
    split_probe.clear()  # What one device saw: not a split.

    model = dense_model(keras.Model, batchnorm=True, probe=True)
    model.compile(optimizer="sgd", loss="mse")
    callback = keras_parallel.ShardingCallback(keras_parallel.DataParallel())
    history = model.fit(
        x, y, batch_size=64, shuffle=False, verbose=0, callbacks=[callback]
    )
    assert max_relative_difference(weights_of(reference), weights_of(model)) < 1e-4
    split_probe.assert_divided(split_probe.records(), 64, 8)
    assert set(history.history) == set(expected.history)
    np.testing.assert_allclose(
        history.history["loss"], expected.history["loss"], rtol=1e-5
    )
    assert len(model.get_layer("d1").kernel.value.sharding.device_set) == 8
    assert keras.distribution.distribution() is None


def test_callback_on_a_trained_model_with_model_parallel_and_validation():
    x, y = regression_data(256)
    model = dense_model(keras.Model)
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=64, verbose=0)  # trained on one device first
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d2/output"] = ("data", None)
    callback = keras_parallel.ShardingCallback(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )
    model.fit(
        x,
        y,
        batch_size=64,
        verbose=0,
        validation_data=(x[:64], y[:64]),
        callbacks=[callback],
    )
    from jax.sharding import PartitionSpec as P

    assert model.get_layer("d1").kernel.value.sharding.spec == P(None, "model")
    slots = [v for v in model.optimizer.variables if "/d1_kernel_" in v.path]
    assert all(v.value.sharding.spec == P(None, "model") for v in slots)
    assert keras.distribution.distribution() is None
    # evaluate and predict with the callback too.
    assert np.isfinite(model.evaluate(x, y, verbose=0, callbacks=[callback]))
    assert model.predict(x, verbose=0, callbacks=[callback]).shape == (256, 8)
    assert keras.distribution.distribution() is None


def test_callback_refuses_bad_input_at_construction():
    with pytest.raises(ValueError, match="must be a keras.distribution.Distribution"):
        keras_parallel.ShardingCallback({"mesh": (8,)})


def test_callback_after_a_failed_fit_restores_on_close():
    x, y = regression_data(64)
    model = dense_model(keras.Model)
    model.compile(optimizer="sgd", loss="mse")
    callback = keras_parallel.ShardingCallback(keras_parallel.DataParallel())

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.fit(x, y, batch_size=32, verbose=0, callbacks=[callback, Boom()])
    callback.close()
    assert keras.distribution.distribution() is None


def test_describe_finds_the_plan_the_callback_applied():
    x, y = regression_data(64)
    model = dense_model(keras.Model)
    model.compile(optimizer="sgd", loss="mse")
    callback = keras_parallel.ShardingCallback(keras_parallel.DataParallel())
    model.fit(x, y, batch_size=32, verbose=0, callbacks=[callback])
    text = keras_parallel.describe(model)
    assert "Mesh: batch=8 (8 devices" in text and "d1/kernel" in text


def test_callbacks_after_it_end_their_run_under_the_distribution():
    # The run ends after the last callback's end hook, not at this one's:
    # a callback listed after it (the progress bar, a user's) still ends
    # under the distribution.
    seen = {}

    class Later(keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            seen["train"] = keras.distribution.distribution()

        def on_test_end(self, logs=None):
            seen["test"] = keras.distribution.distribution()

        def on_predict_end(self, logs=None):
            seen["predict"] = keras.distribution.distribution()

    x, y = regression_data(256)
    model = dense_model(keras.Model)
    model.compile(optimizer="sgd", loss="mse")
    callbacks = [
        keras_parallel.ShardingCallback(keras_parallel.DataParallel()),
        Later(),
    ]
    model.fit(x, y, batch_size=64, verbose=0, callbacks=callbacks)
    model.evaluate(x, y, batch_size=64, verbose=0, callbacks=callbacks)
    model.predict(x, batch_size=64, verbose=0, callbacks=callbacks)
    assert set(seen) == {"train", "test", "predict"}
    assert all(d is not None for d in seen.values()), seen
    assert keras.distribution.distribution() is None
