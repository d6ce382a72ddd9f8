"""The global batch, seen from one rank: its rows and its identity.

Every rank iterates the same global batches; these helpers say which rows a
rank computes, cut them out of any nest of arrays, and give a cheap checksum
that lets the ranks check they are looking at the same batch.
"""

import numpy as np
import torch

from keras_parallel.backends.torch.keras_compat import tree


def split_rows(rows, world_size, rank):
    """The rows of a global batch that one rank computes.

    Args:
        rows: the global batch size `B`.
        world_size: the number of ranks `W`.
        rank: this rank.

    Returns:
        `(start, stop, whole)`: the row range, and whether every rank
        computes the whole batch (`B < W`).

    Example:

    >>> split_rows(43, 2, 1)
    (22, 43, False)
    """
    if rows < world_size:
        return 0, rows, True
    base, extra = divmod(rows, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0), False


def batch_rows(data):
    """The number of rows of a batch: the first dimension of its first input."""
    for leaf in tree.flatten(data):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape):
            return int(shape[0])
    return None


def slice_rows(data, rows, start, stop):
    """Every array of `data` with `rows` rows, cut to `[start, stop)`."""

    def cut(leaf):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) and int(shape[0]) == rows:
            return leaf[start:stop]
        return leaf

    return tree.map_structure(cut, data)


def checksum(data):
    """A float64 sum of the first input of a batch (cheap data identity)."""
    for leaf in tree.flatten(data):
        if isinstance(leaf, torch.Tensor):
            return float(leaf.detach().sum(dtype=torch.float64))
        if isinstance(leaf, np.ndarray) and leaf.dtype != object:
            return float(np.sum(leaf, dtype=np.float64))
    return 0.0


def check_same_batches(extra, rank, rows):
    """Raises if the ranks saw global batches of different sizes or contents.

    Args:
        extra: the sums over ranks of `[1, rows, rows**2, check, check**2]`.
        rank: this rank.
        rows: the rows this rank saw since the last check.
    """
    ranks, total, squares, check, check_squares = extra
    sizes_differ = abs(ranks * squares - total * total) > 0.5
    spread = ranks * check_squares - check * check
    data_differ = spread > 1e-9 * max(1.0, check * check)
    if sizes_differ or data_differ:
        what = "sizes" if sizes_differ else "contents"
        raise ValueError(
            f"The ranks received global batches of different {what} in the "
            f"same steps (rank {rank} had {rows:g} rows; mean over ranks "
            f"{total / ranks:g}). Every rank must iterate the same data in "
            "the same order: give each process the whole data set (not a "
            "per-rank shard) with the same length; keras_parallel slices "
            "each global batch itself."
        )
