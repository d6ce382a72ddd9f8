"""`fit` features on TensorFlow train as on one device (the promise).

Keras's own `fit` under `tf.distribute.MirroredStrategy` misses each of these
(its gaps, not keras_parallel's): a Python generator trains only the two
batches Keras peeked; `clipnorm`, `global_clipnorm` and `clipvalue` clip each
replica's part of the gradient; `gradient_accumulation_steps`,
`ema_overwrite_frequency` (Keras 3.15) and `steps_per_execution > 1` raise; a
custom `train_step` written as Keras's guide writes it logs `1 / replicas` of
the loss. Each test trains a one-device and a DataParallel copy from the
same weights on the same batches, an uneven last batch included, compares
weights and logs, and checks with `split_probe` that every step's batch was
split over the devices.
"""

import fit_features
import keras
import numpy as np
import pytest
import split_probe

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="TensorFlow executor tests run in the tensorflow tox env",
)

if keras.backend.backend() == "tensorflow":
    import tf_devices  # conftest split the CPU into logical devices

import keras_parallel  # noqa: E402

#: 3 batches of 64 and a last one of 43 (22/21 over 2 devices, 11/11/11/10
#: over 4).
SAMPLES = 235


class Net(keras_parallel.DistributedModel, keras.Model):
    pass


if keras.backend.backend() == "tensorflow":
    #: The `train_step` of Keras's guide "Customizing what happens in
    #: `fit()` with TensorFlow", as written there.
    GuideModel = fit_features.guide_custom_model()

    class GuideNet(keras_parallel.DistributedModel, GuideModel):
        pass


def _model(cls, num_devices=None, optimizer=None, **compile_kwargs):
    """The batch probe first, then a small classifier, compiled.

    Args:
        cls: the model class.
        num_devices: `DataParallel` over this many devices, or one device.
        optimizer: a function making the optimizer (each copy its own).
        **compile_kwargs: more arguments to `compile`.

    Returns:
        The compiled model; every copy starts from the same weights.
    """
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,))
    x = split_probe.probe()(inputs)
    x = keras.layers.Dense(16, activation="tanh", name="d1")(x)
    outputs = keras.layers.Dense(3, name="d2")(x)
    model = cls(inputs=inputs, outputs=outputs)
    if num_devices is not None:
        compile_kwargs["distribution"] = keras_parallel.DataParallel(
            devices=tf_devices.devices(num_devices)
        )
    model.compile(
        optimizer=(optimizer or (lambda: keras.optimizers.SGD(0.1)))(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **compile_kwargs,
    )
    return model


def _data(n=SAMPLES):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 12)).astype("float32")
    y = rng.integers(0, 3, size=(n,)).astype("int32")
    return x, y


def _batches(x, y, batch_size=64):
    """A Python generator of the batches, in order, the last one partial."""
    for start in range(0, len(x), batch_size):
        yield x[start : start + batch_size], y[start : start + batch_size]


class StepLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append({k: float(v) for k, v in logs.items()})


def _max_diff(model, reference):
    weights, expected = model.get_weights(), reference.get_weights()
    assert len(weights) == len(expected) > 0
    return max(
        float(np.max(np.abs(a - b))) for a, b in zip(weights, expected, strict=True)
    )


def _fit_both(reference, model, num_devices, fit, batch_size=64):
    """Fits both copies with `fit(model, callbacks)`; checks the split.

    Args:
        reference: the one-device copy.
        model: the DataParallel copy.
        num_devices: the devices `model`'s batches must be split over.
        fit: `fit(model, callbacks)`, returning the `History`.
        batch_size: the global batch.

    Returns:
        `(histories, step_logs, recorded)`: the History dicts and the step
        logs (the reference's first), and the rows the DataParallel copy's
        devices computed (`split_probe.records()`).
    """
    histories, step_logs = [], []
    for m in (reference, model):
        split_probe.clear()
        logs = StepLogs()
        histories.append(fit(m, [logs]).history)
        step_logs.append(logs.logs)
    recorded = split_probe.records()
    split_probe.assert_divided(recorded, batch_size, num_devices)
    return histories, step_logs, recorded


def _assert_same_logs(histories, step_logs):
    """The DataParallel copy's History and step logs are the reference's."""
    expected, got = histories
    assert set(got) == set(expected)
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    assert len(step_logs[1]) == len(step_logs[0])
    for mine, theirs in zip(step_logs[1], step_logs[0], strict=True):
        assert mine == pytest.approx(theirs, rel=1e-5, abs=1e-6)


def _array_fit(epochs=2, batch_size=64):
    x, y = _data()

    def fit(model, callbacks):
        return model.fit(
            x,
            y,
            batch_size=batch_size,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )

    return fit


