"""Mirrored strategies whose replicas know their share of the batch (`ExactRun`)."""

import itertools
import threading

import tensorflow as tf

from keras_parallel.backends.tensorflow.keras_compat import tree

_replica = threading.local()
_key_bases = itertools.count(start=100_000, step=100_000)


class ExactRun:
    """Mixed into a mirrored strategy: its replicas know their share of the batch.

    Its `run` computes, in each replica, `n / N` (this replica's samples over
    the global batch, all-reduced over every replica of every worker) and
    keeps it, for the losses that replica computes, in a thread-local (each
    replica runs in its own thread).
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
