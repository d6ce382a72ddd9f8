"""Per-backend executors of a `ShardingPlan`, one subpackage per backend.

Everything one backend needs lives in its own folder (`jax/`, `torch/`,
`tensorflow/`), with `base.py` the contract they share. Only the executor of the running Keras backend is imported, and only when a
distribution is first given: importing keras_parallel imports no backend
library of its own.
"""

import importlib

import numpy as np

from keras_parallel.plan.sharding_plan import resolve_plan

_MODULES = {
    "jax": ("keras_parallel.backends.jax.executor", "JaxExecutor"),
    "torch": ("keras_parallel.backends.torch.executor", "TorchExecutor"),
    "tensorflow": ("keras_parallel.backends.tensorflow.executor", "TensorFlowExecutor"),
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
    if backend is None:
        # Imported here: the launcher imports this package before any
        # backend may start (the JAX runtime must be first).
        import keras

        backend = keras.backend.backend()
    if backend not in _MODULES:
        raise NotImplementedError(
            f"keras_parallel has no executor for the {backend!r} backend. "
            f"Received: KERAS_BACKEND={backend!r}; use one of "
            f"{sorted(_MODULES)}."
        )
    module_name, class_name = _MODULES[backend]
    return getattr(importlib.import_module(module_name), class_name)


def resolve_plan_for(distribution, model, executor=None):
    """The validated plan of `distribution` for `model`, applied to nothing.

    Args:
        distribution: a `keras.distribution.Distribution`.
        model: a built `keras.Model`.
        executor: the executor whose devices the plan names. Defaults to a
            new one of the running backend.

    Returns:
        A `ShardingPlan`.

    Raises:
        ShardingError: the distribution does not fit the model.
    """
    if executor is None:
        executor = executor_class()(distribution)
    mesh_devices = np.asarray(distribution.device_mesh.devices).flat
    return resolve_plan(
        distribution,
        model,
        device_names=executor.device_names(list(mesh_devices)),
        available_devices=executor.list_devices(),
    )
