"""Saving a DistributedModel and loading it back, on every backend.

A functional `Net` is saved as Keras's `Functional` under the name `Net`:
loaded with its class it is a `Net`, compiled, with its optimizer state and
its distribution; loaded in a plain process (no `Net`, no keras_parallel) it
is a plain Keras model with its weights, compile config and optimizer state.
Both continue training exactly as the original does.
"""

import json
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
import zipfile

import keras
import numpy as np
import pytest
from builders import dense_model, max_relative_difference, regression_data

import keras_parallel
from keras_parallel.persistence.saving import DISTRIBUTION_ASSET

BACKEND = keras.backend.backend()

if BACKEND == "tensorflow":
    import tf_devices  # conftest split the CPU into logical devices

jax_only = pytest.mark.skipif(
    BACKEND != "jax", reason="ModelParallel runs on the JAX backend only"
)


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


class OwnInitNet(keras_parallel.DistributedModel, keras.Model):
    """A subclassed model: its config is its constructor's, not a graph."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = keras.layers.Dense(units, name="d1")

    def call(self, x):
        return self.dense(x)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def data_parallel():
    """DataParallel over 2 devices where the backend offers several."""
    if BACKEND == "tensorflow":
        return keras_parallel.DataParallel(devices=tf_devices.devices(2))
    return keras_parallel.DataParallel()


def model_parallel(mesh_shape=(4, 2), devices=None):
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["data", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="data"
    )


def optimizer(name):
    if name == "adam":
        return keras.optimizers.Adam(0.01)
    return keras.optimizers.SGD(0.05, momentum=0.9)


def trained(distribution, optimizer_name="sgd", model_class=Net):
    """A model trained 4 steps, so its optimizer has state to lose."""
    if model_class is OwnInitNet:
        keras.utils.set_random_seed(1)
        model = OwnInitNet(units=8, name="net")
    else:
        model = dense_model(model_class)
    kwargs = {} if distribution is None else {"distribution": distribution}
    model.compile(
        optimizer=optimizer(optimizer_name), loss="mse", metrics=["mae"], **kwargs
    )
    x, y = regression_data(256, seed=0)
    model.fit(x, y, batch_size=64, shuffle=False, verbose=0)
    return model


def next_batch():
    return regression_data(64, seed=1)


def weights_of(model):
    # builders.weights_of's np.array() refuses torch parameters.
    return [keras.ops.convert_to_numpy(v.value) for v in model.weights]


def fit_one_step(model):
    x, y = next_batch()
    model.fit(x, y, batch_size=64, shuffle=False, verbose=0)
    return weights_of(model)


def optimizer_state(model):
    """The optimizer's variables in order: iterations, rate, then slots."""
    return [keras.ops.convert_to_numpy(v.value) for v in model.optimizer.variables]


def assert_same_optimizer_state(expected, actual):
    # Paths may differ (a subclassed model's variables are re-created outside
    # its name scope): Keras saves and loads them in this order.
    assert [a.shape for a in actual] == [e.shape for e in expected]
    assert int(actual[0]) == int(expected[0]) == 4  # the iterations
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        np.testing.assert_allclose(a, e, rtol=1e-6, err_msg=f"variable {i}")


def saved_config(path):
    with zipfile.ZipFile(path) as archive:
        return json.loads(archive.read("config.json")), archive.namelist()


def load(path, **kwargs):
    with warnings.catch_warnings():
        # Keras's "compile() was not called" warning is an error here: it
        # means the compile config and the optimizer state were dropped.
        warnings.filterwarnings("error", message=".*compile\\(\\) was not called")
        return keras.saving.load_model(path, **kwargs)


# --------------------------------------------------------------- the file
def test_functional_net_is_saved_as_keras_functional_named_net(tmp_path):
    model = trained(data_parallel())
    path = tmp_path / "net.keras"
    model.save(path)
    config, names = saved_config(path)
    # Keras looks `registered_name` up first (custom objects, registered
    # classes) and imports `module.class_name` only where it is not found.
    assert config["module"] == "keras.src.models.functional"
    assert config["class_name"] == "Functional"
    assert config["registered_name"] == "Net"
    # The compile config stays Keras's own: plain Keras passes every key to
    # compile().
    assert "distribution" not in config["compile_config"]
    assert f"assets/{DISTRIBUTION_ASSET}" in names


