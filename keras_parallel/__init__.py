"""keras-parallel: plain `model.fit` on every device, on every Keras backend.

Public API:

- `DistributedModel`: mixin; `compile(..., distribution=...)`.
- `ShardingCallback`: the same for a model you cannot subclass.
- `DataParallel`: `keras.distribution.DataParallel` over all local devices.
- `describe`: the sharding plan as a text table.
- `restore_checkpoint`: a `keras.callbacks.OrbaxCheckpoint` read back shard
  by shard into the model's layout (JAX).
- `launch`: run a function in N processes (torch), rank-ordered results.
- `ShardingError`: the error bad layouts raise (a `ValueError`).
- `split_cpu`: TensorFlow: split the CPU into N logical devices.

The names are imported on first use, so `import keras_parallel` (and the
`keras-parallel` command) imports neither Keras nor a backend: the backend
can still be chosen after it.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "DataParallel": "keras_parallel.distribution",
    "DistributedModel": "keras_parallel.model",
    "launch": "keras_parallel.launcher",
    "ShardingCallback": "keras_parallel.callback",
    "ShardingError": "keras_parallel.errors",
    "UnmatchedLayoutKeyWarning": "keras_parallel.errors",
    "describe": "keras_parallel.report",
    "restore_checkpoint": "keras_parallel.persistence.checkpoints",
    "split_cpu": "keras_parallel.backends.tensorflow.devices",
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
