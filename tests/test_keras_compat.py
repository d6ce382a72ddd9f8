"""Every Keras internal keras_parallel uses exists in the installed Keras.

Module-level internals are checked when each `keras_compat` module is
imported; the attributes of Keras objects are checked here, on real objects
of the running backend, so each tox env (oldest Keras, latest, nightly)
proves its Keras has them all.
"""

import importlib

import keras
import numpy as np
import pytest

from keras_parallel import keras_compat
from keras_parallel.errors import UnsupportedKerasError

BACKEND = keras.backend.backend()


def _owners():
    """One real object per owner name used in the OBJECT_ATTRIBUTES lists."""
    inputs = keras.Input((4,))
    x = keras.layers.BatchNormalization()(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.zeros((8, 4)), np.zeros((8, 2)), verbose=0)
    # keras.distribution.list_devices() fails on torch (Keras 3.15).
    mesh = keras.distribution.DeviceMesh((1,), ["model"], ["cpu:0"])
    model_parallel = keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="model"
    )
    return {
        "keras.distribution.ModelParallel": model_parallel,
        "keras.Model": model,
        "keras.Model (after fit)": model,
        "keras.Variable": model.weights[0],
        "keras.layers.BatchNormalization": model.layers[1],
        "keras.optimizers.Optimizer": model.optimizer,
    }


def _lists():
    lists = [keras_compat.OBJECT_ATTRIBUTES]
    module = importlib.import_module(f"keras_parallel.backends.{BACKEND}.keras_compat")
    lists.append(module.OBJECT_ATTRIBUTES)
    return lists


def test_every_listed_object_attribute_exists():
    owners = _owners()
    missing = [
        f"{owner}.{name}"
        for listing in _lists()
        for owner, names in listing.items()
        for name in names
        if not hasattr(owners[owner], name)
    ]
    assert not missing, f"keras=={keras.version()} lacks {missing}"


def test_backend_executor_imports_with_this_keras():
    from keras_parallel.backends import executor_class

    assert executor_class().backend == BACKEND


def test_missing_module_names_version_and_range():
    with pytest.raises(UnsupportedKerasError) as info:
        keras_compat.internal("keras.src.no_such_module")
    message = str(info.value)
    assert "keras.src.no_such_module" in message
    assert f"keras=={keras.version()}" in message
    assert keras_compat.SUPPORTED_KERAS in message


def test_missing_attribute_names_it():
    with pytest.raises(UnsupportedKerasError, match=r"model.*no_such_name"):
        keras_compat.internal("keras.src.models.model", "Model.no_such_name")


def test_older_keras_than_required_is_refused():
    keras_compat.require_keras((3, 0))
    with pytest.raises(UnsupportedKerasError, match=r"needs `Keras >= 99.1`"):
        keras_compat.require_keras((99, 1))


def test_renamed_internal_takes_the_name_that_exists():
    module = "keras.src.models.model"
    found = keras_compat.internal_any(module, "NoSuchOldName", "Model")
    assert found is importlib.import_module(module).Model
    with pytest.raises(UnsupportedKerasError, match="A or B"):
        keras_compat.internal_any(module, "A", "B")


def test_supported_range_matches_pyproject():
    import pathlib

    import tomllib

    pyproject = pathlib.Path(__file__).parents[1] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    assert f"keras{keras_compat.SUPPORTED_KERAS}" in deps
    minimum = ".".join(map(str, keras_compat.MINIMUM_KERAS))
    assert keras_compat.SUPPORTED_KERAS == f">={minimum}"