def test_the_serialization_hook_is_in_force_only_while_saving(tmp_path):
    from keras.src.saving import serialization_lib

    original = serialization_lib.serialize_with_public_class
    model = trained(data_parallel())
    model.save(tmp_path / "net.keras")
    assert serialization_lib.serialize_with_public_class is original
    plain = dense_model(keras.Model)
    plain.compile(optimizer="sgd", loss="mse")
    plain.save(tmp_path / "plain.keras")
    config, names = saved_config(tmp_path / "plain.keras")
    assert config["registered_name"] == "Functional"
    assert names == ["metadata.json", "config.json", "model.weights.h5"]


def test_sequential_net_loads_as_keras_sequential_without_its_class(tmp_path):
    class SeqNet(keras_parallel.DistributedModel, keras.Sequential):
        pass

    keras.utils.set_random_seed(1)
    model = SeqNet([keras.Input((16,)), keras.layers.Dense(8, name="d1")])
    model.compile(optimizer=optimizer("sgd"), loss="mse", distribution=data_parallel())
    x, y = regression_data(256, seed=0)
    model.fit(x, y, batch_size=64, shuffle=False, verbose=0)
    path = tmp_path / "seq.keras"
    model.save(path)
    # SeqNet is neither given nor registered: Keras falls back to the module.
    loaded = load(path)
    assert type(loaded) is keras.Sequential
    assert_same_optimizer_state(optimizer_state(model), optimizer_state(loaded))
    assert type(load(path, custom_objects={"SeqNet": SeqNet})) is SeqNet


# ------------------------------------------------------- with the class
def test_data_parallel_round_trip_with_the_class(tmp_path):
    model = trained(data_parallel())
    path = tmp_path / "net.keras"
    model.save(path)
    loaded = load(path, custom_objects={"Net": Net})

    assert type(loaded) is Net
    assert isinstance(loaded.distribution, keras.distribution.DataParallel)
    assert loaded.distribution.batch_dim_name == model.distribution.batch_dim_name
    assert loaded.get_compile_config() == model.get_compile_config()
    assert_same_optimizer_state(optimizer_state(model), optimizer_state(loaded))
    x, y = next_batch()
    np.testing.assert_allclose(
        loaded.evaluate(x, y, verbose=0), model.evaluate(x, y, verbose=0), rtol=1e-6
    )
    expected = fit_one_step(model)
    assert max_relative_difference(expected, fit_one_step(loaded)) < 1e-6


def test_a_net_pickles_to_itself_before_compile_and_after_fit():
    # Pickle is how multiprocessing, joblib and Ray hand a model on; Keras
    # finds an unregistered `Net` only if pickle carries the class itself.
    x, _ = next_batch()
    fresh = dense_model(Net)
    loaded = pickle.loads(pickle.dumps(fresh))
    assert type(loaded) is Net
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), fresh.predict(x, verbose=0), rtol=1e-6, atol=1e-6
    )

    model = trained(data_parallel())
    loaded = pickle.loads(pickle.dumps(model))
    assert type(loaded) is Net
    assert isinstance(loaded.distribution, keras.distribution.DataParallel)
    assert_same_optimizer_state(optimizer_state(model), optimizer_state(loaded))
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6, atol=1e-6
    )
    expected = fit_one_step(model)
    assert max_relative_difference(expected, fit_one_step(loaded)) < 1e-6


@pytest.mark.skipif(
    keras.backend.backend() == "tensorflow", reason="shard= runs on JAX and torch"
)
def test_sharded_data_parallel_round_trip_keeps_shard(tmp_path):
    distribution = keras_parallel.DataParallel(shard="full", shard_min_size=64)
    model = trained(distribution)
    path = tmp_path / "net.keras"
    model.save(path)
    loaded = load(path, custom_objects={"Net": Net})
    assert loaded.distribution.shard == "full"
    assert loaded.distribution.shard_min_size == 64
    if loaded.distribution.device_mesh.devices.size > 1:  # One: nothing to split.
        assert "shard='full'" in keras_parallel.describe(loaded)
    expected = fit_one_step(model)
    assert max_relative_difference(expected, fit_one_step(loaded)) < 1e-6
    if keras.backend.backend() == "jax":
        # Each of the 8 devices holds an eighth of d1's (16, 32) kernel.
        kernel = loaded.get_layer("d1").kernel.value
        assert kernel.addressable_shards[0].data.size * 8 == kernel.size


