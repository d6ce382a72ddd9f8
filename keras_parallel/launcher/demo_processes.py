"""How many processes `keras-parallel demo` trains in, per backend.

A command-line choice, so it lives with the launcher, not the executors: a
backend that runs a process per device gets their count; one that needs
set-up before its runtime starts (TensorFlow's logical devices) gets it here.
"""


def demo_processes(backend, num_devices):
    """The number of processes to start on `backend` (1: train in this one;
    above 1, the demo starts them with `keras_parallel.launch`), with
    `num_devices` devices simulated where there is no accelerator.

    Raises:
        RuntimeError: TensorFlow's runtime already started with fewer devices.
    """
    if backend == "torch":
        return _torch_processes(num_devices)
    if backend == "tensorflow":
        import tensorflow as tf

        from keras_parallel.backends.tensorflow import devices

        if not tf.config.list_physical_devices("GPU"):
            devices.split_cpu(num_devices)
    return 1


def _torch_processes(num_devices):
    # Under torchrun (a group set up by the environment) every rank runs the
    # demo itself; else one process per GPU, or per simulated device.
    import torch

    from keras_parallel.backends.torch import group

    if group.env_world_size() > 1 or group.is_distributed():
        return 1
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return num_devices
