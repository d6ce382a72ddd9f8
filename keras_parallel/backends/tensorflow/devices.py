"""TensorFlow devices: what `DataParallel()` spans, and logical CPU devices.

Split logical CPU devices let a `MirroredStrategy` (the tests, the demo)
run data parallel without a GPU; the split must come before TensorFlow starts.
"""

import tensorflow as tf


def local_devices():
    """The device names one `DataParallel()` with no argument spans: the
    local GPUs (`["gpu:0", "gpu:1"]`), else the logical CPU devices."""
    gpus = tf.config.list_logical_devices("GPU")
    devices = gpus or tf.config.list_logical_devices("CPU")
    return [normalize(d.name) for d in devices]


def normalize(device):
    """A device name, or an object with a `name`, as `local_devices` writes
    it: `"/job:localhost/replica:0/task:0/device:CPU:1"` as `"cpu:1"`."""
    name = getattr(device, "name", device)
    name = str(name).rsplit("device:", 1)[-1]
    return name.lstrip("/").lower()


def split_cpu(num_devices):
    """Splits the host CPU into `num_devices` logical TensorFlow devices.

    Call it before TensorFlow runs anything (creating a tensor starts the
    runtime); later calls that ask for no more devices than exist are no-ops.

    Args:
        num_devices: how many logical CPU devices to make.

    Returns:
        The logical CPU device names, `["cpu:0", ...]`.

    Raises:
        RuntimeError: the runtime already started with fewer CPU devices.

    Example:

    >>> split_cpu(4)          # before any other TensorFlow work
    ['cpu:0', 'cpu:1', 'cpu:2', 'cpu:3']
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(cpu)
    if configured is None or len(configured) < num_devices:
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices
            )
        except RuntimeError as error:
            existing = tf.config.list_logical_devices("CPU")
            if len(existing) < num_devices:
                raise RuntimeError(
                    f"Cannot split the CPU into {num_devices} logical devices: "
                    "the TensorFlow runtime already started. Received: "
                    f"{len(existing)} logical CPU devices exist; call "
                    "split_cpu() before any TensorFlow op runs (at the top of "
                    "the program, or in conftest.py for tests)."
                ) from error
    return [normalize(d.name) for d in tf.config.list_logical_devices("CPU")]
