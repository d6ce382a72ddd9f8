"""`keras-parallel demo`: the Keras guide's convnet, trained on every device.

The convnet of the guide "Multi-GPU distributed training with JAX", trained
with `DataParallel()` on scikit-learn's digits (real data, no network needed).
The tests and benchmarks use the same functions.
"""

import os

import numpy as np


def get_model(model_class=None, name="convnet"):
    """The Keras guide's convnet, a functional model: 28x28x1 in, 10 logits out.

    Args:
        model_class: the class to build it with (default `keras.Model`), e.g.
            a `DistributedModel` subclass.
    """
    import keras

    model_class = model_class or keras.Model
    inputs = keras.Input(shape=(28, 28, 1))
    x = keras.layers.Rescaling(1.0 / 255.0)(inputs)
    x = keras.layers.Conv2D(filters=12, kernel_size=3, padding="same", use_bias=False)(
        x
    )
    x = keras.layers.BatchNormalization(scale=False, center=True)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(filters=24, kernel_size=6, use_bias=False, strides=2)(x)
    x = keras.layers.BatchNormalization(scale=False, center=True)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(
        filters=32, kernel_size=6, padding="same", strides=2, name="large_k"
    )(x)
    x = keras.layers.BatchNormalization(scale=False, center=True)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(256, activation="relu")(x)
    x = keras.layers.Dropout(0.5)(x)
    outputs = keras.layers.Dense(10)(x)
    return model_class(inputs=inputs, outputs=outputs, name=name)


def load_digits_28(test_fraction=0.25, seed=0):
    """scikit-learn's 8x8 digits upsampled to 28x28x1 float32 images in [0, 255].

    Args:
        test_fraction: the share of samples held out for testing.
        seed: the seed of the train/test shuffle.

    Returns:
        `((x_train, y_train), (x_test, y_test))`; labels are int32 class ids.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.astype("float32") * (255.0 / 16.0)
    x = _upsample(images, 28)[..., None]
    y = digits.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = int(len(x) * test_fraction)
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def _upsample(images, size):
    """Bilinear resize of `(n, h, w)` images to `(n, size, size)`, in NumPy."""
    n, h, w = images.shape
    rows = np.linspace(0, h - 1, size)
    cols = np.linspace(0, w - 1, size)
    r0 = np.floor(rows).astype(int)
    c0 = np.floor(cols).astype(int)
    r1 = np.minimum(r0 + 1, h - 1)
    c1 = np.minimum(c0 + 1, w - 1)
    fr = (rows - r0)[None, :, None]
    fc = (cols - c0)[None, None, :]
    top = images[:, r0][:, :, c0] * (1 - fc) + images[:, r0][:, :, c1] * fc
    bottom = images[:, r1][:, :, c0] * (1 - fc) + images[:, r1][:, :, c1] * fc
    return (top * (1 - fr) + bottom * fr).astype("float32")


def run(epochs=30, batch_size=32, seed=1, verbose=2):
    """Trains the convnet on digits under `DataParallel()`; returns test accuracy.

    `batch_size` is the global batch size; `verbose` is `fit`'s.
    """
    import keras

    import keras_parallel

    class Net(keras_parallel.DistributedModel, keras.Model):
        pass

    keras.utils.set_random_seed(seed)
    (x_train, y_train), (x_test, y_test) = load_digits_28()
    distribution = keras_parallel.DataParallel()
    model = get_model(Net)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        distribution=distribution,
    )
    monitor = keras_parallel.ThroughputMonitor()
    history = model.fit(
        x_train,
        y_train,
        batch_size=batch_size,
        epochs=epochs,
        verbose=verbose,
        callbacks=[monitor],
    )
    if os.environ.get("RANK", "0") == "0":  # One line, from the first process.
        logs = {key: values[-1] for key, values in history.history.items()}
        if "samples_per_second" in logs:
            print(
                f"Throughput (last epoch): {logs['samples_per_second']:.0f} "
                f"samples/s, {logs['samples_per_second_per_device']:.0f} per "
                f"device, {logs['step_time_ms']:.1f} ms a step"
            )
    _, accuracy = model.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)
    return float(accuracy)
