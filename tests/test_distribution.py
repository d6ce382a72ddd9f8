"""keras_parallel.DataParallel(): every local device, on every backend."""

import keras
import pytest

import keras_parallel


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX devices")
def test_data_parallel_spans_all_jax_devices():
    distribution = keras_parallel.DataParallel()
    assert isinstance(distribution, keras.distribution.DataParallel)
    assert distribution.device_mesh.shape == (8,)
    assert distribution.batch_dim_name == "batch"


def test_given_devices_are_kept_as_keras_does():
    devices = ["cpu:0", "cpu:1"]
    distribution = keras_parallel.DataParallel(devices=devices)
    assert list(distribution.device_mesh.devices) == devices
