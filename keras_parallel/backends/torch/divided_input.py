"""Each rank loads only its rows of every global batch.

A map-style `DataLoader`'s batch sampler gives each rank its share of every
global batch's indices. The step still needs the global batch's size, so each
batch is remembered with it, keyed by the object Keras passes on untouched.
`PyDataset`s and generators: `shared_batches`.
"""

import functools
import weakref

from keras_parallel.backends.torch import shared_batches
from keras_parallel.backends.torch.batches import split_rows
from keras_parallel.input import kinds, rank_loader, tf_data_rows
from keras_parallel.keras_seam.keras_compat import print_msg


class DividedInput:
    """Divides the map-style loaders of one model's runs between the ranks."""

    def __init__(self, world_size, rank):
        self.world_size = world_size
        self.rank = rank
        self._global_rows = {}  # id(batch) -> (batch, global rows)
        self._leftover = []
        self._loaders = weakref.WeakKeyDictionary()
        #: Each kind of input seen, and whether it was divided.
        self.kinds = {}

    def batches(self, loader, adapter):
        """This rank's batches of `loader`, or `loader` if it cannot be divided.

        Args:
            loader: what Keras's epoch iterator would iterate.
            adapter: Keras's data adapter of the input.
        """
        kind = kinds.input_kind(adapter)
        shared = self._shared(loader, kind, adapter)
        own_loader = None if shared is not None else self._rank_loader(loader)
        divided = shared is not None or own_loader is not None
        if kind not in self.kinds and self.rank == 0:
            print_msg(kinds.input_line(kind, divided, self.world_size))
        self.kinds[kind] = divided
        if shared is not None:
            return shared
        if own_loader is None:
            return loader
        return _Remembered(self, own_loader)

    def _shared(self, loader, kind, adapter):
        """Batches shared between the ranks (`shared_batches`), or None."""
        world_size, rank = self.world_size, self.rank
        if kind == "PyDataset" and kinds.shareable_pydataset(adapter):
            batches = functools.partial(
                shared_batches.pydataset_batches, adapter, world_size, rank
            )
        elif kind == "generator":

            def batches():
                numpy_batches = (
                    iter(adapter.get_numpy_iterator()) if rank == 0 else None
                )
                return shared_batches.generator_batches(numpy_batches, world_size, rank)

        elif kind == "tf.data":
            own = tf_data_rows.rows_dataset(
                adapter._dataset, lambda rows: split_rows(rows, world_size, rank)[:2]
            )
            if own is None:
                return None
            batches = functools.partial(_tf_data_batches, own)
        else:
            return None
        return _Shared(self, loader, batches)

    def global_rows(self, batch):
        """The rows of the global batch `batch` is a share of, or `None`."""
        entry = self._global_rows.pop(id(batch), None)
        if entry is None or entry[0] is not batch:
            return None
        return entry[1]

    def _rank_loader(self, loader):
        if not rank_loader.divisible(loader):
            return None
        made = self._loaders.get(loader)
        if made is None:
            world_size, rank = self.world_size, self.rank
            made = rank_loader.rank_loader(
                loader, lambda rows: split_rows(rows, world_size, rank)[:2]
            )
            self._loaders[loader] = made
        return made

    def remembered_pairs(self, pairs):
        """Yields the batches of `(global rows, batch)` pairs, remembering rows."""
        # Yielded by an earlier epoch but never stepped on (a resumed run).
        self._forget(self._leftover)
        kept = []
        finished = False
        try:
            for rows, batch in pairs:
                if rows is None:  # A whole global batch.
                    yield batch
                    continue
                self._global_rows[id(batch)] = (batch, rows)
                kept.append(id(batch))
                if len(kept) > 64:
                    kept = [key for key in kept if key in self._global_rows]
                yield batch
            finished = True
        finally:
            if finished:
                # With `steps_per_execution` > 1 Keras reaches this end before
                # it steps on the epoch's last batches.
                self._leftover = kept
            else:
                self._forget(kept)
            pairs.close()

    def _forget(self, keys):
        for key in keys:
            self._global_rows.pop(key, None)


def _tf_data_batches(own):
    """`(global rows or None if whole, this rank's rows)` of a `RowsDataset`."""
    from keras import ops, tree

    for rows, part in own.dataset:
        rows = int(rows)
        batch = tree.map_structure(ops.convert_to_tensor, part, none_is_leaf=False)
        whole = len(tree.flatten(batch)[0]) == rows
        yield (None if whole else rows), batch


class _Shared:
    """Shared batches as Keras's epoch iterator iterates them.

    Keras's own loader's iterator is made, unread, so that torch's random
    state moves as on one device.
    """

    def __init__(self, divided, loader, batches):
        self.divided = divided
        self.loader = loader
        self.make_batches = batches

    def __iter__(self):
        iter(self.loader)
        return self.divided.remembered_pairs(self.make_batches())


class _Remembered:
    """The rank loader as Keras's epoch iterator iterates it.

    Its iterator, which draws a seed from torch's random state, is made when
    Keras asks for one, so later epochs shuffle as on one device.
    """

    def __init__(self, divided, rank_loader):
        self.divided = divided
        self.rank_loader = rank_loader

    def __iter__(self):
        iterator = iter(self.rank_loader)
        sizes = self.rank_loader.batch_sampler.sizes  # This iteration's.
        return self.divided.remembered_pairs(
            (sizes.popleft(), batch) for batch in iterator
        )

    def __len__(self):
        return len(self.rank_loader)
