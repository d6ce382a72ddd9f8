"""DistributedModel on JAX: same training as one device, on 8 devices.

The proof is equivalence (DESIGN.md): from the same initial weights, on the
same global batches, with SGD, the distributed weights equal single-device
training to float32 rounding, while the variables really span the devices.
"""

import keras
import numpy as np
import pytest
import split_probe
from builders import (
    dense_model,
    max_relative_difference,
    regression_data,
    sharding_ops,
    weights_of,
)

import keras_parallel
from keras_parallel.keras_seam.model_state import binding_of

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="JAX executor tests; run them under tox -e jax",
)

if keras.backend.backend() == "jax":
    import jax
    from jax.sharding import PartitionSpec as P


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def train(model, x, y, batch_size=64, epochs=1, optimizer="sgd", **compile_kwargs):
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0
    )
    return history


def single_device_weights(x, y, batchnorm=False, **kwargs):
    model = dense_model(keras.Model, batchnorm=batchnorm, probe=True)
    history = train(model, x, y, **kwargs)
    split_probe.clear()  # What one device saw: not a split.
    return weights_of(model), history


def assert_split(ways, batch_size=64):
    """Every step since the last `split_probe.clear()` split its batch."""
    split_probe.assert_divided(split_probe.records(), batch_size, ways)


def model_parallel(mesh_shape, output_key="d2/output"):
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)
    layout_map["d2/kernel"] = ("model", None)
    if output_key:
        layout_map[output_key] = ("data", None)
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="data"
    )


def test_eight_devices_are_simulated():
    assert len(jax.devices()) == 8


def test_data_parallel_one_step_equals_one_device_with_batchnorm():
    x, y = regression_data(64)
    expected, _ = single_device_weights(x, y, batchnorm=True)
    model = dense_model(Net, batchnorm=True, probe=True)
    train(model, x, y, distribution=keras_parallel.DataParallel())
    assert max_relative_difference(expected, weights_of(model)) < 1e-5
    assert_split(8)
    kernel = model.get_layer("d1").kernel.value
    assert len(kernel.sharding.device_set) == 8
    assert kernel.sharding.spec == P(None, None)


def test_data_parallel_ten_steps_equal_one_device():
    x, y = regression_data(640)
    expected, expected_history = single_device_weights(x, y)
    model = dense_model(Net, probe=True)
    history = train(model, x, y, distribution=keras_parallel.DataParallel())
    assert max_relative_difference(expected, weights_of(model)) < 1e-4
    assert_split(8)
    assert set(history.history) == set(expected_history.history)
    np.testing.assert_allclose(
        history.history["loss"], expected_history.history["loss"], rtol=1e-5
    )


def test_uneven_epoch_equals_one_device_with_batchnorm():
    # 1003 = 15 * 64 + 43: the last batch divides over neither 8 devices nor
    # a data axis of 4. Padding it would change the BatchNorm statistics.
    x, y = regression_data(1003)
    expected, _ = single_device_weights(x, y, batchnorm=True)
    model = dense_model(Net, batchnorm=True, probe=True)
    train(model, x, y, distribution=keras_parallel.DataParallel())
    assert max_relative_difference(expected, weights_of(model)) < 1e-4
    assert_split(8)
    split_probe.clear()
    mesh = keras.distribution.DeviceMesh((4, 2), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    model = dense_model(Net, batchnorm=True, probe=True)
    train(
        model,
        x,
        y,
        distribution=keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="data"
        ),
    )
    assert max_relative_difference(expected, weights_of(model)) < 1e-4
    # On a two-axis mesh the uneven last batch is computed whole (a padded
    # split gives gathers wrong gradients there); the others are split.
    split_probe.assert_divided(split_probe.records(), 64, 4, uneven_whole=True)


def embedding_model(cls):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,), dtype="int32")
    h = split_probe.probe()(inputs)
    h = keras.layers.Embedding(20, 8, name="embed")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    h = keras.layers.Dense(16, activation="relu", name="d1")(h)
    outputs = keras.layers.Dense(1, name="d2")(h)
    return cls(inputs=inputs, outputs=outputs)


@pytest.mark.parametrize("mesh_shape", [(4, 2), (2, 4)])
def test_embedding_on_a_two_axis_mesh_with_an_uneven_batch(mesh_shape):
    # 43 = 2 * 16 + 11: the last batch divides over no data axis. XLA's
    # padded split of it gave an Embedding (a gather) a wrong gradient on a
    # mesh with a second axis (2.5e-2 off after one epoch).
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, (43, 5)).astype("int32")
    y = rng.normal(size=(43, 1)).astype("float32")
    reference = embedding_model(keras.Model)
    train(reference, x, y, batch_size=16, epochs=2)
    split_probe.clear()
    model = embedding_model(Net)
    train(
        model,
        x,
        y,
        batch_size=16,
        epochs=2,
        distribution=model_parallel(mesh_shape, output_key=None),
    )
    assert max_relative_difference(weights_of(reference), weights_of(model)) < 1e-5
    # The full batches are split over the data axis; the uneven last one is
    # computed whole on a two-axis mesh (see `_split_rows`).
    ways = mesh_shape[0]
    split_probe.assert_divided(split_probe.records(), 16, ways, uneven_whole=True)


