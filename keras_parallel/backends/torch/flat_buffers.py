"""One collective over many tensors, flattened into one buffer and copied back.

One collective per tensor would cost a round trip each. The buffer lives on
the process group's device: NCCL takes CUDA tensors only.
"""

import torch
import torch.distributed as dist

from keras_parallel.backends.torch import group as torch_group
from keras_parallel.messages import wire


def on_group_device(tensor):
    """`tensor` on the device the process group's collectives take."""
    if torch_group.device_type() == "cuda":
        return tensor.to(torch.device("cuda", torch.cuda.current_device()))
    return tensor


def _packed(tensors):
    return on_group_device(torch.cat([t.detach().reshape(-1) for t in tensors]))


@torch.no_grad()
def unpack_flat(flat, tensors):
    """Copies `flat`'s consecutive pieces into `tensors`, each cast to its dtype."""
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
    unpack_flat(flat, tensors)


def broadcast_bytes(payload, src=0):
    """Rank `src`'s `payload` (bytes) on every rank: its length, then it."""
    return scatter_bytes([payload] * dist.get_world_size(), src)


def scatter_bytes(pieces, src=0):
    """This rank's piece of rank `src`'s `pieces` (one `bytes` per rank).

    Two collectives: every piece's length, then the pieces padded to the
    longest (a scatter takes equal tensors).
    """
    world = dist.get_world_size()
    rank = dist.get_rank()
    lengths = torch.zeros(world, dtype=torch.int64)
    if rank == src:
        lengths = torch.tensor([len(p) for p in pieces], dtype=torch.int64)
    lengths = on_group_device(lengths)
    dist.broadcast(lengths, src=src)
    lengths = [
        wire.checked_length(n, f"a piece broadcast by rank {src}")
        for n in lengths.cpu().tolist()
    ]
    longest = max(max(lengths), 1)
    rows = None
    if rank == src:
        rows = [on_group_device(_padded(piece, longest)) for piece in pieces]
    received = on_group_device(torch.empty(longest, dtype=torch.uint8))
    dist.scatter(received, rows, src=src)
    return received.cpu().numpy()[: lengths[rank]].tobytes()


def _padded(piece, length):
    row = torch.zeros(length, dtype=torch.uint8)
    if piece:
        row[: len(piece)] = torch.frombuffer(bytearray(piece), dtype=torch.uint8)
    return row


def mean_flat(tensors, world_size):
    """Makes each of `tensors` (one floating dtype) its mean over the ranks."""
    tensors = list(tensors)
    if not tensors:
        return
    flat = _packed(tensors)
    dist.all_reduce(flat)
    flat /= world_size
    unpack_flat(flat, tensors)
