"""Each JAX process prepares only its share of the input (docs/multihost.md).

A generator is drawn by process 0 alone and handed out through
`jax.distributed`'s key-value store, not a collective: process 0 draws on.
"""

import collections
import functools
import itertools

import jax
import numpy as np

from keras_parallel.backends.jax import processes
from keras_parallel.backends.jax.keras_compat import data_adapter_utils, tree
from keras_parallel.input import kinds, rank_loader, tf_data_rows, transport
from keras_parallel.keras_seam.keras_compat import print_msg
from keras_parallel.messages import signed_store, wire

#: A generator run's number, the same on every process: its keys' prefix.
_runs = itertools.count()
#: Parts kept for `place`; older ones (of an abandoned iteration) are dropped.
_KEPT_PARTS = 64


class DividedInput:
    """Divides the input of one model's runs (its `PlannedDistribution`)
    between the JAX processes."""

    def __init__(self, distribution):
        self.distribution = distribution
        self.processes = jax.process_count()
        self.process = jax.process_index()
        #: Each kind of input seen, and whether it was divided.
        self.kinds = {}
        self._parts = collections.OrderedDict()  # id(leaf) -> (leaf, rows, start)
        self._rank_loaders = {}  # id(loader) -> (loader, its rank loader)
        self._rows_datasets = {}  # id(dataset) -> (dataset, its RowsDataset)

    def iterator(self, adapter, *args, previous, **kwargs):
        """A data adapter's `get_jax_iterator`, divided where it can be.

        With any argument (Keras 3.16's `super_batch`) the input is read
        whole; `previous` is Keras's `get_jax_iterator` of its class.
        """
        kind = kinds.input_kind(adapter)
        source = None
        if not any(args) and not any(kwargs.values()):
            source = self._divided(adapter, kind, previous)
        self._say(kind, source is not None)
        if source is None:
            return previous(adapter, *args, **kwargs)
        return source

    def part(self, leaf):
        """`(global rows, first row)` of an array a rank loader yielded, or
        None for any other array (a whole global batch)."""
        entry = self._parts.pop(id(leaf), None)
        if entry is None or entry[0] is not leaf:
            return None
        return entry[1:]

    def place(self, leaf, rows, start):
        """This process's rows (from global row `start`) of a global batch of
        `rows` rows, as a `jax.Array` laid out as the whole batch."""
        shape = (rows,) + tuple(leaf.shape[1:])
        sharding = self.distribution.get_data_layout(shape).backend_layout

        def rows_of_device(index):
            first = index[0]
            local = slice(
                (first.start or 0) - start,
                (rows if first.stop is None else first.stop) - start,
            )
            return leaf[(local,) + tuple(index[1:])]

        return jax.make_array_from_callback(shape, sharding, rows_of_device)

    def rows_of(self, rows):
        """`(start, stop)`: the rows of a global batch this process's devices
        hold (all of them where the batch is placed whole)."""
        sharding = self.distribution.get_data_layout((rows,)).backend_layout
        ranges = sorted(
            {
                index[0].indices(rows)[:2]
                for index in sharding.addressable_devices_indices_map((rows,)).values()
            }
        )
        start, stop = ranges[0][0], ranges[-1][1]
        covered = sum(b - a for a, b in ranges)
        if covered != stop - start:  # Not one block of rows: load them all.
            return 0, rows
        return start, stop

    def _say(self, kind, divided):
        if kind in self.kinds:
            return
        self.kinds[kind] = divided
        if self.process != 0:
            return
        if kind == "arrays":
            line = (
                f"Input: arrays, each of {self.processes} processes slices every "
                "global batch from its own copy and places only its rows"
            )
        else:
            how = "each process receiving every batch of a group of them"
            line = kinds.input_line(kind, divided, self.processes, how=how)
        print_msg(line)

    def _divided(self, adapter, kind, previous):
        if kind == "PyDataset" and kinds.shareable_pydataset(adapter):
            return self._pydataset_batches(adapter)
        if kind == "generator":
            return self._generator_batches(adapter, previous)
        loader = getattr(adapter, "_dataloader", None)
        if kind == "DataLoader" and rank_loader.divisible(loader):
            return self._loader_batches(loader)
        if kind == "tf.data":
            return self._tf_data_batches(adapter._dataset)
        return None

    def _pydataset_batches(self, adapter):
        dataset = adapter.py_dataset
        order = kinds.epoch_order(adapter, dataset.num_batches)
        for group in range(0, len(order), self.processes):
            position = group + self.process
            payload = b""
            if position < len(order):
                batch = adapter._standardize_batch(dataset[order[position]])
                batch = next(data_adapter_utils.get_numpy_iterator([batch]))
                payload = wire.encode(batch)
            made = transport.gathered(
                payload,
                processes.allgather_bytes,
                where=f"a PyDataset batch of those from {group}",
            )
            yield from made[: min(self.processes, len(order) - group)]

    def _generator_batches(self, adapter, previous):
        # Every process places its rows of the whole batch: each gets it all.
        key = functools.partial(transport.batch_key, next(_runs))
        handout = transport.Handout(
            self.process,
            self.processes,
            store=signed_store.for_run(processes.CoordinationStore(), self.process),
        )
        if self.process == 0:
            drawn = 0
            for batch in previous(adapter):
                handout.give(key(drawn), 0, [batch] * self.processes)
                yield batch
                drawn += 1
            handout.end(key(drawn), 0)
            return
        for position in itertools.count():
            batch = handout.give(key(position), 0, None)
            if transport.is_end(batch):
                return
            yield batch

    def _loader_batches(self, loader):
        kept = self._rank_loaders.get(id(loader))
        if kept is None or kept[0] is not loader:
            kept = (loader, rank_loader.rank_loader(loader, self.rows_of))
            self._rank_loaders[id(loader)] = kept
        own = kept[1]
        transport.share_torch_random_state(loader, processes.broadcast_bytes)
        iterator = iter(own)
        sizes = own.batch_sampler.sizes  # This iteration's.
        for batch in iterator:
            batch = tuple(
                tree.map_structure(
                    lambda x: np.asarray(x.cpu()), batch, none_is_leaf=False
                )
            )
            yield self._remembered(batch, sizes.popleft())

    def _tf_data_batches(self, dataset):
        kept = self._rows_datasets.get(id(dataset))
        if kept is None or kept[0] is not dataset:
            kept = (dataset, tf_data_rows.rows_dataset(dataset, self.rows_of))
            self._rows_datasets[id(dataset)] = kept
        own = kept[1]
        if own is None:
            return None
        return (
            self._remembered(tree.map_structure(np.asarray, part), int(rows))
            for rows, part in own.dataset
        )

    def _remembered(self, batch, rows):
        """`batch` (this process's rows, or all), remembered for `place`."""
        leaves = tree.flatten(batch)
        start = 0 if len(leaves[0]) == rows else self.rows_of(rows)[0]
        for leaf in leaves:
            self._parts[id(leaf)] = (leaf, rows, start)
        while len(self._parts) > _KEPT_PARTS:
            self._parts.popitem(last=False)
        return batch


def adapter_replacements(divided, adapter_classes):
    """`{(adapter class, "get_jax_iterator"): replacement}` through `divided`."""

    def replacement(previous):
        def get_jax_iterator(adapter, *args, **kwargs):
            return divided.iterator(adapter, *args, previous=previous, **kwargs)

        return get_jax_iterator

    return {
        (cls, "get_jax_iterator"): replacement(cls.get_jax_iterator)
        for cls in adapter_classes
    }