@pytest.mark.parametrize("mesh_shape", [(8, 1), (4, 2), (2, 4), (1, 8)])
def test_model_parallel_equals_one_device(mesh_shape):
    x, y = regression_data(640)
    expected, _ = single_device_weights(x, y, optimizer="adam")
    model = dense_model(Net, probe=True)
    train(model, x, y, optimizer="adam", distribution=model_parallel(mesh_shape))
    assert max_relative_difference(expected, weights_of(model)) < 1e-4
    assert_split(mesh_shape[0])  # Over the "data" axis.
    # The variables really are split as the LayoutMap says...
    kernel = model.get_layer("d1").kernel.value
    assert kernel.sharding.spec == P(None, "model")
    assert dict(kernel.sharding.mesh.shape) == {
        "data": mesh_shape[0],
        "model": mesh_shape[1],
    }
    shard_shapes = {s.data.shape for s in kernel.addressable_shards}
    assert shard_shapes == {(16, 32 // mesh_shape[1])}
    # ...and the optimizer slots follow their variable.
    slots = [v for v in model.optimizer.variables if "/d1_kernel_" in v.path]
    assert len(slots) == 2
    assert all(v.value.sharding.spec == P(None, "model") for v in slots)


def test_model_parallel_first_step_equals_one_device_with_batchnorm():
    x, y = regression_data(64)
    expected, _ = single_device_weights(x, y, batchnorm=True)
    model = dense_model(Net, batchnorm=True, probe=True)
    train(model, x, y, distribution=model_parallel((2, 4)))
    assert max_relative_difference(expected, weights_of(model)) < 1e-5
    assert_split(2)


def test_output_constraint_is_in_the_lowered_train_step():
    x, y = regression_data(64)
    constrained = dense_model(Net)
    train(constrained, x, y, distribution=model_parallel((4, 2)))
    free = dense_model(Net)
    train(free, x, y, distribution=model_parallel((4, 2), output_key=None))
    with_key = sharding_ops(constrained, x, y)
    without_key = sharding_ops(free, x, y)
    assert len(with_key) > len(without_key)
    # d2's (64, 8) output, split by rows over "data" (Shardy's notation).
    assert any(
        '[{"data"}, {}]' in line and "tensor<64x8xf32>" in line for line in with_key
    )


def test_nested_layer_output_key_by_path_suffix():
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.d1 = keras.layers.Dense(32, name="d1")
            self.d2 = keras.layers.Dense(8, name="d2")

        def call(self, x):
            return self.d2(self.d1(x))

    class Subclassed(keras_parallel.DistributedModel, keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.block = Block(name="block")

        def call(self, x):
            return self.block(x)

    model = Subclassed(name="net")
    model(np.zeros((2, 16), "float32"))
    mesh = keras.distribution.DeviceMesh((4, 2), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d2/output"] = ("data", None)
    layout_map[".*d1/kernel"] = (None, "model")
    model.compile(
        optimizer="sgd",
        loss="mse",
        distribution=keras.distribution.ModelParallel(layout_map=layout_map),
    )
    x, y = regression_data(64)
    model.fit(x, y, batch_size=32, verbose=0)
    plan = binding_of(model).plan
    assert [(o.key, o.path) for o in plan.outputs] == [
        ("d2/output", "net/block/d2/output")
    ]
    assert model.block.d1.kernel.value.sharding.spec == P(None, "model")


def test_subclassed_model_built_by_fit_is_distributed():
    class Subclassed(keras_parallel.DistributedModel, keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.d1 = keras.layers.Dense(32, name="d1")

        def call(self, x):
            return self.d1(x)

    model = Subclassed(name="sub")
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["sub/d1/kernel"] = (None, "model")
    model.compile(
        optimizer="sgd",
        loss="mse",
        distribution=keras.distribution.ModelParallel(layout_map=layout_map),
    )
    assert binding_of(model).plan is None  # not built: planned once fit builds it
    x, y = regression_data(64)
    model.fit(x, y[:, :1].repeat(32, axis=1), batch_size=32, verbose=0)
    assert model.d1.kernel.value.sharding.spec == P(None, "model")
    assert binding_of(model).plan is not None


def test_model_trained_before_the_distribution_continues_exactly():
    x, y = regression_data(128)
    reference = dense_model(keras.Model)
    train(reference, x, y, epochs=2)
    model = dense_model(Net, probe=True)
    train(model, x, y)  # one epoch on one device, optimizer built
    split_probe.clear()
    model.compile(
        optimizer=model.optimizer,
        loss="mse",
        distribution=keras_parallel.DataParallel(),
    )
    model.fit(x, y, batch_size=64, shuffle=False, verbose=0)
    assert max_relative_difference(weights_of(reference), weights_of(model)) < 1e-5
    assert_split(8)
    assert len(model.get_layer("d1").kernel.value.sharding.device_set) == 8


def test_no_global_distribution_left_behind():
    x, y = regression_data(64)
    model = dense_model(Net)
    train(model, x, y, distribution=keras_parallel.DataParallel())
    model.evaluate(x, y, verbose=0)
    model.predict(x, verbose=0)
    assert keras.distribution.distribution() is None
    plain = dense_model(keras.Model, name="plain")
    train(plain, x, y)
    assert len(plain.get_layer("d1").kernel.value.sharding.device_set) == 1


def test_evaluate_predict_and_on_batch_methods_match_one_device():
    x, y = regression_data(200)
    reference = dense_model(keras.Model)
    reference.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    model = dense_model(Net, probe=True)
    split_probe.clear()
    model.compile(
        optimizer="sgd",
        loss="mse",
        metrics=["mae"],
        distribution=model_parallel((4, 2)),
    )
    np.testing.assert_allclose(
        model.evaluate(x, y, batch_size=64, verbose=0),
        reference.evaluate(x, y, batch_size=64, verbose=0),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        model.predict(x, batch_size=64, verbose=0),
        reference.predict(x, batch_size=64, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        model.predict_on_batch(x[:64]),
        reference.predict_on_batch(x[:64]),
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        model.train_on_batch(x[:64], y[:64]),
        reference.train_on_batch(x[:64], y[:64]),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        model.test_on_batch(x[:64], y[:64]),
        reference.test_on_batch(x[:64], y[:64]),
        rtol=1e-5,
    )
    assert max_relative_difference(weights_of(reference), weights_of(model)) < 1e-5
    assert_split(4)  # The "data" axis of (4, 2), in every entry point.
    assert keras.distribution.distribution() is None


def test_validation_data_inside_fit():
    x, y = regression_data(256)
    reference = dense_model(keras.Model)
    reference.compile(optimizer="sgd", loss="mse")
    expected = reference.fit(
        x,
        y,
        batch_size=64,
        validation_data=(x[:100], y[:100]),
        shuffle=False,
        verbose=0,
    )
    model = dense_model(Net, probe=True)
    split_probe.clear()
    model.compile(
        optimizer="sgd", loss="mse", distribution=keras_parallel.DataParallel()
    )
    history = model.fit(
        x,
        y,
        batch_size=64,
        validation_data=(x[:100], y[:100]),
        shuffle=False,
        verbose=0,
    )
    assert_split(8)
    assert set(history.history) == set(expected.history)
    np.testing.assert_allclose(
        history.history["val_loss"], expected.history["val_loss"], rtol=1e-5
    )


def test_compile_without_distribution_returns_to_one_device():
    x, y = regression_data(64)
    model = dense_model(Net)
    train(model, x, y, distribution=keras_parallel.DataParallel())
    assert model.distribution is not None
    train(model, x, y, distribution=None)
    assert model.distribution is None
    assert len(model.get_layer("d1").kernel.value.sharding.device_set) == 1


def test_fit_prints_the_plan_once_when_verbose(capsys):
    x, y = regression_data(64)
    model = dense_model(Net)
    model.compile(
        optimizer="sgd", loss="mse", distribution=keras_parallel.DataParallel()
    )
    model.fit(x, y, batch_size=32, verbose=2)
    model.fit(x, y, batch_size=32, verbose=2)
    out = capsys.readouterr().out
    assert out.count("Sharding plan of 'net'") == 1
    assert out.count("Backend: jax, 8 devices in 1 process") == 1
    assert "d1/kernel" in out


def test_step_state_is_not_walked_for_tracking():
    # Keras sets `_jax_state` after every step; walking it for variables to
    # track cost ~1 ms a step. It holds arrays only.
    model = dense_model(Net)

    def refuse(value):
        raise AssertionError("tracked")

    model._tracker.track = refuse
    model._jax_state = {"trainable_variables": [np.zeros(2)]}
    assert model._jax_state["trainable_variables"][0].shape == (2,)


def test_a_global_distribution_the_user_set_is_restored_after_fit():
    # Entry points install the plan's distribution for their duration only;
    # what the user had set before is put back, not dropped.
    x, y = regression_data(64)
    mine = keras.distribution.DataParallel(
        devices=keras.distribution.list_devices()[:2]
    )
    keras.distribution.set_distribution(mine)
    try:
        model = dense_model(Net)
        model.compile(
            optimizer="sgd", loss="mse", distribution=keras_parallel.DataParallel()
        )
        model.fit(x, y, batch_size=32, verbose=0)
        assert keras.distribution.distribution() is mine
        model.predict(x, verbose=0)
        assert keras.distribution.distribution() is mine
    finally:
        keras.distribution.set_distribution(None)
