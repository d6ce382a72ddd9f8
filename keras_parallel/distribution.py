"""`DataParallel()` that spans every local device, on every backend."""

import keras

from keras_parallel.executors import executor_class


class DataParallel(keras.distribution.DataParallel):
    """`keras.distribution.DataParallel` that finds the devices on any backend.

    With no argument it spans every device the backend offers for data
    parallelism: the JAX devices, the processes of a torch process group (one
    device each), the TensorFlow GPUs or logical CPUs. Keras's own class
    cannot list devices on torch. Given `device_mesh` or `devices`, it is
    exactly Keras's class.

    Args:
        device_mesh: optional 1D `keras.distribution.DeviceMesh`.
        devices: optional list of devices.
        auto_shard_dataset: shard a `tf.data.Dataset` among processes.

    Example:

    >>> model.compile(optimizer="sgd", loss="mse",
    ...               distribution=keras_parallel.DataParallel())
    """

    def __init__(self, device_mesh=None, devices=None, auto_shard_dataset=True):
        if device_mesh is None and not devices:
            devices = executor_class().list_devices()
        super().__init__(
            device_mesh=device_mesh,
            devices=devices,
            auto_shard_dataset=auto_shard_dataset,
        )
