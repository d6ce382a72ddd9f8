"""Bad input through `compile`: a clear error, nothing half-applied.

Each bad distribution raises a `ValueError` naming what to change, and the
model is left on one device with its weights unchanged, still trainable.
"""

import keras
import numpy as np
import pytest
from builders import dense_model, regression_data, weights_of

import keras_parallel
from keras_parallel.errors import ShardingError
from keras_parallel.keras_seam.model_state import binding_of
from keras_parallel.run.binding import Binding


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def test_wrong_type_is_refused_on_every_backend():
    with pytest.raises(
        ShardingError, match="`distribution` must be a keras.distribution.Distribution"
    ):
        Binding("data_parallel")
    assert issubclass(ShardingError, ValueError)


jax_only = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX executor; run under tox -e jax"
)


def _mesh(shape=(4, 2), devices=None):
    return keras.distribution.DeviceMesh(shape, ["data", "model"], devices=devices)


def _model_parallel(entries, shape=(4, 2), batch_dim_name="data", devices=None):
    layout_map = keras.distribution.LayoutMap(_mesh(shape, devices))
    for key, axes in entries.items():
        layout_map[key] = axes
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name=batch_dim_name
    )


def _bad_distributions():
    other = lambda: keras.distribution.DeviceMesh(  # noqa: E731
        (8,), ["shard"], devices=keras.distribution.list_devices()
    )

    def axis_not_in_mesh():
        layout_map = keras.distribution.LayoutMap(_mesh())
        layout_map["d1/kernel"] = keras.distribution.TensorLayout(
            (None, "shard"), other()
        )
        return keras.distribution.ModelParallel(layout_map=layout_map)

    return {
        "wrong type": (lambda: "data", "must be a keras.distribution.Distribution"),
        "too many devices": (
            lambda: keras.distribution.DataParallel(
                devices=[f"cpu:{i}" for i in range(16)]
            ),
            "asks for 16 devices",
        ),
        "axis not in mesh": (axis_not_in_mesh, "not a mesh axis"),
        "rank mismatch": (
            lambda: _model_parallel({"d1/kernel": ("model",)}),
            "has rank 1, but variable 'd1/kernel' has rank 2",
        ),
        "indivisible": (
            lambda: _model_parallel({"d2/kernel": (None, "model")}, shape=(1, 8)),
            r"dimension 1 \(size 6\) is not divisible",
        ),
        "two keys": (
            lambda: _model_parallel(
                {"d1/.*": (None, "model"), ".*/kernel": (None, None)}
            ),
            "matched by 2 LayoutMap keys",
        ),
        "batch axis": (
            lambda: _model_parallel({}, batch_dim_name="rows"),
            "batch_dim_name='rows'",
        ),
    }


@jax_only
@pytest.mark.parametrize("case", sorted(_bad_distributions()))
def test_bad_distribution_leaves_the_model_on_one_device(case):
    factory, message = _bad_distributions()[case]
    x, y = regression_data(64)
    model = _six_wide() if case == "indivisible" else dense_model(Net)
    y = y[:, : model.output.shape[-1]]
    before = weights_of(model)
    with pytest.raises(ValueError, match=message):
        model.compile(optimizer="sgd", loss="mse", distribution=factory())
    assert model.distribution is None
    for a, b in zip(before, weights_of(model), strict=True):
        np.testing.assert_array_equal(a, b)
    assert all(len(v.value.sharding.device_set) == 1 for v in model.weights)
    assert keras.distribution.distribution() is None
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=32, verbose=0)


def _six_wide():
    # A (32, 6) d2 kernel: 6 columns do not split over a model axis of 8.
    keras.utils.set_random_seed(1)
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, name="d1")(inputs)
    outputs = keras.layers.Dense(6, name="d2")(x)
    return Net(inputs=inputs, outputs=outputs)


@jax_only
def test_bad_distribution_after_a_good_one_returns_to_one_device():
    x, y = regression_data(64)
    model = dense_model(Net)
    model.compile(
        optimizer="sgd", loss="mse", distribution=keras_parallel.DataParallel()
    )
    model.fit(x, y, batch_size=32, verbose=0)
    before = weights_of(model)
    with pytest.raises(ValueError, match="has rank 1"):
        model.compile(
            optimizer="sgd",
            loss="mse",
            distribution=_model_parallel({"d1/kernel": ("model",)}),
        )
    assert model.distribution is None
    for a, b in zip(before, weights_of(model), strict=True):
        np.testing.assert_array_equal(a, b)
    model.fit(x, y, batch_size=32, verbose=0)


def test_an_error_inside_fit_reaches_the_executor_scope_as_an_error(monkeypatch):
    # The scope's failure path runs no collective; its success path may
    # (torch syncs BatchNorm statistics), which would hang a failing rank.
    import contextlib

    model = dense_model(Net)
    model.compile(
        optimizer="sgd", loss="mse", distribution=keras_parallel.DataParallel()
    )
    seen = []

    @contextlib.contextmanager
    def recording_scope(model):
        try:
            yield
        except BaseException as error:
            seen.append(error)
            raise
        seen.append("ended normally")

    monkeypatch.setattr(binding_of(model).executor, "scope", recording_scope)

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise ValueError("boom")

    x, y = regression_data(256)
    with pytest.raises(ValueError, match="boom"):
        model.fit(x, y, batch_size=64, callbacks=[Boom()], verbose=0)
    assert len(seen) == 1 and isinstance(seen[0], ValueError)
    model.fit(x, y, batch_size=64, verbose=0)
    assert seen[1] == "ended normally"
    assert binding_of(model).run is None


@jax_only
def test_a_plan_scope_that_fails_to_enter_leaves_nothing_installed(monkeypatch):
    from keras_parallel.keras_seam.keras_compat import EpochIterator

    x, y = regression_data(64)
    model = dense_model(Net)
    model.compile(
        optimizer="sgd", loss="mse", distribution=keras_parallel.DataParallel()
    )
    keras_init = vars(EpochIterator)["__init__"]

    def failing(model):
        raise RuntimeError("planned scope failed")

    monkeypatch.setattr(binding_of(model).executor, "planned_scope", failing)
    with pytest.raises(RuntimeError, match="planned scope failed"):
        model.fit(x, y, batch_size=64, verbose=0)
    # The entry point's own scope (exact backups) was left as well.
    assert vars(EpochIterator)["__init__"] is keras_init
    assert binding_of(model).run is None
    assert keras.distribution.distribution() is None
