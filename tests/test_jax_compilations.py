"""How often a JAX step compiles: once per entry point, as plain Keras's.

On one device under a distribution the train step compiled three times per
`fit` (Keras's own `DataParallel` too): the state was committed after the
first step's outputs while the initial values and a metric's reset zeros
were not (`backends/jax/executor.py`'s `apply`,
`planned_distribution.distribute_committed`). On a GPU each compile of a
large model costs minutes.
"""

import logging

import keras
import numpy as np
import pytest

import keras_parallel

BACKEND = keras.backend.backend()
pytestmark = pytest.mark.skipif(
    BACKEND != "jax", reason="JAX executor tests; run them under tox -e jax"
)


class _Compiles(logging.Handler):
    """The names JAX logs as it compiles (`jax.log_compiles()`)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling "):
            self.names.append(message.split()[1])


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


def _model(cls=keras.Model):
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    return cls(inputs, keras.layers.Dense(2)(hidden))


def _step_compiles(model, callbacks=()):
    """`{entry point: steps compiled}` for `fit` (3 epochs), `evaluate`, `predict`."""
    import jax

    x = np.random.default_rng(0).random((64, 8), "float32")
    y = np.random.default_rng(1).random((64, 2), "float32")
    model(x[:1])
    compiles = _Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(compiles)
    runs = {
        "fit": lambda: model.fit(
            x, y, batch_size=16, epochs=3, verbose=0, callbacks=list(callbacks)
        ),
        "evaluate": lambda: model.evaluate(
            x, y, batch_size=16, verbose=0, callbacks=list(callbacks)
        ),
        "predict": lambda: model.predict(
            x, batch_size=16, verbose=0, callbacks=list(callbacks)
        ),
    }
    counts = {}
    try:
        with jax.log_compiles():
            for name, run in runs.items():
                compiles.names.clear()
                run()
                counts[name] = sum(n.endswith("step)") for n in compiles.names)
    finally:
        logger.removeHandler(compiles)
    return counts


@pytest.mark.parametrize("door", ["model", "callback"])
@pytest.mark.parametrize("devices", [1, 8])
def test_each_step_compiles_once_per_entry_point_as_plain_keras(door, devices):
    import jax

    if jax.device_count() < devices:
        pytest.skip(f"needs {devices} JAX devices")
    plain = _model()
    plain.compile("adam", "mse", metrics=["mae"])
    expected = _step_compiles(plain)
    assert expected == {"fit": 1, "evaluate": 1, "predict": 1}

    distribution = keras_parallel.DataParallel(devices=jax.devices()[:devices])
    if door == "model":
        model = _model(Net)
        model.compile("adam", "mse", metrics=["mae"], distribution=distribution)
        callbacks = ()
    else:
        model = _model()
        model.compile("adam", "mse", metrics=["mae"])
        callbacks = (keras_parallel.ShardingCallback(distribution),)
    assert _step_compiles(model, callbacks) == expected
