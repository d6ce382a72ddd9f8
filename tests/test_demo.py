"""The demo: the Keras guide's convnet learns the digits on every device."""

import keras
import numpy as np
import pytest

from keras_parallel import demo


def test_digits_are_upsampled_to_mnist_shape():
    (x_train, y_train), (x_test, y_test) = demo.load_digits_28()
    assert x_train.shape[1:] == (28, 28, 1) and x_train.dtype == np.float32
    assert len(x_train) + len(x_test) == 1797
    assert 0.0 <= x_train.min() and x_train.max() <= 255.0
    assert set(np.unique(y_train)) == set(range(10))


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX: 8 simulated devices")
@pytest.mark.slow
def test_convnet_reaches_ninety_percent_under_data_parallel_on_eight_devices():
    assert len(keras_parallel_devices()) == 8
    assert demo.run(verbose=0) >= 0.90


def keras_parallel_devices():
    import keras_parallel

    return keras_parallel.DataParallel().device_mesh.devices.flatten()
