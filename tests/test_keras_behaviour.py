"""Keras's own behaviour, kept through both doors (found by Keras's tests).

Keras 3.15's own trainer, model and callback tests, run through
`ShardingCallback` and `DistributedModel`, found models that stopped
behaving like Keras. Each case is here, compared with one device:

- a model run through the callback door is used plainly after (every entry
  point, batch sizes the mesh does not divide), and a second run through
  the door reuses the steps it compiled;
- the default `verbose` on every entry point, on every rank;
- frozen and partly frozen models, an output compiled with loss `None`, a
  model trained through `add_loss` alone;
- sparse input: split on TensorFlow, refused on JAX with the model intact;
- a `Trainer` that is not a `keras.Model` is refused by the callback door.

The resume of an interrupted run through each door is in `test_backup.py`.
"""

import keras
import keras_behaviour_workers as workers
import numpy as np
import pytest
import split_probe

import keras_parallel
from keras_parallel.errors import ShardingError

BACKEND = keras.backend.backend()
LAUNCH_TIMEOUT = 240
# JAX: 8 simulated devices; TensorFlow: the logical CPU devices
# (`tf_devices`); torch: 2 processes.
WAYS = {"jax": 8, "tensorflow": 4, "torch": 2}[BACKEND]


def _callback():
    return keras_parallel.ShardingCallback(keras_parallel.DataParallel())


def _assert_equal_to_one_device(ours, reference, tolerance=1e-5):
    assert set(ours["history"]) == set(reference["history"])
    for key, values in reference["history"].items():
        np.testing.assert_allclose(ours["history"][key], values, rtol=tolerance)
    np.testing.assert_allclose(ours["evaluated"], reference["evaluated"], rtol=1e-5)
    assert reference["weights"], "no weights to compare"
    for a, b in zip(ours["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(a, b, rtol=tolerance, atol=1e-6)
    for a, b in zip(ours["predicted"], reference["predicted"], strict=True):
        np.testing.assert_allclose(a, b, rtol=tolerance, atol=1e-6)


# --------------------------------------------- one process: JAX, TensorFlow
in_process = pytest.mark.skipif(
    BACKEND == "torch", reason="torch runs these across processes, below"
)


@in_process
def test_model_runs_plainly_after_a_callback_run_and_reuses_its_steps():
    x, y = workers.data()
    model = workers.build("partly_frozen")
    reference = workers.build("partly_frozen")
    model.fit(x, y, batch_size=16, verbose=0, callbacks=[_callback()])
    model.evaluate(x, y, batch_size=16, verbose=0, callbacks=[_callback()])
    callback = _callback()
    model.predict(x, batch_size=16, verbose=0, callbacks=[callback])
    distributed_predict = callback._distributed_steps["predict_function"]
    reference.set_weights(model.get_weights())
    # Plain Keras again, at batch sizes no mesh divides.
    for name, call in {
        "train_on_batch": lambda m: m.train_on_batch(x[:2], y[:2]),
        "fit": lambda m: m.fit(x[:3], y[:3], batch_size=3, verbose=0).history,
        "test_on_batch": lambda m: m.test_on_batch(x[:5], y[:5]),
        "evaluate": lambda m: m.evaluate(x[:7], y[:7], batch_size=5, verbose=0),
        "predict_on_batch": lambda m: m.predict_on_batch(x[:3]),
        "predict": lambda m: m.predict(x[:12], batch_size=5, verbose=0),
    }.items():
        ours, expected = call(model), call(reference)
        if isinstance(ours, dict):
            ours, expected = ours["loss"], expected["loss"]
        np.testing.assert_allclose(ours, expected, rtol=1e-5, err_msg=name)
    assert keras.distribution.distribution() is None
    model.predict(x, batch_size=16, verbose=0, callbacks=[callback])
    assert model.predict_function is not distributed_predict
    if BACKEND == "jax":
        # The same callback again: the predict step it compiled, not a new
        # one. (TensorFlow releases the model after a run and plans anew.)
        assert callback._distributed_steps["predict_function"] is distributed_predict


@in_process
@pytest.mark.parametrize("door", ["model", "callback"])
@pytest.mark.parametrize("scenario", workers.SCENARIOS)
def test_scenario_equals_one_device_with_default_verbose(scenario, door):
    reference = workers.run(scenario, distributed=False)
    split_probe.clear()
    ours = workers.run(scenario, door=door)
    _assert_equal_to_one_device(ours, reference)
    split_probe.assert_divided(ours["records"], 16, WAYS)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX refuses sparse batches")
@pytest.mark.parametrize("door", ["model", "callback"])
def test_sparse_input_is_refused_on_jax_and_the_model_is_intact(door):
    scipy_sparse = pytest.importorskip("scipy.sparse")
    x = scipy_sparse.random(16, 6, density=0.5, format="csr", dtype="float32")
    y = np.ones((16, 2), "float32")
    model = _sparse_model(door)
    before = [np.array(w) for w in model.get_weights()]
    callbacks = [_callback()] if door == "callback" else []
    with pytest.raises(ShardingError, match="sparse batch cannot be split"):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=callbacks)
    for callback in callbacks:
        callback.close()
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)
    dense = model.predict(x.toarray(), verbose=0)
    assert dense.shape == (16, 2)


