"""One collective over many tensors, flattened into one buffer and copied back.

One collective per tensor would cost a round trip each. The buffer lives on
the process group's device: NCCL takes CUDA tensors only.
"""

import torch
import torch.distributed as dist

from keras_parallel.backends.torch import group as torch_group


def on_group_device(tensor):
    """`tensor` on the device the process group's collectives take."""
    if torch_group.device_type() == "cuda":
        return tensor.to(torch.device("cuda", torch.cuda.current_device()))
    return tensor


def _packed(tensors):
    return on_group_device(torch.cat([t.detach().reshape(-1) for t in tensors]))


@torch.no_grad()
def _unpack(flat, tensors):
    offset = 0
    for tensor in tensors:
        n = tensor.numel()
        tensor.copy_(flat[offset : offset + n].view_as(tensor))
        offset += n


def broadcast_flat(tensors, src=0):
    """Gives every rank rank `src`'s values of `tensors` (one dtype), in place."""
    tensors = list(tensors)
    if not tensors:
        return
    flat = _packed(tensors)
    dist.broadcast(flat, src=src)
    _unpack(flat, tensors)


def mean_flat(tensors, world_size):
    """Makes each of `tensors` (one floating dtype) its mean over the ranks."""
    tensors = list(tensors)
    if not tensors:
        return
    flat = _packed(tensors)
    dist.all_reduce(flat)
    flat /= world_size
    _unpack(flat, tensors)
