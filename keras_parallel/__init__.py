"""keras-parallel: plain `model.fit` on every device, on every Keras backend.

The public names are imported on first use, so `import keras_parallel` (and the
`keras-parallel` command) imports neither Keras nor a backend, and the backend
can still be chosen after it. Once Keras is imported, torch on Keras 3.15 gets
`keras.distribution.list_devices()`, and a process a cluster's launcher started
joins the others (`cluster_join`).
"""

import importlib

from keras_parallel import keras_config

__version__ = "0.1.0"

_EXPORTS = {
    "Auto": "keras_parallel.auto.auto",
    "ChiefWriteError": "keras_parallel.errors",
    "DataParallel": "keras_parallel.distribution",
    "DistributedModel": "keras_parallel.model",
    "ModelParallel": "keras_parallel.distribution",
    "PREEMPTED_EXIT_CODE": "keras_parallel.persistence.preemption",
    "Preempted": "keras_parallel.persistence.preemption",
    "launch": "keras_parallel.launcher",
    "ShardingCallback": "keras_parallel.callback",
    "ShardingError": "keras_parallel.errors",
    "ShardingWarning": "keras_parallel.errors",
    "UnmatchedLayoutKeyWarning": "keras_parallel.errors",
    "describe": "keras_parallel.report",
    "restore_checkpoint": "keras_parallel.persistence.checkpoints",
    "split_cpu": "keras_parallel.backends.tensorflow.devices",
    "ThroughputMonitor": "keras_parallel.throughput",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'keras_parallel' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)


def _provide_list_devices():
    """Keras 3.15 on torch: `keras.distribution.list_devices()` as in 3.16.

    Run once Keras is imported, so that a mesh written as for JAX
    (`DeviceMesh(..., devices=keras.distribution.list_devices())`) runs on
    torch before any other keras_parallel code (see
    `keras_parallel.backends.torch.distribution_lib`).
    """
    import keras

    if keras.backend.backend() != "torch" or _importing_torch_backend():
        # A torch backend module whose list of internals imported Keras is
        # half made: the torch executor provides them when it is imported.
        return
    from keras_parallel.errors import UnsupportedKerasError

    try:
        from keras_parallel.backends.torch import distribution_lib

        distribution_lib.provide()
    except UnsupportedKerasError:
        # A Keras whose internals keras_parallel does not know: importing
        # Keras must still work; the error comes when a distribution is used.
        pass


def _join_cluster():
    """JAX and TensorFlow: joins the other processes of a cluster's job.

    Run once Keras is imported, before the script's first Keras call: JAX
    fixes a one-process runtime at its first device query
    (`keras.distribution.DataParallel()` asks for devices), TensorFlow its
    collectives when it first runs anything (a model's first variable), and
    an unchanged script makes either soon after importing Keras, before any
    keras_parallel code runs. torch joins when its first entry point starts
    its process group (`backends/torch/group.py`). The rules (the opt-out,
    child processes, errors, the exit of a failing process) are
    `keras_parallel.cluster_environments.join`'s.
    """
    import keras

    from keras_parallel.cluster_environments import join as cluster_join

    backend = keras.backend.backend()
    if backend == "tensorflow" and _importing_backend("tensorflow"):
        # A module of the backend whose import imported Keras is half made,
        # and `workers` imports it: the bootstrap or the executor makes the
        # strategy then (`workers.initialize_from_environment`).
        return
    cluster_join.join(backend)


def _importing_torch_backend():
    """Whether a module of the torch backend is being imported right now."""
    return _importing_backend("torch")


def _importing_backend(backend):
    """Whether a module of `backend`'s folder is being imported right now."""
    import sys

    return any(
        name.startswith(f"keras_parallel.backends.{backend}.")
        and getattr(getattr(module, "__spec__", None), "_initializing", False)
        for name, module in list(sys.modules.items())
    )


keras_config.after_keras_import(_provide_list_devices)
keras_config.after_keras_import(_join_cluster)
