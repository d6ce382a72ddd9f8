"""Mirrored strategies whose replicas know their share of the batch (`ExactRun`)."""

import itertools
import threading

import tensorflow as tf

from keras_parallel.backends.tensorflow.keras_compat import tree

#: Marks a data set of this worker's replicas' pieces (`divided_input`).
PER_REPLICA = "_keras_parallel_per_replica"

_replica = threading.local()
_key_bases = itertools.count(start=100_000, step=100_000)


class ExactRun:
    """Mixed into a mirrored strategy: its replicas know their share of the batch.

    `run` keeps each replica's `n / N` (its samples over the global batch)
    in a thread-local for its losses; `experimental_distribute_dataset`
    copies each batch first, so that no step writes into the caller's arrays.
    """

    def run(self, fn, args=(), kwargs=None, options=None):
        kwargs = kwargs or {}
        if _needs_split((args, kwargs)):
            args, kwargs = self._split_batch((args, kwargs))

        def replica_fn(*replica_args, **replica_kwargs):
            local = _batch_size(replica_args, replica_kwargs)
            previous = getattr(_replica, "share", None)
            if local is None:
                _replica.share = None
            else:
                context = tf.distribute.get_replica_context()
                local = tf.cast(local, tf.float32)
                total = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
                _replica.share = tf.math.divide_no_nan(local, total)
            try:
                return fn(*replica_args, **replica_kwargs)
            finally:
                _replica.share = previous

        return super().run(replica_fn, args=args, kwargs=kwargs, options=options)

    def experimental_distribute_dataset(self, dataset, options=None):
        """The data set distributed, each batch first copied into TF's memory.

        TensorFlow wraps an aligned NumPy batch (from Python: a `PyDataset`,
        a generator) without copying, and the replicas' slices share it.
        `Tensor::RefCountIsOne` asks about the slice, not the buffer, so a
        step's kernel (mse's gradient) writes its output into the caller's
        `y` (weights 2.5e-2 off one device after two epochs; plain Keras
        too). It depends on alignment, so it came and went between runs.
        """
        if getattr(dataset, PER_REPLICA, False):
            # This worker's replicas' pieces (`divided_input`).
            copied = _copying(dataset)
            return self.distribute_datasets_from_function(lambda _: copied)
        return super().experimental_distribute_dataset(
            _copying(dataset), options=options
        )

    def _split_batch(self, structure):
        """Splits a global batch that was not distributed, in contiguous
        slices in replica order (a `ShardingCallback`'s first `fit`)."""
        num = self.num_replicas_in_sync

        def value_fn(context):
            index = context.replica_id_in_sync_group

            def piece(value):
                if not _is_batched(value):
                    return value
                size = tf.shape(value)[0]
                start = (size * index) // num
                stop = (size * (index + 1)) // num
                return value[start:stop]

            return tree.map_structure(piece, structure)

        return self.experimental_distribute_values_from_function(value_fn)


class ExactMirroredStrategy(ExactRun, tf.distribute.MirroredStrategy):
    """A `MirroredStrategy` over `devices` (`["cpu:0", "cpu:1"]`) whose
    replicas know their share of the batch (`ExactRun`)."""

    def __init__(self, devices):
        # TensorFlow numbers every MirroredStrategy's collective groups from
        # the same start, so a second one would join the first's group
        # ("joining a group with size 4, but that group has size 2").
        self._collective_key_base = next(_key_bases)
        super().__init__(devices=devices)


_strategies = {}


def strategy_for(devices):
    """The `ExactMirroredStrategy` over `devices`, one per device set: each
    one made costs collective keys."""
    key = tuple(devices)
    if key not in _strategies:
        _strategies[key] = ExactMirroredStrategy(list(key))
    return _strategies[key]


#: The dtypes whose NumPy memory TensorFlow may wrap, and `DeepCopy` copies.
_ALIASABLE = frozenset(
    (
        tf.bool,
        tf.int8,
        tf.int16,
        tf.int32,
        tf.int64,
        tf.uint8,
        tf.uint16,
        tf.uint32,
        tf.uint64,
        tf.float16,
        tf.bfloat16,
        tf.float32,
        tf.float64,
        tf.complex64,
        tf.complex128,
    )
)


def _copying(dataset):
    """`dataset` with each tensor (composites' components too) copied into
    memory TensorFlow owns (`ExactRun.experimental_distribute_dataset`)."""

    def copy(tensor):
        if tensor.dtype in _ALIASABLE:
            return tf.raw_ops.DeepCopy(x=tensor)
        return tensor

    def copied(element):
        return tf.nest.map_structure(copy, element, expand_composites=True)

    # `map` unpacks a tuple element (a tuple exactly) into arguments.
    if type(dataset.element_spec) is tuple:
        return dataset.map(lambda *element: copied(element))
    return dataset.map(copied)


def _is_batched(value):
    return isinstance(value, tf.Tensor) and bool(value.shape.rank)


def _needs_split(structure):
    flat = tree.flatten(structure)
    if any(isinstance(v, tf.distribute.DistributedValues) for v in flat):
        return False
    return tf.distribute.in_cross_replica_context() and any(
        _is_batched(v) for v in flat
    )


def _batch_size(args, kwargs):
    """The leading dimension of the first tensor of a replica's batch."""
    for value in tree.flatten((args, kwargs)):
        if isinstance(value, tf.RaggedTensor):
            return value.nrows()
        if isinstance(value, tf.SparseTensor):
            return value.dense_shape[0]
        if isinstance(value, (tf.Tensor, tf.Variable)) and value.shape.rank:
            return tf.shape(value)[0]
    return None


def replica_share():
    """This replica's `n / N` inside `ExactMirroredStrategy.run`, else `None`."""
    return getattr(_replica, "share", None)
