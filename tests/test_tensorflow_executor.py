"""The TensorFlow executor's contract: devices, refusal, apply and release."""

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="TensorFlow executor tests run in the tensorflow tox env",
)

if keras.backend.backend() == "tensorflow":
    import tensorflow as tf
    import tf_devices  # conftest split the CPU into logical devices

import split_probe  # noqa: E402

import keras_parallel  # noqa: E402
from keras_parallel.errors import ShardingError  # noqa: E402


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def _model(cls=Net, probe=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    x = split_probe.probe()(inputs) if probe else inputs
    x = keras.layers.Dense(8, activation="tanh", name="d1")(x)
    outputs = keras.layers.Dense(3, name="d2")(x)
    return cls(inputs=inputs, outputs=outputs)


def _compile(model, distribution=None):
    kwargs = {} if distribution is None else {"distribution": distribution}
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss="mse",
        metrics=["mae"],
        **kwargs,
    )


def _data(n=40):
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(n, 6)).astype("float32"),
        rng.normal(size=(n, 3)).astype("float32"),
    )


def _replica_devices(variable):
    value = variable._value
    if not isinstance(value, tf.distribute.DistributedValues):
        return None
    return sorted(v.device.split("device:")[-1].lower() for v in value.values)


def test_data_parallel_spans_all_logical_cpus():
    if tf.config.list_logical_devices("GPU"):
        pytest.skip("with GPUs, DataParallel() spans the GPUs")
    distribution = keras_parallel.DataParallel()
    assert list(distribution.device_mesh.devices) == tf_devices.devices(4)
    executor_cls = keras_parallel.backends.executor_class()
    assert executor_cls.list_devices() == tf_devices.devices(4)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("cpu:1", "cpu:1"),
        ("CPU:1", "cpu:1"),
        ("/device:CPU:1", "cpu:1"),
        ("/job:localhost/replica:0/task:0/device:GPU:3", "gpu:3"),
    ],
)
def test_device_names_normalize(name, expected):
    from keras_parallel.backends.tensorflow.executor import TensorFlowExecutor

    executor = TensorFlowExecutor(
        keras_parallel.DataParallel(devices=tf_devices.devices(2))
    )
    assert executor.device_names([name]) == [expected]


def test_model_parallel_is_refused_naming_the_backends_that_have_it():
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ["batch", "model"], tf_devices.devices(4)
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    model = _model()
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(
        ShardingError, match="available on the JAX and torch backends"
    ) as info:
        _compile(model, distribution)
    assert "Received: distribution=ModelParallel" in str(info.value)
    with pytest.raises(ShardingError, match="available on the JAX and torch backends"):
        keras_parallel.ShardingCallback(distribution)
    # Nothing was applied: the model still trains on one device.
    assert model.distribution is None
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("shard", ["full", "optimizer"])
def test_shard_is_refused_naming_the_backends_that_have_it(shard):
    distribution = keras_parallel.DataParallel(
        devices=tf_devices.devices(2), shard=shard
    )
    model = _model()
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ShardingError, match="runs on the JAX and torch") as info:
        _compile(model, distribution)
    assert f"Received: shard={shard!r}" in str(info.value)
    with pytest.raises(ShardingError, match="runs on the JAX and torch"):
        keras_parallel.ShardingCallback(distribution)
    assert model.distribution is None
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("num_devices", [2, 4])
def test_variables_are_mirrored_over_the_mesh(num_devices):
    x, y = _data()
    model = _model()
    _compile(
        model, keras_parallel.DataParallel(devices=tf_devices.devices(num_devices))
    )
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    expected = tf_devices.devices(num_devices)
    variables = model.variables + model.optimizer.variables + model.metrics_variables
    assert len(variables) > 10
    for variable in variables:
        assert _replica_devices(variable) == expected, variable.path
    kernel = model.get_layer("d1").kernel._value
    replicas = [v.numpy() for v in kernel.values]
    for replica in replicas[1:]:
        np.testing.assert_array_equal(replica, replicas[0])


def test_release_returns_the_model_to_one_device():
    x, y = _data()
    model = _model()
    _compile(model, keras_parallel.DataParallel(devices=tf_devices.devices(2)))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    weights = model.get_weights()
    _compile(model)  # compile(distribution=None): back to one device
    assert model.distribution is None
    for variable in model.variables + model.optimizer.variables:
        assert _replica_devices(variable) is None, variable.path
    for a, b in zip(model.get_weights(), weights, strict=True):
        np.testing.assert_array_equal(a, b)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model._distribute_strategy is None


