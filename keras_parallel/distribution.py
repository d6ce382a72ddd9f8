"""`DataParallel()` that spans every local device, on every backend."""

import keras

from keras_parallel.backends import executor_class


class DataParallel(keras.distribution.DataParallel):
    """`keras.distribution.DataParallel` that finds the devices on any backend.

    With no argument it spans every device the backend offers for data
    parallelism: the JAX devices, the processes of a torch process group (one
    device each), the TensorFlow GPUs or logical CPUs (Keras's own class
    lists `keras.distribution.list_devices()`, which on torch needs Keras
    3.16 or keras_parallel imported). Given `device_mesh` or `devices`, it
    is exactly Keras's class.

    Args:
        device_mesh: optional 1D `keras.distribution.DeviceMesh`.
        devices: optional list of devices.
        auto_shard_dataset: shard a `tf.data.Dataset` among processes.
        sync_batchnorm: torch: BatchNormalization uses the statistics of the
            whole global batch, as on JAX and TensorFlow (where it always
            does). Costs one all-reduce per BatchNorm layer and step.
        find_unused_parameters: torch: passed to `DistributedDataParallel`,
            for models whose forward pass skips some weights.

    Example:

    >>> model.compile(optimizer="sgd", loss="mse",
    ...               distribution=keras_parallel.DataParallel())
    """

    def __init__(
        self,
        device_mesh=None,
        devices=None,
        auto_shard_dataset=True,
        sync_batchnorm=False,
        find_unused_parameters=False,
    ):
        if device_mesh is None and not devices:
            devices = executor_class().list_devices()
        super().__init__(
            device_mesh=device_mesh,
            devices=devices,
            auto_shard_dataset=auto_shard_dataset,
        )
        self.sync_batchnorm = sync_batchnorm
        self.find_unused_parameters = find_unused_parameters
