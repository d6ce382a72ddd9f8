"""The JAX executor's step wrapper on simulated CPU devices.

On several CPU devices each step must have finished on every device before
`fit` may dispatch the next one (overlapping steps can deadlock XLA:CPU's
collectives), and the wrapper must hand Keras the step's outputs unchanged.
"""

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX executor; run under tox -e jax"
)


def _step_over_eight_devices():
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from keras_parallel.distribution import DataParallel

    distribution = DataParallel()
    mesh = distribution.device_mesh.backend_mesh
    batch = jax.device_put(
        np.arange(64 * 32, dtype="float32").reshape(64, 32),
        NamedSharding(mesh, P("batch")),
    )
    state = [jax.device_put(np.ones((32, 32), "float32"), NamedSharding(mesh, P()))]

    @jax.jit
    def step(state, x):
        # A matmul chain and a mean over the split batch: a collective.
        h = x
        for _ in range(20):
            h = jax.numpy.tanh(h @ state[0])
        loss = h.mean()
        return {"loss": loss}, [state[0] - 1e-3 * loss]

    return distribution, step, state, batch


def test_cpu_step_returns_once_every_device_has_finished():
    from keras_parallel.backends.jax.executor import JaxExecutor

    distribution, step, state, batch = _step_over_eight_devices()
    wrapped = JaxExecutor(distribution).wrap_step(step)
    assert wrapped is not step
    for _ in range(5):
        logs, state = wrapped(state, batch)
        for array in (logs["loss"], state[0]):
            assert len(array.addressable_shards) == 8
            assert array.is_ready()


def test_step_outputs_are_handed_back_unchanged():
    from keras_parallel.backends.jax.executor import JaxExecutor

    distribution, step, state, batch = _step_over_eight_devices()
    expected_logs, expected_state = step(state, batch)
    logs, new_state = JaxExecutor(distribution).wrap_step(step)(state, batch)
    np.testing.assert_array_equal(logs["loss"], expected_logs["loss"])
    np.testing.assert_array_equal(new_state[0], expected_state[0])
    assert new_state[0].sharding == expected_state[0].sharding


# ------------------------------------------- batches the devices do not divide
def test_a_batch_the_devices_do_not_divide_is_split_inside_the_step():
    # A NamedSharding cannot place 100 rows over 8 devices, so the batch
    # arrives whole on every device; the compiled step must still compute
    # 13 rows per device (100 / 8, rounded up), and the same result.
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from keras_parallel.backends.jax.batches import jit_splitting_batches
    from keras_parallel.distribution import DataParallel

    mesh = DataParallel().device_mesh.backend_mesh
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 16)).astype("float32")
    y = rng.normal(size=(100, 32)).astype("float32")
    kernel = rng.normal(size=(16, 32)).astype("float32")

    def step(state, data):
        x, y = data
        h = jax.numpy.tanh(x @ state)
        # Batch statistics, as BatchNorm takes: padding would change them.
        h = (h - h.mean(0)) / jax.numpy.sqrt(h.var(0) + 1e-3)
        return jax.numpy.mean((h - y) ** 2), state

    whole = jax.device_put((x, y), NamedSharding(mesh, P()))
    compiled = jit_splitting_batches(
        step,
        previous=jax.jit,
        batch_sharding=NamedSharding(mesh, P("batch")),
        donate=False,
    )
    text = compiled.lower(kernel, whole).compile().as_text()
    products = [line for line in text.splitlines() if " dot(" in line]
    assert products and all("f32[13,32]" in line for line in products), products
    loss, _ = compiled(kernel, whole)
    expected, _ = jax.jit(step)(kernel, (x, y))
    np.testing.assert_allclose(loss, expected, rtol=1e-6)


def test_fit_splits_a_batch_size_the_devices_do_not_divide(capsys):
    # batch_size=100 over 8 devices: every step is split (13 rows per
    # device), as the printed plan says, and trains as one device does,
    # BatchNorm included. 343 samples leave a last batch of 43.
    import split_probe
    from builders import (
        dense_model,
        max_relative_difference,
        regression_data,
        weights_of,
    )

    import keras_parallel

    class Net(keras_parallel.DistributedModel, keras.Model):
        pass

    x, y = regression_data(343)
    histories, weights, predictions = [], [], []
    for model_class, distribution in (
        (keras.Model, {}),
        (Net, {"distribution": keras_parallel.DataParallel()}),
    ):
        model = dense_model(model_class, batchnorm=True, probe=True)
        model.compile(optimizer="sgd", loss="mse", **distribution)
        split_probe.clear()  # Only the distributed model's steps are checked.
        history = model.fit(x, y, batch_size=100, shuffle=False, verbose=2)
        histories.append(history.history["loss"])
        weights.append(weights_of(model))
        predictions.append(model.predict(x, batch_size=100, verbose=0))
    split_probe.assert_divided(split_probe.records(), 100, 8)
    assert (100, 13) in split_probe.records()
    assert "Batch: split 8 ways along 'batch'" in capsys.readouterr().out
    assert max_relative_difference(weights[0], weights[1]) < 1e-4
    np.testing.assert_allclose(histories[1], histories[0], rtol=1e-5)
    np.testing.assert_allclose(predictions[1], predictions[0], atol=1e-5)