class _Dense(keras.Model):
    """A subclassed model that declares no sparse input (Keras's tests')."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


class _DistributedDense(keras_parallel.DistributedModel, _Dense):
    pass


def _sparse_batches(kind):
    """`fit`'s arguments: 16 sparse rows, in batches of 2 (fewer than the
    devices, as Keras's sparse tests) or 8, as `kind` gives them."""
    scipy_sparse = pytest.importorskip("scipy.sparse")
    x = scipy_sparse.random(
        16, 6, density=0.5, format="csr", dtype="float32", random_state=0
    )
    y = np.ones((16, 2), "float32")
    if kind == "scipy arrays":
        return {"x": x, "y": y, "batch_size": 8}
    tf = pytest.importorskip("tensorflow")
    if kind == "tf.data":
        dense = tf.constant(x.toarray())
        return {
            "x": tf.data.Dataset.from_tensor_slices(
                (tf.sparse.from_dense(dense), y)
            ).batch(8)
        }
    from jax.experimental import sparse as jax_sparse

    convert = {
        "scipy generator": lambda rows: rows,
        "tf.SparseTensor generator": lambda rows: tf.sparse.from_dense(rows.toarray()),
        "BCOO generator": lambda rows: jax_sparse.BCOO.fromdense(rows.toarray()),
    }[kind]
    return {"x": ((convert(x[i : i + 2]), y[i : i + 2]) for i in range(0, 16, 2))}


