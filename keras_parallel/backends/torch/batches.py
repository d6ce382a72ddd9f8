"""The global batch, seen from one rank: its rows and its identity.

Every rank iterates the same global batches; these helpers say which rows a
rank computes, cut them out of any nest of arrays, give the size of the data
an epoch iterates (which the ranks compare before the epoch starts), and a
cheap checksum that lets the ranks check they are looking at the same batch.
"""

import numpy as np
import torch
import torch.distributed as dist

from keras_parallel.backends.torch.keras_compat import ArrayDataAdapter, tree


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
    """A float64 sum of the first input of a batch (cheap data identity): a
    tensor where the input is a tensor, left on its device (read on the
    host only when the ranks compare their sums, `MetricStates.verify`)."""
    for leaf in tree.flatten(data):
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().sum(dtype=torch.float64)
        if isinstance(leaf, np.ndarray) and leaf.dtype != object:
            return float(np.sum(leaf, dtype=np.float64))
    return 0.0


def data_size(iterator):
    """The size of the data one rank is about to iterate for an epoch.

    Args:
        iterator: Keras's epoch iterator (`TorchEpochIterator`).

    Returns:
        `[rows, steps, batch_size, last_batch]` as ints, -1 where unknown:
        the rows of the data (arrays only), the steps of the epoch
        (`steps_per_epoch`, else the batches of the data), the batch size,
        and the size of the last batch.

    Example: 1003 rows of arrays in batches of 64 give
    `[1003, 16, 64, 43]`; a generator gives `[-1, -1, -1, -1]`.
    """
    adapter = getattr(iterator, "data_adapter", None)
    steps = _known(lambda: iterator.num_batches)
    batches = _known(lambda: adapter.num_batches)
    batch_size = _known(lambda: adapter.batch_size)
    partial = _known(lambda: adapter.partial_batch_size)
    last = partial or batch_size
    rows = None
    if isinstance(adapter, ArrayDataAdapter) and None not in (batches, batch_size):
        rows = (batches - 1) * batch_size + last if batches else 0
    return [-1 if v is None else v for v in (rows, steps, batch_size, last)]


def _known(read):
    # Adapters without a size raise NotImplementedError or return None.
    try:
        value = read()
    except (NotImplementedError, AttributeError, TypeError):
        return None
    return int(value) if isinstance(value, (int, np.integer)) else None


def check_same_data(sizes):
    """Raises the same `ValueError` on every rank if their data differ in size.

    Args:
        sizes: one `data_size` per rank, in rank order (all ranks hold the
            same list, gathered).

    Raises:
        ValueError: naming every rank's sizes.
    """
    if all(s == sizes[0] for s in sizes[1:]):
        return
    described = "; ".join(
        f"rank {rank}: {_describe_size(size)}" for rank, size in enumerate(sizes)
    )
    raise ValueError(
        "The ranks were given data of different sizes, but every rank must "
        "iterate the same global batches (keras_parallel splits each batch "
        f"over the ranks itself). Received: {described}; give every process "
        "the whole data set (the same data, not a per-rank shard), with the "
        "same batch_size and steps."
    )


def _describe_size(size):
    """`"1003 rows, 16 steps of batch_size 64 (the last 43 rows)"`."""
    rows, steps, batch_size, last = (None if v < 0 else v for v in size)
    parts = [f"{rows} rows" if rows is not None else "rows unknown"]
    steps_text = f"{steps} steps" if steps is not None else "steps unknown"
    if batch_size is not None:
        steps_text += f" of batch_size {batch_size}"
        if last is not None and last != batch_size:
            steps_text += f" (the last {last} rows)"
    parts.append(steps_text)
    return ", ".join(parts)


def batch_spreads(sums):
    """How far the ranks' batches differ, from the sums over the ranks of
    `[1, rows, rows**2, check, check**2]`: `[rows spread, check spread]`,
    each positive where some rank differs (a tensor, on `sums`' device:
    nothing is read on the host)."""
    ranks, total, squares, check, check_squares = sums
    rows_spread = ranks * squares - total * total - 0.5
    one = torch.ones_like(check)
    check_spread = (
        ranks * check_squares - check * check - 1e-9 * torch.maximum(one, check * check)
    )
    return torch.stack([rows_spread, check_spread])


def check_same_batches(spreads, rank, rows, mean_rows):
    """Raises if the ranks saw global batches of different sizes or contents.

    Args:
        spreads: the largest `batch_spreads` since the last check, on the
            host.
        rank: this rank.
        rows: the rows this rank saw since the last check.
        mean_rows: the mean of that over the ranks.
    """
    sizes_differ, data_differ = (spread > 0 for spread in spreads)
    if sizes_differ or data_differ:
        what = "sizes" if sizes_differ else "contents"
        raise ValueError(
            f"The ranks received global batches of different {what} in the "
            f"same steps (rank {rank} had {rows:g} rows; mean over ranks "
            f"{mean_rows:g}). Every rank must iterate the same data in "
            "the same order: give each process the whole data set (not a "
            "per-rank shard) with the same length; keras_parallel slices "
            "each global batch itself."
        )


def gathered_rows(tensor, rows, world_size):
    """Every rank's rows of `tensor` (its outputs for its rows of a global
    batch of `rows` rows, as `split_rows` gives them), in rank order: the
    global batch's, on every rank.

    Args:
        tensor: this rank's outputs (anything else, or a scalar, is
            returned as it is).
        rows: the global batch's rows.
        world_size: the number of ranks.

    Returns:
        The outputs of the whole batch.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.ndim:
        return tensor
    sizes = [
        stop - start
        for start, stop, _ in (
            split_rows(rows, world_size, r) for r in range(world_size)
        )
    ]
    width = max(sizes)
    padded = tensor.new_zeros((width,) + tuple(tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])
