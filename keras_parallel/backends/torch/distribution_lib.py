"""`keras.distribution.list_devices()` on torch, with Keras 3.15 too.

Keras 3.15 has no torch `distribution_lib`; `provide()` gives it this module,
whose `list_devices` and `get_device_count` are Keras 3.16's (docs/torch.md).
Only these two: with `num_processes` and `process_id`, Keras's `Distribution`
would split the data per process itself, where keras_parallel splits each
global batch on torch.
"""

import os
import sys

import torch
import torch.distributed as dist

from keras_parallel.backends.torch.keras_compat import get_device, keras_distribution
from keras_parallel.replacements import Replacements

# Never restored: the functions stay for the life of the process, as a Keras
# that has them keeps its own.
_provided = Replacements()


def provide():
    """Gives Keras these functions as its torch `distribution_lib`, once.

    Nothing where Keras has a torch `distribution_lib` of its own (3.16+).

    Returns:
        True if Keras's `list_devices` now reaches this module.
    """
    if keras_distribution.distribution_lib is None:
        _provided.replace(keras_distribution, "distribution_lib", sys.modules[__name__])
    return keras_distribution.distribution_lib is sys.modules[__name__]


def _device_type(device):
    # Keras names a GPU "gpu" or "cuda": torch's name is "cuda".
    return device.lower().replace("gpu", "cuda").split(":")[0]


def list_devices(device_type=None):
    """The devices of one type, as Keras 3.16's torch backend lists them.

    Args:
        device_type: `"cpu"`, `"gpu"` or `"cuda"`; defaults to the device
            Keras computes on.

    Returns:
        `["cpu:0", "cpu:1", ...]` (`"gpu:i"` for CUDA): one device per
        process under a process group or torchrun's `WORLD_SIZE`.
    """
    resolved = _device_type(device_type or get_device())
    name = "gpu" if resolved == "cuda" else resolved
    return [f"{name}:{i}" for i in range(get_device_count(device_type))]


def get_device_count(device_type=None):
    """How many devices of a type there are, as Keras 3.16 counts them.

    Args:
        device_type: `"cpu"`, `"gpu"` or `"cuda"`; defaults to the device
            Keras computes on.

    Returns:
        The number of processes under a process group or torchrun's
        `WORLD_SIZE` (one device each; 0 for another device type), else
        the local devices of that type.
    """
    device_type = device_type.lower() if device_type else None
    if dist.is_initialized() or "WORLD_SIZE" in os.environ:
        actual = _device_type(get_device())
        if device_type in (None, "cpu", actual) or (
            device_type == "gpu" and actual == "cuda"
        ):
            if dist.is_initialized():
                return dist.get_world_size()
            return int(os.environ.get("WORLD_SIZE", 1))
        return 0
    resolved = _device_type(device_type or get_device())
    if resolved == "cuda":
        return torch.cuda.device_count()
    if resolved == "mps":
        return 1
    if resolved == "xpu" and hasattr(torch, "xpu"):
        return torch.xpu.device_count()
    return 1 if resolved == "cpu" else 0