def test_registered_class_is_found_without_custom_objects(tmp_path):
    @keras.saving.register_keras_serializable(package="kp_test")
    class RegisteredNet(keras_parallel.DistributedModel, keras.Model):
        pass

    model = trained(data_parallel(), model_class=RegisteredNet)
    path = tmp_path / "net.keras"
    model.save(path)
    assert saved_config(path)[0]["registered_name"] == "kp_test>RegisteredNet"
    loaded = load(path)
    assert type(loaded) is RegisteredNet
    assert loaded.distribution is not None
    assert_same_optimizer_state(optimizer_state(model), optimizer_state(loaded))


def test_model_saved_without_distribution_loads_as_before(tmp_path):
    model = trained(None, optimizer_name="adam")
    path = tmp_path / "net.keras"
    model.save(path)
    assert f"assets/{DISTRIBUTION_ASSET}" not in saved_config(path)[1]
    loaded = load(path, custom_objects={"Net": Net})
    assert type(loaded) is Net
    assert loaded.distribution is None
    assert_same_optimizer_state(optimizer_state(model), optimizer_state(loaded))
    expected = fit_one_step(model)
    assert max_relative_difference(expected, fit_one_step(loaded)) < 1e-6


def test_load_without_compiling_applies_no_distribution(tmp_path):
    model = trained(data_parallel())
    path = tmp_path / "net.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, custom_objects={"Net": Net}, compile=False)
    assert type(loaded) is Net
    assert not loaded.compiled
    assert loaded.distribution is None


def test_subclassed_model_needs_its_class(tmp_path):
    model = trained(data_parallel(), model_class=OwnInitNet)
    path = tmp_path / "own.keras"
    model.save(path)
    config, _ = saved_config(path)
    assert config["class_name"] == "OwnInitNet"
    with pytest.raises(TypeError, match="OwnInitNet"):
        keras.saving.load_model(path)
    loaded = load(path, custom_objects={"OwnInitNet": OwnInitNet})
    assert type(loaded) is OwnInitNet
    assert loaded.distribution is not None
    assert_same_optimizer_state(optimizer_state(model), optimizer_state(loaded))


# ---------------------------------------------------- in a plain process
# One plain process loads every saved model in turn (`PATH OUT BATCH`
# triples): each case's result is its own; one Python start serves them all.
PLAIN_LOAD = textwrap.dedent(
    """
    import json, sys
    import keras
    import numpy as np

    arguments = sys.argv[1:]
    for i in range(0, len(arguments), 3):
        path, out, x_path = arguments[i : i + 3]
        model = keras.saving.load_model(path)
        data = np.load(x_path)
        result = {
            "class": type(model).__name__,
            "keras_parallel_imported": "keras_parallel" in sys.modules,
            "loss": model.loss,
            "optimizer": type(model.optimizer).__name__,
            "learning_rate": float(model.optimizer.learning_rate.numpy()),
            "evaluate": model.evaluate(data["x"], data["y"], verbose=0),
            "metrics": model.metrics_names,
        }
        state = {str(i): keras.ops.convert_to_numpy(v.value) for i, v in enumerate(model.optimizer.variables)}
        model.fit(data["x"], data["y"], batch_size=64, shuffle=False, verbose=0)
        weights = {str(i): keras.ops.convert_to_numpy(v.value) for i, v in enumerate(model.weights)}
        np.savez(out + ".state.npz", **state)
        np.savez(out + ".weights.npz", **weights)
        with open(out, "w") as f:
            json.dump(result, f)
    """
)
PLAIN_OPTIMIZERS = ["sgd", "adam"]


