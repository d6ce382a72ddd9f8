"""Small models and data shared by the tests (any backend)."""

import numpy as np

from keras_parallel.keras_seam.model_state import binding_of


def dense_model(model_class, batchnorm=False, name="net", seed=1, probe=False):
    """A small functional MLP: d1 (16->32), optional BatchNorm, d2 (32->8).

    With `probe=True`, a `split_probe.probe()` (no variables: the weights
    are those of the model without it) follows the Input, so a test can
    check that the batch was split. Off by default: a model saved with it
    loads only where `split_probe` is imported.
    """
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16,))
    x = inputs
    if probe:
        import split_probe

        x = split_probe.probe()(x)
    x = keras.layers.Dense(32, activation="relu", name="d1")(x)
    if batchnorm:
        x = keras.layers.BatchNormalization(name="bn")(x)
    outputs = keras.layers.Dense(8, name="d2")(x)
    return model_class(inputs=inputs, outputs=outputs, name=name)


def wide_mlp(model_class, name="mlp", seed=1, probe=False):
    """The sharding tests' MLP: d1 (256->512, relu), d2 (512->16).

    Both kernels are large enough to shard (131072 and 8192 elements, above
    `shard_min_size`'s 4096); the biases (512, 16) stay whole.
    """
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((256,))
    x = inputs
    if probe:
        import split_probe

        x = split_probe.probe()(x)
    x = keras.layers.Dense(512, activation="relu", name="d1")(x)
    outputs = keras.layers.Dense(16, name="d2")(x)
    return model_class(inputs=inputs, outputs=outputs, name=name)


def wide_data(n=512, seed=0):
    """Inputs and targets for `wide_mlp`."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 256)).astype("float32")
    y = rng.normal(size=(n, 16)).astype("float32")
    return x, y


def regression_data(n=1003, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype("float32")
    y = rng.normal(size=(n, 8)).astype("float32")
    return x, y


def interrupt_at(epoch, batch, error=None):
    """A callback that raises at `(epoch, batch)`: a run stopped half way.

    Args:
        epoch: the epoch (from 0).
        batch: the batch of that epoch (from 0), raised at its end.
        error: the exception to raise; default `RuntimeError("interrupted")`.

    Returns:
        A `keras.callbacks.Callback`.
    """
    import keras

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, current, logs=None):
            self.epoch = current

        def on_train_batch_end(self, current, logs=None):
            if (self.epoch, current) == (epoch, batch):
                raise error if error is not None else RuntimeError("interrupted")

    return Interrupt()


def weights_of(model):
    import keras

    return [np.array(keras.ops.convert_to_numpy(v.value)) for v in model.weights]


def max_relative_difference(a_weights, b_weights, noise_floor=0.0):
    """The largest of |a - b| / max|a| over the variables.

    Fails (rather than passing vacuously) on no variables or on lists of
    different lengths.

    Args:
        a_weights: the reference arrays.
        b_weights: the arrays to compare, in the same order.
        noise_floor: a variable whose values all stay below this fraction
            of the largest reference weight is compared at that scale: a
            conv bias before a BatchNorm has a zero gradient in exact
            arithmetic and holds only rounding noise, which no relative
            measure of its own fits. 0 (default): every variable at its own.
    """
    a_weights, b_weights = list(a_weights), list(b_weights)
    assert a_weights, "no weights to compare"
    assert len(a_weights) == len(b_weights), (len(a_weights), len(b_weights))
    floor = noise_floor * max(float(np.max(np.abs(a))) for a in a_weights)
    worst = 0.0
    for a, b in zip(a_weights, b_weights, strict=True):
        a = np.asarray(a, dtype="float64")
        b = np.asarray(b, dtype="float64")
        scale = max(float(np.max(np.abs(a))), floor, 1e-12)
        worst = max(worst, float(np.max(np.abs(a - b))) / scale)
    return worst


def sharding_ops(model, x, y):
    """The sharding constraints in the lowered JAX train step, as text lines."""
    import jax

    from keras_parallel.run.run import Run

    binding = binding_of(model)
    with Run(binding, model):
        state = model._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        lowered = jax.jit(model.train_step).lower(state, (x, y))
    return [
        line
        for line in lowered.as_text().splitlines()
        if "sharding_constraint" in line or "@Sharding" in line
    ]


def slow_writes(seconds=0.5):
    """From now on this process's `save` and `save_weights` land `seconds`
    late, as on a slow file system: another process that returned before
    they were written would not find the files."""
    import time

    import keras

    for name in ("save", "save_weights"):
        write = getattr(keras.Model, name)

        def late(self, *args, _write=write, **kwargs):
            time.sleep(seconds)
            return _write(self, *args, **kwargs)

        setattr(keras.Model, name, late)
