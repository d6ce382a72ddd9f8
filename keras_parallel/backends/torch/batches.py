"""The global batch seen from one rank: its rows, its size and its identity.

Every rank iterates the same global batches; these helpers cut a rank's rows
out, and let the ranks check cheaply that their data and batches agree.
"""

import numpy as np
import torch
import torch.distributed as dist

from keras_parallel.backends.torch.keras_compat import ArrayDataAdapter, tree


def split_rows(rows, world_size, rank):
    """`(start, stop, whole)`: one rank's rows of a batch of `rows` rows.

    `whole` when there are fewer rows than ranks: every rank computes them all.

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
    """A float64 sum of a batch's first input: a cheap identity of the data.

    A tensor stays on its device until `MetricStates.verify` reads it.
    """
    for leaf in tree.flatten(data):
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().sum(dtype=torch.float64)
        if isinstance(leaf, np.ndarray) and leaf.dtype != object:
            return float(np.sum(leaf, dtype=np.float64))
    return 0.0


def data_size(iterator):
    """`[rows, steps, batch_size, last_batch]` of an epoch, -1 where unknown.

    `iterator` is Keras's `TorchEpochIterator`. Rows are known for arrays only:
    1003 rows in batches of 64 give `[1003, 16, 64, 43]`.
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
        sizes: one `data_size` per rank, in rank order (the same on every rank).
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
    """`[rows spread, check spread]`, each positive where some rank differs.

    `sums`: `[1, rows, rows**2, check, check**2]` summed over the ranks. The
    result stays on the device.
    """
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
        spreads: the largest `batch_spreads` since the last check, on the host.
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
    """The whole batch's outputs on every rank, from each rank's `split_rows`.

    A non-tensor or a scalar `tensor` is returned as it is.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.ndim:
        return tensor
    bounds = [split_rows(rows, world_size, r) for r in range(world_size)]
    sizes = [stop - start for start, stop, _ in bounds]
    width = max(sizes)
    padded = tensor.new_zeros((width,) + tuple(tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])