@pytest.fixture(scope="module")
def loaded_in_a_plain_process(tmp_path_factory):
    """`{optimizer: (model, its batch, folder)}`, each loaded by one plain process."""
    folder = tmp_path_factory.mktemp("plain")
    saved, arguments = {}, []
    for name in PLAIN_OPTIMIZERS:
        model = trained(data_parallel(), name)
        model.save(folder / f"{name}.keras")
        x, y = next_batch()
        np.savez(folder / f"{name}.npz", x=x, y=y)
        saved[name] = (model, (x, y), folder / f"{name}.json")
        arguments += [folder / f"{name}.keras", folder / f"{name}.json"]
        arguments.append(folder / f"{name}.npz")
    env = dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="2")
    run = subprocess.run(
        [sys.executable, "-c", PLAIN_LOAD, *map(str, arguments)],
        env=env,
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return saved


@pytest.mark.parametrize("optimizer_name", PLAIN_OPTIMIZERS)
def test_plain_process_without_the_class_loads_a_keras_model(
    loaded_in_a_plain_process, optimizer_name
):
    model, (x, y), out = loaded_in_a_plain_process[optimizer_name]
    result = json.loads(out.read_text())

    assert result["class"] == "Functional"
    assert not result["keras_parallel_imported"]
    assert result["loss"] == "mse"
    assert result["optimizer"] == type(model.optimizer).__name__
    assert result["learning_rate"] == pytest.approx(
        float(model.optimizer.learning_rate.numpy())
    )
    expected_eval = model.evaluate(x, y, verbose=0)
    np.testing.assert_allclose(result["evaluate"], expected_eval, rtol=1e-6)
    with np.load(f"{out}.state.npz") as state:
        loaded_state = [state[str(i)] for i in range(len(state.files))]
    assert_same_optimizer_state(optimizer_state(model), loaded_state)
    # One device there, the distribution here: the same step to float32
    # rounding of the gradient's sum over devices.
    expected = fit_one_step(model)
    with np.load(f"{out}.weights.npz") as weights:
        actual = [weights[str(i)] for i in range(len(weights.files))]
    assert max_relative_difference(expected, actual) < 1e-5


# ------------------------------------------------------------ ModelParallel
@jax_only
def test_model_parallel_round_trip_keeps_the_layout(tmp_path):
    from jax.sharding import PartitionSpec as P

    model = trained(model_parallel((4, 2)), "adam")
    path = tmp_path / "net.keras"
    model.save(path)
    loaded = load(path, custom_objects={"Net": Net})

    distribution = loaded.distribution
    assert isinstance(distribution, keras.distribution.ModelParallel)
    assert tuple(distribution.device_mesh.shape) == (4, 2)
    assert list(distribution.device_mesh.axis_names) == ["data", "model"]
    assert distribution.batch_dim_name == "data"
    layout_map = distribution._layout_map
    assert list(layout_map) == ["d1/kernel"]
    assert tuple(layout_map["d1/kernel"].axes) == (None, "model")
    text = keras_parallel.describe(loaded)
    assert "Mesh: data=4, model=2" in text
    kernel_row = next(row for row in text.splitlines() if row.startswith("d1/kernel"))
    assert "(-, model)" in kernel_row
    assert_same_optimizer_state(optimizer_state(model), optimizer_state(loaded))

    expected = fit_one_step(model)
    actual = fit_one_step(loaded)
    assert max_relative_difference(expected, actual) < 1e-6
    kernel = loaded.get_layer("d1").kernel.value
    assert kernel.sharding.spec == P(None, "model")
    assert dict(kernel.sharding.mesh.shape) == {"data": 4, "model": 2}
    assert {s.data.shape for s in kernel.addressable_shards} == {(16, 16)}


@jax_only
def test_model_parallel_by_rules_round_trip_keeps_the_rules(tmp_path):
    mesh = keras.distribution.DeviceMesh(
        (4, 2), ["data", "model"], keras.distribution.list_devices()
    )
    rules = [("mlp", "model"), ("embed", None)]
    distribution = keras_parallel.ModelParallel(
        device_mesh=mesh, rules=rules, batch_dim_name="data"
    )
    model = trained(distribution)
    path = tmp_path / "net.keras"
    model.save(path)
    loaded = load(path, custom_objects={"Net": Net})
    assert loaded.distribution.rules == tuple(rules)
    assert list(loaded.distribution._layout_map) == []
    expected = fit_one_step(model)
    actual = fit_one_step(loaded)
    assert max_relative_difference(expected, actual) < 1e-6
    # d1 (16 -> 32) splits its outputs over `model`, as before saving.
    kernel = loaded.get_layer("d1").kernel.value
    assert {s.data.shape for s in kernel.addressable_shards} == {(16, 16)}


@jax_only
def test_model_parallel_mesh_larger_than_the_devices_loads_on_one_device(tmp_path):
    # Saved over 4 of the 8 devices: this process has 8, not 4.
    devices = keras.distribution.list_devices()[:4]
    model = trained(model_parallel((2, 2), devices), "adam")
    path = tmp_path / "net.keras"
    model.save(path)
    with pytest.warns(UserWarning, match=r"\(2, 2\).*Received: 8 local device"):
        loaded = load(path, custom_objects={"Net": Net})
    assert type(loaded) is Net
    assert loaded.distribution is None
    assert loaded.compiled
    assert_same_optimizer_state(optimizer_state(model), optimizer_state(loaded))
    x, y = next_batch()
    np.testing.assert_allclose(
        loaded.evaluate(x, y, verbose=0), model.evaluate(x, y, verbose=0), rtol=1e-5
    )
