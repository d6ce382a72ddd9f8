"""Logical CPU devices for the TensorFlow tests.

TensorFlow fixes its devices when its runtime starts, once per process, so
the CPU is split once, before any test module imports TensorFlow:
`tests/conftest.py` calls `setup()` on the tensorflow backend. Four devices
serve every test: a test that wants two builds its `DataParallel` over
`devices(2)`.

Only conftest and the TensorFlow test modules import this file, after
checking the backend.
"""

from keras_parallel.backends.tensorflow.devices import split_cpu

NUM_DEVICES = 4


def setup(num_devices=NUM_DEVICES):
    """Splits the CPU into `num_devices` logical devices (idempotent).

    Returns:
        The logical CPU device names.
    """
    return split_cpu(num_devices)


def devices(n):
    """The first `n` logical CPU device names, `["cpu:0", ...]`."""
    return [f"cpu:{i}" for i in range(n)]
