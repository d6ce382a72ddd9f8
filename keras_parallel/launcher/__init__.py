"""Starting one process per device: `launch` and `keras-parallel launch`.

`launch` (torch) runs a function from Python or a notebook; `command` is
`keras-parallel launch`, for every backend. The launcher depends on the
backends, never the reverse.
"""

from keras_parallel.launcher.ports import free_port
from keras_parallel.launcher.torch_processes import (
    ProcessFailedError,
    RemoteTraceback,
    launch,
)

__all__ = ["ProcessFailedError", "RemoteTraceback", "free_port", "launch"]
