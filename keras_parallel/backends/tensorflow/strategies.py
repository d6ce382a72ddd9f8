"""Mirrored strategies whose replicas know their share of the batch (`ExactRun`)."""

import itertools
import threading

import tensorflow as tf

from keras_parallel.backends.tensorflow.keras_compat import tree

#: Set on a data set whose elements are this worker's replicas' pieces
#: (`divided_input`), in replica order.
PER_REPLICA = "_keras_parallel_per_replica"

_replica = threading.local()
_key_bases = itertools.count(start=100_000, step=100_000)


class ExactRun:
    """Mixed into a mirrored strategy: its replicas know their share of the batch.

    Its `run` computes, in each replica, `n / N` (this replica's samples over
    the global batch, all-reduced over every replica of every worker) and
    keeps it, for the losses that replica computes, in a thread-local (each
    replica runs in its own thread). Its `experimental_distribute_dataset`
    copies each batch before splitting it, so that no step writes into the
    caller's arrays.
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

        TensorFlow splits each global batch over the replicas
        (`RebatchDatasetV2`) in slices that share the batch's buffer (where
        a slice is aligned). A batch yielded by Python (a
        `keras.utils.PyDataset`, a generator, `Dataset.from_generator`) is
        a NumPy array whose memory TensorFlow wraps without copying (where
        it is 64-byte aligned). Kernels never write into a buffer
        TensorFlow does not own, but `Tensor::RefCountIsOne` asks that of
        the slice, not of the batch's buffer under it: once the replica's
        slice is the last reference, a kernel of the step (mse's gradient)
        writes its output there, into the caller's `y`. A `PyDataset`'s
        next epoch then trains on gradients (weights 2.5e-2 off one device
        after two) and `evaluate` on the arrays reads them (loss 4.7 for
        9.26). Plain Keras under `MirroredStrategy` does the same; one
        device does not split. Alignment depends on where NumPy allocated
        the arrays: the failure came and went from run to run. One host
        copy of each global batch gives the slices memory TensorFlow owns
        and no one else reads.
        """
        if getattr(dataset, PER_REPLICA, False):
            # Each worker's own rows, cut into its replicas' pieces
            # (`divided_input`): one input pipeline per worker.
            copied = _copying(dataset)
            return self.distribute_datasets_from_function(lambda _: copied)
        return super().experimental_distribute_dataset(
            _copying(dataset), options=options
        )

    def _split_batch(self, structure):
        """Splits a global batch that was not distributed over the replicas.

        Keras distributes its data set when the model's strategy is known
        before `fit` makes its iterator. Through `ShardingCallback` the
        strategy arrives later (at `set_model`), so the first `fit` feeds
        whole global batches; they are split here, in contiguous slices in
        replica order (as `tf.distribute` splits a batch), rather than
        computed in full on every replica.
        """
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
    """A `MirroredStrategy` whose replicas know their share of the batch.

    It is a `MirroredStrategy` in every other respect (see `ExactRun`).

    Args:
        devices: the device names, e.g. `["cpu:0", "cpu:1"]`.

    Example:

    >>> strategy = ExactMirroredStrategy(["cpu:0", "cpu:1"])
    >>> with patched(model):
    ...     model.fit(x, y, batch_size=64)
    """

    def __init__(self, devices):
        # TensorFlow numbers the collective groups of each MirroredStrategy
        # from the same start, so a second strategy over another device set
        # would join the first one's group ("joining a group with size 4, but
        # that group has size 2"). Each strategy gets its own key range.
        self._collective_key_base = next(_key_bases)
        super().__init__(devices=devices)


_strategies = {}


def strategy_for(devices):
    """The `ExactMirroredStrategy` over these devices, one per device set.

    Shared by every model of the process that uses the same devices: a
    strategy is cheap to share and costs collective keys to make.

    Args:
        devices: TensorFlow device names, e.g. `["/device:CPU:0", ...]`.
    """
    key = tuple(devices)
    if key not in _strategies:
        _strategies[key] = ExactMirroredStrategy(list(key))
    return _strategies[key]


#: The dtypes TensorFlow can wrap a NumPy array's memory as (no copy), that
#: `tf.raw_ops.DeepCopy` copies; other tensors (strings, an absent value's
#: variant) are made by TensorFlow and kept as they are.
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
    """`dataset` with each of its tensors (a sparse or ragged one's components
    too) copied into memory TensorFlow allocates (see
    `ExactRun.experimental_distribute_dataset`); same elements and spec."""

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