# ------------------------------------------------------------ generators
@pytest.mark.parametrize("door", ["model", "callback"])
def test_generator_trains_every_batch_once(door):
    # Keras peeks two batches of a generator and replays them; drawing a
    # first batch to build the model consumed the rest (only rows 0-127
    # were trained). Both doors build the model: `fit` (a DistributedModel)
    # and the first epoch's iterator (ShardingCallback).
    x, y = _data()
    reference = _model(keras.Model)
    if door == "model":
        model, callbacks = _model(Net, num_devices=2), []
    else:
        distribution = keras_parallel.DataParallel(devices=tf_devices.devices(2))
        model = _model(keras.Model)
        callbacks = [keras_parallel.ShardingCallback(distribution)]

    def fit(m, logs):
        extra = callbacks if m is model else []
        return m.fit(
            _batches(x, y), epochs=1, shuffle=False, verbose=0, callbacks=logs + extra
        )

    histories, step_logs, recorded = _fit_both(reference, model, 2, fit)
    # Every sample once, each step's rows over both devices.
    assert sum(rows for _, rows in recorded) == SAMPLES
    assert sorted(rows for _, rows in recorded) == [21, 22] + [32] * 6
    assert len(step_logs[1]) == 4
    assert model.optimizer.iterations.numpy() == reference.optimizer.iterations.numpy()
    assert _max_diff(model, reference) < 1e-5
    _assert_same_logs(histories, step_logs)
    # `evaluate` draws no batch either.
    split_probe.clear()
    evaluation = model.evaluate(_batches(x, y), verbose=0, callbacks=callbacks)
    assert sum(rows for _, rows in split_probe.records()) == SAMPLES
    expected = reference.evaluate(_batches(x, y), verbose=0)
    assert evaluation == pytest.approx(expected, rel=1e-5)


# -------------------------------------------------------------- clipping
@pytest.mark.parametrize("num_devices", [2, 4])
@pytest.mark.parametrize(
    "clip", [{"clipnorm": 0.05}, {"global_clipnorm": 0.05}, {"clipvalue": 0.004}]
)
def test_gradient_clipping_clips_the_whole_gradient(clip, num_devices):
    # One device clips the gradient of the global batch; each replica's
    # part is smaller and was clipped less (weights 1e-2 off).
    def optimizer():
        return keras.optimizers.SGD(0.1, momentum=0.9, **clip)

    reference = _model(keras.Model, optimizer=optimizer)
    model = _model(Net, num_devices, optimizer=optimizer)
    histories, step_logs, _ = _fit_both(reference, model, num_devices, _array_fit())
    assert model.optimizer.iterations.numpy() == 8
    assert _max_diff(model, reference) < 1e-5
    _assert_same_logs(histories, step_logs)


def test_clipping_binds_in_this_test():
    # The control: unclipped training ends elsewhere, so the test above
    # compares clipped steps.
    x, y = _data()
    clipped = _model(
        keras.Model, optimizer=lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.05)
    )
    plain = _model(keras.Model)
    for m in (clipped, plain):
        m.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert _max_diff(clipped, plain) > 1e-2


# --------------------------------------------------- gradient accumulation
@pytest.mark.parametrize("num_devices", [2, 4])
def test_gradient_accumulation_equals_one_device(num_devices):
    # The average over micro-batches of the global mean gradient, clipped
    # as a whole: 2 epochs of 4 steps, 2 micro-batches per update.
    def optimizer():
        return keras.optimizers.SGD(
            0.1, momentum=0.9, global_clipnorm=0.05, gradient_accumulation_steps=2
        )

    reference = _model(keras.Model, optimizer=optimizer)
    model = _model(Net, num_devices, optimizer=optimizer)
    histories, step_logs, _ = _fit_both(reference, model, num_devices, _array_fit())
    assert model.optimizer.iterations.numpy() == 4  # Updates, not micro-batches.
    assert _max_diff(model, reference) < 1e-5
    _assert_same_logs(histories, step_logs)


def test_ema_overwrite_equals_one_device():
    # Keras 3.15 overwrites the weights with their moving average in a
    # `tf.cond` too (every 3 steps here), which held a `merge_call`.
    def optimizer():
        return keras.optimizers.SGD(0.1, use_ema=True, ema_overwrite_frequency=3)

    reference = _model(keras.Model, optimizer=optimizer)
    model = _model(Net, 4, optimizer=optimizer)
    histories, step_logs, _ = _fit_both(reference, model, 4, _array_fit())
    assert _max_diff(model, reference) < 1e-5
    _assert_same_logs(histories, step_logs)


