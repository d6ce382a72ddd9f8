"""`keras.distribution.list_devices()` on torch, with Keras 3.15 too.

`provide()` gives Keras 3.15, which has no torch `distribution_lib`, this one:
Keras 3.16's `list_devices` and `get_device_count` only. With `num_processes`
and `process_id` Keras would split the data per process, where keras_parallel
splits each global batch itself.
"""

import os
import sys

import torch
import torch.distributed as dist

from keras_parallel.backends.torch.keras_compat import get_device, keras_distribution
from keras_parallel.keras_seam.replacements import Replacements

# Never restored, as a Keras that has these functions keeps its own.
_provided = Replacements()


def provide():
    """Makes this module Keras's torch `distribution_lib` where it has none.

    Returns True if Keras's `list_devices` now reaches this module.
    """
    if keras_distribution.distribution_lib is None:
        _provided.replace(keras_distribution, "distribution_lib", sys.modules[__name__])
    return keras_distribution.distribution_lib is sys.modules[__name__]


def _device_type(device):
    # Keras names a GPU "gpu" or "cuda": torch's name is "cuda".
    return device.lower().replace("gpu", "cuda").split(":")[0]


def list_devices(device_type=None):
    """The devices of one type (default: Keras's), as Keras 3.16 lists them.

    `["gpu:0", ...]` for CUDA: one per process under a process group or
    torchrun's `WORLD_SIZE`.
    """
    resolved = _device_type(device_type or get_device())
    name = "gpu" if resolved == "cuda" else resolved
    return [f"{name}:{i}" for i in range(get_device_count(device_type))]


def get_device_count(device_type=None):
    """How many devices of a type there are, as Keras 3.16 counts them.

    One per process under a process group or torchrun's `WORLD_SIZE` (0 for
    another device type), else the local devices of that type.
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
