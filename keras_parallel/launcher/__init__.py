"""Starting one process per device, and the `keras-parallel launch` command.

`torch_processes` has `launch(fn, num_processes)` for Python or a notebook
(torch). `command` is `keras-parallel launch` for every backend: torch through
torchrun, JAX and TensorFlow through `jax_processes` and `tf_processes`, which
share `local_processes`, `supervisor` and `bootstrap`. The launcher depends on
the backends, never the reverse.
"""

from keras_parallel.launcher.ports import free_port
from keras_parallel.launcher.torch_processes import (
    ProcessFailedError,
    RemoteTraceback,
    launch,
)

__all__ = ["ProcessFailedError", "RemoteTraceback", "free_port", "launch"]
