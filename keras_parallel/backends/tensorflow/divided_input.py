"""Each TensorFlow worker prepares only its share of the input.

Rows travel through the coordination service's store, polled, not by a
collective: `tf.data` runs the generators in threads of its own.
"""

import atexit
import base64
import gc
import itertools
import threading
import time

import numpy as np
import tensorflow as tf

from keras_parallel.backends.tensorflow import workers as tf_workers
from keras_parallel.backends.tensorflow.keras_compat import data_adapter_utils, tree
from keras_parallel.backends.tensorflow.strategies import PER_REPLICA
from keras_parallel.input import kinds, rank_loader, tf_data_rows, transport

#: A generator run's number, the same on every worker: its keys' prefix.
_runs = itertools.count()
_collects_at_exit = False


def _collect_before_exit():
    """Deletes `tf.data` iterators left in reference cycles (after a
    `Preempted` exit or an error) while their threads can still run Python.

    At the interpreter's final collection, deleting one waits for ever (1
    exit in about 15 of a preempted worker). Registered after TensorFlow's
    exit handlers, it runs before them.
    """
    gc.collect()


class DividedInput:
    """Divides the input of the runs under one strategy between its workers,
    through their `workers.CoordinationStore`."""

    def __init__(self, strategy, store):
        self.strategy = strategy
        self.workers = strategy.num_workers
        self.worker = strategy.worker_index
        self.replicas = strategy.num_replicas_in_sync
        self.per_worker = self.replicas // self.workers
        self.store = store
        #: Each kind of input seen, and whether it was divided.
        self.kinds = {}
        self._rank_loaders = {}  # id(loader) -> (loader, its rank loader)
        #: Entry points closed; a run's readers give up once it changes.
        self._generation = 0
        self._waiting = set()  # The threads of the readers inside `_take`.
        global _collects_at_exit
        if not _collects_at_exit:
            _collects_at_exit = True
            atexit.register(_collect_before_exit)

    def close(self, wait_s=2.0):
        """Ends the readers of this entry point's runs, waiting `wait_s` for
        them: deleting a `tf.data` iterator waits for its reading thread while
        holding Python's lock, and a reader of a worker gone waits for ever."""
        self._generation += 1
        deadline = time.monotonic() + wait_s
        while self._waiting and time.monotonic() < deadline:
            time.sleep(0.005)

    def dataset(self, adapter, previous):
        """A data adapter's `get_tf_dataset`, divided where it can be.

        Args:
            previous: Keras's `get_tf_dataset` of the adapter's class (run
                first: it computes the adapter's element spec).

        Returns:
            Keras's data set, or one of this worker's replicas' pieces,
            marked `PER_REPLICA`.
        """
        keras_dataset = previous(adapter)
        kind = kinds.input_kind(adapter)
        if kind == "tf.data":
            return self._tf_data_pieces(adapter, keras_dataset)
        spec = _piece_spec(getattr(adapter, "_output_signature", None))
        source = None if spec is None else self._source(adapter, kind)
        self.kinds.setdefault(kind, source is not None)
        tf_workers.say_input(adapter, divided=source is not None)
        if source is None:
            return keras_dataset
        if kind == "DataLoader":
            # In the main thread, where a collective may run.
            transport.share_torch_random_state(
                adapter._dataloader,
                lambda payload: tf_workers.broadcast_bytes(self.strategy, payload),
            )
        dataset = tf.data.Dataset.from_generator(
            lambda: self._pieces(source()), output_signature=spec
        )
        setattr(dataset, PER_REPLICA, True)
        return dataset

    def _tf_data_pieces(self, adapter, dataset):
        """This worker's replicas' pieces of a `tf.data` pipeline's batches,
        or the pipeline where it cannot be divided."""
        own = tf_data_rows.rows_dataset(dataset, self.rows_of)
        self.kinds.setdefault("tf.data", own is not None)
        tf_workers.say_input(adapter, divided=own is not None)
        if own is None:
            return dataset
        slots = self._slots()

        def pieces(rows, part):
            starts = tf.stack([rows * k // self.replicas for k in slots])
            sizes = tf.stack([rows * (k + 1) // self.replicas for k in slots]) - starts
            # A whole batch (a worker's share would be empty): cut as is.
            whole = tf.shape(tree.flatten(part)[0], out_type=tf.int64)[0] == rows
            starts = tf.where(whole, starts, tf.cumsum(sizes, exclusive=True))
            return tf.data.Dataset.from_tensor_slices((starts, starts + sizes)).map(
                lambda a, b: tree.map_structure(lambda x: x[a:b], part)
            )

        divided = own.dataset.flat_map(pieces)
        setattr(divided, PER_REPLICA, True)
        return divided

    def _slots(self, worker=None):
        """The global slices a worker's replicas hold: replica `r` of worker
        `w` holds slice `r * W + w` of `R`, the order Keras's `predict`
        concatenates outputs in across workers (`_multi_worker_concat`)."""
        worker = self.worker if worker is None else worker
        return [r * self.workers + worker for r in range(self.per_worker)]

    def rows_of(self, rows, worker=None):
        """`[(start, stop)]`: a worker's rows of a global batch, by replica."""
        return [
            (rows * k // self.replicas, rows * (k + 1) // self.replicas)
            for k in self._slots(worker)
        ]

    def _pieces(self, batches):
        """Each `(global rows, this worker's rows)` cut into replicas' pieces."""
        for rows, local in batches:
            start = 0
            for first, stop in self.rows_of(rows):
                end = start + stop - first
                yield tree.map_structure(lambda x, a=start, b=end: x[a:b], local)
                start = end

    def _source(self, adapter, kind):
        """A function starting one run of `(rows, local rows)`, or None."""
        if kind == "PyDataset" and kinds.shareable_pydataset(adapter):
            return lambda: self._pydataset_batches(adapter, self._run())
        if kind == "generator":
            return lambda: self._generator_batches(adapter, self._run())
        loader = getattr(adapter, "_dataloader", None)
        if kind == "DataLoader" and rank_loader.divisible(loader):
            return lambda: self._loader_batches(loader)
        return None

    def _run(self):
        """A new run: `(its number, its Handout)`, ended with the entry point."""
        store = _PolledStore(self, self._generation)
        handout = transport.Handout(
            self.worker, self.workers, store=store, who="worker"
        )
        return next(_runs), handout

    def _pydataset_batches(self, adapter, run):
        dataset = adapter.py_dataset
        order = kinds.epoch_order(adapter, dataset.num_batches)
        pending = self.worker  # This worker's next position.
        try:
            for group in range(0, len(order), self.workers):
                # Each worker makes one batch of the group, then takes its
                # rows of the others'.
                mine = group + self.worker
                own = None
                if mine < len(order):
                    batch = adapter._standardize_batch(dataset[order[mine]])
                    own = self._hand_out(run, mine, _numpy(batch))
                    pending = mine + self.workers
                for position in range(group, min(group + self.workers, len(order))):
                    part = own
                    if position != mine:
                        part = self._take(run, position, owner=position - group)
                    if transport.is_end(part):
                        return
                    yield part
        finally:
            if pending < len(order):
                self._end_for_others(run, pending)

    def _generator_batches(self, adapter, run):
        if self.worker != 0:
            for position in itertools.count():
                taken = self._take(run, position, owner=0)
                if transport.is_end(taken):
                    return
                yield taken
        handed = 0
        try:
            for batch in adapter.get_numpy_iterator():
                own = self._hand_out(run, handed, _numpy(batch))
                handed += 1
                yield own
        finally:
            self._end_for_others(run, handed)

    def _end_for_others(self, run, position):
        """Tells the other workers the run ended at `position`: it ran out,
        or was abandoned while another worker's prefetch waits for it."""
        number, handout = run
        handout.end(transport.batch_key(number, position), self.worker)

    def _loader_batches(self, loader):
        kept = self._rank_loaders.get(id(loader))
        if kept is None or kept[0] is not loader:
            kept = (loader, rank_loader.rank_loader(loader, self.rows_of))
            self._rank_loaders[id(loader)] = kept
        own = kept[1]
        iterator = iter(own)
        sizes = own.batch_sampler.sizes  # This iteration's.
        for batch in iterator:
            yield sizes.popleft(), _numpy(batch)

    def _hand_out(self, run, position, batch):
        """Hands every other worker its rows of `batch`; returns `(rows,
        this worker's rows)`."""
        rows = _rows(batch)
        parts = [
            (rows, _rows_of(batch, self.rows_of(rows, w))) for w in range(self.workers)
        ]
        number, handout = run
        return handout.give(transport.batch_key(number, position), self.worker, parts)

    def _take(self, run, position, owner):
        """This worker's part at `position`, once `owner` made it (`END`
        once the entry point is closed)."""
        number, handout = run
        return handout.give(transport.batch_key(number, position), owner, None)


class _PolledStore:
    """The coordination store as a `transport.Handout`'s: each payload a
    base64 string (its values are strings), read by polling, outside
    TensorFlow, so that the main thread runs; a reader gives up once its
    entry point is closed."""

    def __init__(self, divided, generation):
        self.divided = divided
        self.generation = generation

    def put_bytes(self, key, payload):
        self.divided.store.set(key, base64.b64encode(payload).decode("ascii"))

    def take_bytes(self, key):
        divided, wait = self.divided, 0.0005
        reader = threading.get_ident()
        divided._waiting.add(reader)
        try:
            while self.generation == divided._generation:
                value = divided.store.try_get(key)
                if value is not None:
                    divided.store.delete(key)
                    return base64.b64decode(value)
                time.sleep(wait)
                wait = min(2 * wait, 0.02)
            return None
        finally:
            divided._waiting.discard(reader)


def _numpy(batch):
    """A batch with NumPy leaves, as Keras converts them; a list as a tuple,
    as Keras's element spec has."""
    batch = next(data_adapter_utils.get_numpy_iterator([batch]))
    return tuple(batch) if isinstance(batch, list) else batch


def _rows_of(batch, ranges):
    """The rows of `batch` (NumPy leaves) in `ranges`, concatenated."""
    return tree.map_structure(
        lambda x: np.concatenate([x[start:stop] for start, stop in ranges]), batch
    )


def _rows(batch):
    return len(tree.flatten(batch)[0])


def _piece_spec(signature):
    """Keras's batch spec with any batch size, or None where a leaf is not a
    dense tensor (read whole, as Keras reads it)."""
    if signature is None:
        return None
    leaves = tree.flatten(signature)
    if not leaves or not all(
        isinstance(s, tf.TensorSpec) and s.shape.rank for s in leaves
    ):
        return None
    return tree.map_structure(
        lambda s: tf.TensorSpec((None,) + tuple(s.shape[1:]), s.dtype), signature
    )


def adapter_replacements(divided, adapter_classes):
    """`{(adapter class, "get_tf_dataset"): replacement}` through `divided`."""

    def replacement(previous):
        def get_tf_dataset(adapter):
            return divided.dataset(adapter, previous)

        return get_tf_dataset

    return {
        (cls, "get_tf_dataset"): replacement(cls.get_tf_dataset)
        for cls in adapter_classes
    }