# ------------------------------------------------------ steps_per_execution
@pytest.mark.parametrize("num_devices", [2, 4])
def test_steps_per_execution_equals_one_device(num_devices):
    # 4 steps per call of the step function, in a `tf.while_loop` whose
    # `tf.cond` could not feed the collectives' keys; the last execution
    # holds the partial batch.
    x, y = _data()
    reference = _model(keras.Model, steps_per_execution=4)
    model = _model(Net, num_devices, steps_per_execution=4)
    histories, step_logs, _ = _fit_both(
        reference, model, num_devices, _array_fit(epochs=2)
    )
    assert model.optimizer.iterations.numpy() == 8
    assert _max_diff(model, reference) < 1e-5
    _assert_same_logs(histories, step_logs)
    assert model.evaluate(x, y, batch_size=64, verbose=0) == pytest.approx(
        reference.evaluate(x, y, batch_size=64, verbose=0), rel=1e-5
    )
    np.testing.assert_allclose(
        model.predict(x, batch_size=64, verbose=0),
        reference.predict(x, batch_size=64, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )


# ------------------------------------------------------ custom train_step
@pytest.mark.parametrize("num_devices", [2, 4])
def test_guide_train_step_logs_the_one_device_loss(num_devices):
    # The step feeds `compute_loss`'s value to the loss metric as it is:
    # that value must be the loss one device logs, whatever the scaling
    # the gradient needs.
    reference = _model(GuideModel)
    model = _model(GuideNet, num_devices)
    histories, step_logs, _ = _fit_both(reference, model, num_devices, _array_fit())
    assert model.optimizer.iterations.numpy() == 8
    assert _max_diff(model, reference) < 1e-5
    _assert_same_logs(histories, step_logs)


# ------------------------------------------------- batches a generator yields
class _Batches(keras.utils.PyDataset):
    """A `PyDataset` of given batches (views of the caller's arrays)."""

    def __init__(self, batches):
        super().__init__()
        self.batches = list(batches)

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, index):
        return self.batches[index]


def _aligned(array):
    """A copy of `array` whose data starts on a 64-byte boundary.

    TensorFlow wraps such an array's memory instead of copying it; whether
    NumPy's own allocation is aligned varies from run to run, so the test
    fixes it.
    """
    buffer = np.empty(array.nbytes + 64, dtype=np.uint8)
    start = -buffer.ctypes.data % 64
    aligned = buffer[start : start + array.nbytes].view(array.dtype)
    aligned = aligned.reshape(array.shape)
    aligned[...] = array
    return aligned


def _regressor(cls, num_devices=None, **compile_kwargs):
    """12 features -> probe -> 16 (tanh) -> 8, mse: float targets, 32 bytes
    a row."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,))
    x = keras.layers.Dense(16, activation="tanh", name="d1")(
        split_probe.probe()(inputs)
    )
    model = cls(inputs=inputs, outputs=keras.layers.Dense(8, name="d2")(x))
    if num_devices is not None:
        compile_kwargs["distribution"] = keras_parallel.DataParallel(
            devices=tf_devices.devices(num_devices)
        )
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss="mse",
        metrics=["mae"],
        **compile_kwargs,
    )
    return model


@pytest.mark.parametrize(
    "source, door",
    [("pydataset", "model"), ("pydataset", "callback"), ("generator", "model")],
)
def test_python_batches_are_not_overwritten(source, door):
    # TensorFlow wraps a 64-byte-aligned NumPy batch that a generator yields
    # without copying, and splits it over the replicas in slices of that
    # memory; a step's kernel then wrote mse's gradient into the caller's
    # `y` (every replica's rows of it). A second epoch of the PyDataset
    # trained on those (weights 2.5e-2 off one device), and `evaluate` on
    # the arrays read them (half the loss): intermittently, as NumPy's
    # allocation happened to be aligned.
    x, _ = _data()
    y = (3 * np.random.default_rng(2).normal(size=(len(x), 8))).astype("float32")
    epochs = 2 if source == "pydataset" else 1  # A generator is consumed once.
    callbacks = []
    if door == "model":
        model = _regressor(Net, num_devices=2)
    else:
        model = _regressor(keras.Model)
        callbacks = [
            keras_parallel.ShardingCallback(
                keras_parallel.DataParallel(devices=tf_devices.devices(2))
            )
        ]
    reference = _regressor(keras.Model)
    arrays = {}
    for m in (reference, model):
        split_probe.clear()  # The DataParallel copy's records are kept.
        arrays[m] = (_aligned(x), _aligned(y))
        data = _batches(*arrays[m])
        data = _Batches(data) if source == "pydataset" else data
        m.fit(
            data,
            epochs=epochs,
            shuffle=False,  # A PyDataset's batches in one order for both.
            verbose=0,
            callbacks=callbacks if m is model else [],
        )
    split_probe.assert_divided(split_probe.records(), 64, 2)
    got_x, got_y = arrays[model]
    np.testing.assert_array_equal(got_x, x)
    np.testing.assert_array_equal(got_y, y)
    assert _max_diff(model, reference) < 1e-5
    assert model.evaluate(
        got_x, got_y, batch_size=64, verbose=0, callbacks=callbacks
    ) == pytest.approx(reference.evaluate(x, y, batch_size=64, verbose=0), rel=1e-5)