@pytest.mark.skipif(BACKEND != "jax", reason="JAX refuses sparse batches")
@pytest.mark.parametrize("door", ["model", "callback"])
@pytest.mark.parametrize(
    "kind",
    [
        "scipy arrays",
        "scipy generator",
        "tf.SparseTensor generator",
        "BCOO generator",
        "tf.data",
    ],
)
def test_every_sparse_batch_is_refused_on_jax_before_a_step(kind, door):
    # Whatever the model declares: Keras's own sparse tests feed a
    # subclassed model, no sparse `Input`, batches of 2 rows.
    for entry_point in ("fit", "evaluate", "predict"):
        if door == "model":
            model = _DistributedDense()
            model.compile("sgd", "mse", distribution=keras_parallel.DataParallel())
            callbacks = []
        else:
            model, callbacks = _Dense(), [_callback()]
            model.compile("sgd", "mse")
        model(np.zeros((1, 6), "float32"))  # Built: weights to compare.
        before = [np.array(w) for w in model.get_weights()]
        assert before
        arguments = _sparse_batches(kind)
        if entry_point == "predict":
            arguments.pop("y", None)
        with pytest.raises(ShardingError, match="sparse batch cannot be split"):
            getattr(model, entry_point)(verbose=0, callbacks=callbacks, **arguments)
        for callback in callbacks:
            callback.close()
        for a, b in zip(model.get_weights(), before, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{kind}: {entry_point}")


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow splits sparse")
@pytest.mark.parametrize("door", ["model", "callback"])
def test_sparse_input_is_split_on_tensorflow_as_one_device_trains(door):
    scipy_sparse = pytest.importorskip("scipy.sparse")
    x = scipy_sparse.random(
        32, 6, density=0.5, format="csr", dtype="float32", random_state=0
    )
    y = np.random.default_rng(0).normal(size=(32, 2)).astype("float32")
    reference = _sparse_model(None)
    reference.fit(x, y, batch_size=16, epochs=2, verbose=0)
    model = _sparse_model(door)
    callbacks = [_callback()] if door == "callback" else []
    split_probe.clear()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=callbacks)
    split_probe.assert_divided(split_probe.records(), 16, WAYS)
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _sparse_model(door):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), sparse=True)
    x = split_probe.probe()(inputs)
    outputs = keras.layers.Dense(2)(x)
    if door == "model":

        class Net(keras_parallel.DistributedModel, keras.Model):
            pass

        model = Net(inputs, outputs)
        model.compile("sgd", "mse", distribution=keras_parallel.DataParallel())
    else:
        model = keras.Model(inputs, outputs)
        model.compile("sgd", "mse")
    return model


def test_callback_refuses_a_trainer_that_is_not_a_model():
    import importlib

    # As Keras's own trainer tests build one: the backend's trainer mixed
    # into a layer.
    # (Keras 3.16 names each of them `Trainer`.)
    names = {"jax": "JAXTrainer", "torch": "TorchTrainer"}
    module = importlib.import_module(f"keras.src.backend.{BACKEND}.trainer")
    Trainer = getattr(module, names.get(BACKEND, "TensorFlowTrainer"), None)
    Trainer = Trainer or module.Trainer

    class DenseTrainer(Trainer, keras.layers.Dense):
        def __init__(self):
            keras.layers.Dense.__init__(self, 2)
            Trainer.__init__(self)

    model = DenseTrainer()
    model.compile("sgd", "mse")
    x, y = workers.data()
    with pytest.raises(TypeError, match="not a keras.Model"):
        model.fit(x, y, batch_size=16, verbose=0, callbacks=[_callback()])


# ------------------------------------------------------ torch: 2 processes
across_processes = pytest.mark.skipif(
    BACKEND != "torch", reason="torch ranks; JAX and TensorFlow run above"
)
CASES = [
    dict(scenario=scenario, door=door, seed_by_rank=scenario == "frozen")
    for scenario in workers.SCENARIOS
    for door in ("model", "callback")
]


def _launch(fn, args=()):
    from torch_launch import launch

    return launch(fn, 2, args=args, timeout=LAUNCH_TIMEOUT, collective_timeout=60)


@pytest.fixture(scope="module")
def two_ranks():
    return _launch(workers.run_all, args=(CASES,))


@across_processes
@pytest.mark.parametrize("index", range(len(CASES)))
def test_torch_scenario_equals_one_process_on_every_rank(two_ranks, index):
    case = CASES[index]
    reference = workers.run(case["scenario"], distributed=False)
    for rank, results in enumerate(two_ranks):
        ours = results[index]
        _assert_equal_to_one_device(ours, reference)
        # The rows each step of this rank computed: its half of 16.
        assert ours["records"], f"rank {rank} recorded no step"
        assert {rows for _, rows in ours["records"]} == {8}, ours["records"]


@across_processes
def test_torch_rank_failing_in_a_callback_is_the_one_reported():
    with pytest.raises(RuntimeError, match="rank 1's own callback failed") as raised:
        _launch(workers.fails_in_a_callback_on_rank_1)
    assert raised.value.rank == 1
