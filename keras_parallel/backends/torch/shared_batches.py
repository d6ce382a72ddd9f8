"""Batches one rank prepares and shares: a `PyDataset`, a generator.

A `PyDataset`'s batches are made round-robin, each by one rank, which scatters
every rank its rows; on the main thread, as a thread working ahead would hold
the GIL against the steps' torch calls. A generator is drawn by rank 0 alone.
"""

import numpy as np
from keras import ops

from keras_parallel.backends.torch.batches import batch_rows, slice_rows, split_rows
from keras_parallel.backends.torch.flat_buffers import scatter_bytes
from keras_parallel.backends.torch.keras_compat import tree
from keras_parallel.input import kinds, transport


def pydataset_batches(adapter, world_size, rank):
    """`(global rows, this rank's rows)` of each batch of a finite `PyDataset`."""
    dataset = adapter.py_dataset
    order = kinds.epoch_order(adapter, dataset.num_batches)
    handout = _handout(world_size, rank)
    for k in range(len(order)):
        if k % world_size == 0:
            # The next `W` batches: each rank makes one, then `W` scatters.
            position = k + rank
            made = None
            if position < len(order):
                made = adapter._standardize_batch(dataset[order[position]])
        owner = k % world_size
        yield _scattered(made if owner == rank else None, owner, handout)


def generator_batches(numpy_batches, world_size, rank):
    """`(global rows, this rank's rows)` of each batch of a generator.

    Args:
        numpy_batches: Keras's NumPy iterator of it (read on rank 0 only).
    """
    handout = _handout(world_size, rank)
    while True:
        batch = None
        if rank == 0:
            batch = next(numpy_batches, transport.END)
        shared = _scattered(batch, 0, handout)
        if shared is None:
            return
        yield shared


def _handout(world_size, rank):
    # The ranks step together: a collective scatter, no key to name.
    return transport.Handout(rank, world_size, scatter_bytes=scatter_bytes, who="rank")


def _scattered(batch, owner, handout):
    """`(global rows, rows of rank)` of the owner's `batch` on every rank;
    None at the end of the source."""
    pieces = None
    world_size = handout.processes
    if handout.process == owner:
        if transport.is_end(batch):
            pieces = [batch] * world_size
        else:
            rows = batch_rows(batch)
            pieces = []
            for r in range(world_size):
                start, stop, whole = split_rows(rows, world_size, r)
                part = batch if whole else slice_rows(batch, rows, start, stop)
                pieces.append((rows, part))
    received = handout.give("a batch's rows", owner, pieces)
    if transport.is_end(received):
        return None
    rows, part = received
    return rows, tree.map_structure(_tensor, part)


def _tensor(value):
    if isinstance(value, np.ndarray):
        return ops.convert_to_tensor(value)
    return value