def test_metric_state_survives_the_move():
    from keras_parallel.backends.tensorflow import strategies
    from keras_parallel.backends.tensorflow import variables as tf_variables

    x, y = _data()
    model = _model()
    _compile(model)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    before = {k: float(v) for k, v in model.get_metrics_result().items()}
    weights = model.get_weights()
    strategy = strategies.strategy_for(
        ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]
    )
    moved = tf_variables.move_variables(model, strategy)
    assert moved == len(tf_variables.all_variables(model))
    # An on-read SUM state (a metric's total) is split so that its sum over
    # the replicas is the old value, not three times it.
    with strategy.scope():
        after = {k: float(v) for k, v in model.get_metrics_result().items()}
    assert after == pytest.approx(before, rel=1e-6)
    for a, b in zip(model.get_weights(), weights, strict=True):
        np.testing.assert_array_equal(a, b)
    tf_variables.move_variables(model, None)
    assert float(model.get_metrics_result()["mae"]) == pytest.approx(
        before["mae"], rel=1e-6
    )


def test_demo_splits_the_cpu_and_runs_in_this_process():
    from keras_parallel.launcher.demo_processes import demo_processes

    # The runtime already runs with 4 devices: asking for 4 or fewer is a
    # no-op, asking for more is a clear error.
    assert demo_processes("tensorflow", 4) == 1
    if not tf.config.list_physical_devices("GPU"):
        with pytest.raises(RuntimeError, match="runtime already started"):
            demo_processes("tensorflow", 16)


def test_a_second_callback_run_trains_every_batch_of_a_generator():
    """A `ShardingCallback` run after the first draws no batch to build.

    The plan is released after every callback run, so Keras's own build,
    which under a strategy draws batches from the input first (a generator
    would lose them) and averages replicas' uneven shares, never runs.
    """
    x, y = _data(56)

    def batches():
        # 4 batches of 14 rows: 4/4/4/2 on the 4 replicas.
        for start in range(0, 56, 14):
            yield x[start : start + 14], y[start : start + 14]

    def trained(callbacks):
        model = _model(keras.Model, probe=True)
        _compile(model)
        model.fit(x, y, batch_size=8, verbose=0, callbacks=callbacks)
        split_probe.clear()
        history = model.fit(batches(), epochs=1, verbose=0, callbacks=callbacks)
        return model, history.history["loss"], split_probe.records()

    distribution = keras_parallel.DataParallel(devices=tf_devices.devices(4))
    model, loss, records = trained([keras_parallel.ShardingCallback(distribution)])
    reference, expected_loss, _ = trained([])
    # Every batch of the generator trained, each split over the 4 replicas.
    assert sorted(rows for _, rows in records) == [2] * 4 + [4] * 12
    for ours, expected in zip(
        model.get_weights(), reference.get_weights(), strict=True
    ):
        np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)
    assert loss == pytest.approx(expected_loss, rel=1e-5)


def test_the_workers_store_refuses_a_key_already_holding_another_value(monkeypatch):
    # TensorFlow's coordination service keeps a key's first value: a write
    # under a key someone else wrote first is an error, not lost silently;
    # the same value again is none.
    from tensorflow.python.eager import context

    from keras_parallel.backends.tensorflow.workers import CoordinationStore
    from keras_parallel.messages.signed_store import KeyAlreadySetError

    values = {}

    class Service:
        def set_config_key_value(self, key, value):
            if key in values:
                raise tf.errors.AlreadyExistsError(None, None, key)
            values[key] = value

        def get_config_key_value(self, key, timeout_ms):
            if key not in values:
                raise tf.errors.NotFoundError(None, None, key)
            return values[key]

    monkeypatch.setattr(context, "context", Service)
    store = CoordinationStore()
    store.set("keras_parallel/stop/1/notice", "0:SIGTERM")
    store.set("keras_parallel/stop/1/notice", "0:SIGTERM")  # The same: no error.
    with pytest.raises(KeyAlreadySetError, match="keras_parallel/stop/1/notice"):
        store.set("keras_parallel/stop/1/notice", "1:SIGTERM")
    assert store.try_get("keras_parallel/stop/1/notice") == "0:SIGTERM"
