"""Every rank compares the size of its data before an epoch starts.

Ranks whose data differ in size would meet different collectives, and gloo
aborts ("Received data size doesn't match expected size") or hangs; instead
every rank raises the same `ValueError` before any collective.
"""

import sys
import weakref

import torch
import torch.distributed as dist

from keras_parallel.backends.torch import group as torch_group
from keras_parallel.backends.torch.batches import check_same_data, data_size
from keras_parallel.backends.torch.flat_buffers import on_group_device

#: `{epoch iterator: the model whose own run iterates it}`: the runs whose
#: batches `divided_input` may divide.
model_runs = weakref.WeakKeyDictionary()


class SameDataCheck:
    """The check of one model's runs, for `TorchEpochIterator.__iter__`."""

    def __init__(self, model, world_size, rank):
        self.model = model
        self.world_size = world_size
        self.rank = rank

    def epoch_begins(self, iterator_class):
        """`iterator_class.__iter__`, comparing the data first."""
        keras_iter = iterator_class.__iter__

        def begin_epoch(iterator):
            # Only this model's own runs (Keras iterates in a method of the
            # model): a model a callback runs on one rank starts no collective.
            if sys._getframe(1).f_locals.get("self") is self.model:
                self.check(iterator)
                # Marks the run whose batches `divided_input` may divide.
                model_runs[iterator] = self.model
            return keras_iter(iterator)

        return begin_epoch

    def check(self, iterator):
        """Every rank gathers every rank's `data_size`, and all judge alike."""
        mine = on_group_device(torch.tensor(data_size(iterator), dtype=torch.int64))
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            dist.all_gather(parts, mine)
        except Exception as error:
            if torch_group.is_collective_failure(error):
                raise torch_group.peer_failed_error(
                    error, self.rank, "the check of the data's size"
                ) from error
            raise
        try:
            check_same_data([p.tolist() for p in parts])
        except ValueError as error:
            # Published for a rank stuck in another collective (a user's).
            torch_group.publish_failure(self.rank, error)
            raise
