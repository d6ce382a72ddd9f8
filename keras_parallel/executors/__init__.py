"""Per-backend executors of a `ShardingPlan`.

Only the executor of the running Keras backend is imported, and only when a
distribution is first given: importing keras_parallel imports no backend
library of its own.
"""

import importlib

import keras

_MODULES = {
    "jax": ("keras_parallel.executors.jax", "JaxExecutor"),
    "torch": ("keras_parallel.executors.torch", "TorchExecutor"),
    "tensorflow": ("keras_parallel.executors.tensorflow", "TensorFlowExecutor"),
}


def executor_class(backend=None):
    """The `Executor` subclass for a Keras backend.

    Args:
        backend: a Keras backend name. Defaults to `keras.backend.backend()`.

    Returns:
        The executor class.

    Raises:
        NotImplementedError: keras_parallel has no executor for the backend.
    """
    backend = backend or keras.backend.backend()
    if backend not in _MODULES:
        raise NotImplementedError(
            f"keras_parallel has no executor for the {backend!r} backend. "
            f"Received: KERAS_BACKEND={backend!r}; use one of "
            f"{sorted(_MODULES)}."
        )
    module_name, class_name = _MODULES[backend]
    return getattr(importlib.import_module(module_name), class_name)
