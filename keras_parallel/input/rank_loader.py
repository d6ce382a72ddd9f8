"""A torch `DataLoader` that loads one process's rows of every global batch.

Every process draws the same global order (one shuffle, from the random state
they share) and keeps its rows. torch is imported only when a loader is given.
"""

import collections

from keras_parallel.input.row_ranges import as_ranges


def divisible(loader):
    """Whether `loader` is a map-style `DataLoader` with a batch sampler."""
    import torch

    return (
        isinstance(loader, torch.utils.data.DataLoader)
        and loader.batch_sampler is not None
        and not isinstance(loader.dataset, torch.utils.data.IterableDataset)
    )


def rank_loader(loader, rows_of):
    """A loader like `loader` that loads this process's rows of each batch.

    Args:
        loader: a map-style `torch.utils.data.DataLoader` (`divisible`).
        rows_of: `rows_of(B)` is this process's rows of a global batch of
            `B` rows: `(start, stop)`, or a list of such ranges.

    Returns:
        A `DataLoader`; its `batch_sampler.sizes` holds the global sizes of
        the batches drawn and not yet loaded, this iteration.
    """
    return _like(loader, _RankBatchSampler(loader.batch_sampler, rows_of))


class _RankBatchSampler:
    """This process's indices of each global batch of a batch sampler (a
    `DataLoader` takes any iterable of index lists as its batch sampler)."""

    def __init__(self, batch_sampler, rows_of):
        self.batch_sampler = batch_sampler
        self.rows_of = rows_of
        #: The global batch sizes drawn and not yet loaded, this iteration.
        self.sizes = collections.deque()

    def __iter__(self):
        # A new count for each iteration, made when the loader starts it.
        self.sizes = collections.deque()
        return self._indices(self.sizes)

    def _indices(self, sizes):
        # A process's rows depend on the batch's size alone: computed once
        # for each size (two an epoch at most: the full and the last).
        ranges_of = {}
        for indices in self.batch_sampler:
            indices = list(indices)
            size = len(indices)
            ranges = ranges_of.get(size)
            if ranges is None:
                ranges = ranges_of[size] = as_ranges(self.rows_of(size))
            sizes.append(size)
            yield [i for start, stop in ranges for i in indices[start:stop]]

    def __len__(self):
        return len(self.batch_sampler)


def _like(loader, batch_sampler):
    """A loader like `loader` (dataset, collate, workers) over `batch_sampler`."""
    import torch

    options = dict(
        batch_sampler=batch_sampler,
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
    )
    if loader.num_workers:
        options["prefetch_factor"] = loader.prefetch_factor
    return torch.utils.data.DataLoader(loader.dataset, **options)
