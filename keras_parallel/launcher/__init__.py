"""Starting one process per device, and the `keras-parallel launch` command.

- `processes`: `launch(fn, num_processes)` from Python or a notebook.
- `cli`: `keras-parallel launch`, over `torch.distributed.run` (torchrun).
"""

from keras_parallel.launcher.processes import (
    ProcessFailedError,
    RemoteTraceback,
    free_port,
    launch,
)

__all__ = ["ProcessFailedError", "RemoteTraceback", "free_port", "launch"]
