"""Starting one process per device, and the `keras-parallel launch` command.

The launcher depends on the backends (each process is set up through its
backend's runtime), never the reverse.

- `torch_processes`: `launch(fn, num_processes)` from Python or a notebook
  (torch), rank-ordered results, the failing rank named.
- `command`: `keras-parallel launch`, for every backend (torch through
  torchrun; JAX and TensorFlow through `jax_processes`, `tf_processes`).
- `local_processes`, `supervisor`, `bootstrap`: what the JAX and TensorFlow
  launches share: options, supervision, and the start of each process.
- `checks`, `ports`: refusals before anything starts; free ports.
"""

from keras_parallel.launcher.ports import free_port
from keras_parallel.launcher.torch_processes import (
    ProcessFailedError,
    RemoteTraceback,
    launch,
)

__all__ = ["ProcessFailedError", "RemoteTraceback", "free_port", "launch"]
