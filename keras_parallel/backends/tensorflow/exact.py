"""Exact data parallelism under `tf.distribute.MirroredStrategy`.

Keras's TensorFlow trainer already runs `fit` under a strategy: each replica
computes its loss, divides it by the number of replicas
(`keras.src.losses.loss.scale_loss_for_distribution`), and the optimizer sums
the replicas' gradients. That is the global mean only when every replica has
the same number of samples. The last batch of an epoch does not: 43 samples
over 2 replicas split 22/21, and `(mean_22 + mean_21) / 2` weighs each of the
21 samples more than each of the 22 (measured: 1.2e-2 off one-device training
after one epoch of 1003 samples at batch 64).

This module makes the weighting exact while Keras's trainer runs unchanged:

- `ExactRun.run` (the strategies' `run`) records, in each replica, its sample count
  `n` and the global count `N` (one scalar all-reduce per step);
- while an entry point runs, `scale_loss` multiplies a replica's mean loss
  by `n / N` instead of `1 / num_replicas`, so the summed gradient is
  `sum(losses) / N`, the one-device mean; `unscale_loss` undoes exactly
  that, so the loss metric sees each replica's true mean with weight `n`;
- `global_logs` makes each step's logs the metrics read across replicas
  (the global numbers) rather than the mean of per-replica results;
- `_maybe_symbolic_build` builds the model from a first batch that splits
  unevenly (Keras's own averages the replicas' batches, which must then have
  one shape);
- `late_distribution` distributes a data set that Keras did not, and
  builds the optimizer and metrics under the strategy (the first `fit`
  through `ShardingCallback`), and `ExactRun.run` splits
  a batch given whole (`train_on_batch`);
- `synchronized_batchnorm` computes BatchNormalization's batch statistics over
  the global batch (Keras's `synchronized=True`), as one device would.

Keras's own functions are swapped in only inside `patched(model)`, and are
used from there only by steps traced inside it.
"""

import contextlib
import itertools
import threading

import tensorflow as tf

from keras_parallel.backends.tensorflow.keras_compat import (
    BatchNormalization,
    TensorFlowTrainer,
    tree,
)
from keras_parallel.backends.tensorflow.keras_compat import loss as keras_loss
from keras_parallel.backends.tensorflow.keras_compat import trainer as keras_tf_trainer
from keras_parallel.building import build_from_inputs, is_built
from keras_parallel.replacements import replaced

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


def exact_scale_loss(keras_scale):
    """Keras's `scale_loss_for_distribution`, weighted by the replica's samples.

    A replica's mean loss times `n / N`: summed over replicas (as the
    optimizer sums gradients), `sum(losses) / N`, the one-device mean.
    Outside an exact replica it is `keras_scale`, what was there before.
    """

    def scale_loss(value):
        share = replica_share()
        if share is None:
            return keras_scale(value)
        return value * tf.cast(share, value.dtype)

    return scale_loss


def exact_unscale_loss(keras_unscale):
    """The inverse of `exact_scale_loss`: a replica's own mean loss.

    Keras feeds this, with weight `n`, to the loss metric, whose state is
    summed over replicas: the metric reads the global mean. A replica with
    no sample (a batch smaller than the device count) gives 0 with weight 0.
    """

    def unscale_loss(value):
        share = replica_share()
        if share is None:
            return keras_unscale(value)
        return tf.math.divide_no_nan(value, tf.cast(share, value.dtype))

    return unscale_loss


def global_logs(model, keras_reduce_per_replica):
    """Keras's `reduce_per_replica`, with each step's logs made global.

    Keras averages the replicas' metric results, which on a 22/21 split is
    not the global accuracy. When a step returns the model's metrics (the
    default `train_step` and `test_step`, the same test Keras uses at epoch
    end), they are read instead in cross-replica context, where each metric's
    on-read state sums over replicas: the numbers one device would log.
    """

    def reduce_per_replica(values, strategy, reduction):
        if (
            reduction in ("auto", "mean")
            and isinstance(strategy, ExactRun)
            and isinstance(values, dict)
        ):
            metric_logs = model.get_metrics_result()
            if set(metric_logs) == set(values):
                return metric_logs
        return keras_reduce_per_replica(values, strategy, reduction)

    return reduce_per_replica


def uneven_first_batch(keras_maybe_symbolic_build):
    """Keras's `_maybe_symbolic_build`, for a first batch that splits unevenly.

    Keras builds the model from the element-wise mean of the replicas' first
    batches, which fails when they differ in size (a data set of 43 samples
    over 4 replicas: 11/11/11/10). Only the shapes and dtypes matter for the
    build, so the first replica's batch serves: the same shapes Keras's mean
    gives when the split is even.
    """

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is None or not isinstance(strategy, ExactRun):
            return keras_maybe_symbolic_build(self, iterator, data_batch)
        for _, _, it in iterator:
            _build_from_first_batch(self, strategy, it)
            break

    return _maybe_symbolic_build


def late_distribution(model):
    """Keras's `TFEpochIterator._get_iterator`, distributing late if need be.

    Keras distributes the data set, and builds the optimizer and metrics
    under the strategy, when `fit` starts, with the model's strategy at that
    moment. A `ShardingCallback` applies the strategy just after (at
    `set_model`), so on the first run both are done here, when the epoch
    starts and before any step is traced: the batches are split, and no
    variable is created inside a traced replica step.
    """

    def _get_iterator(self):
        dataset = self._distributed_dataset
        strategy = tf.distribute.get_strategy()
        if not isinstance(strategy, ExactRun):
            return dataset
        if not isinstance(dataset, tf.distribute.DistributedDataset):
            dataset = strategy.experimental_distribute_dataset(dataset)
            self._distributed_dataset = dataset
            _build_from_first_batch(model, strategy, iter(dataset))
        elif not is_built(model):
            # `predict` of an unbuilt model: Keras would build it inside the
            # traced replica step, where no variable can be made.
            _build_from_first_batch(model, strategy, iter(dataset))
        return dataset

    return _get_iterator


def _build_from_first_batch(model, strategy, iterator):
    batch = tree.map_structure(
        lambda v: (
            strategy.experimental_local_results(v)[0]
            if isinstance(v, tf.distribute.DistributedValues)
            else v
        ),
        next(iterator),
    )
    if not isinstance(batch, (tuple, list)):
        batch = (batch,)
    with strategy.scope():
        if len(batch) < 2:
            # A predict batch (its inputs only): no loss or metric to build.
            build_from_inputs(model, batch[0])
        else:
            model._symbolic_build(data_batch=batch)


@contextlib.contextmanager
def synchronized_batchnorm(model):
    """BatchNormalization over the global batch while the scope is entered.

    Keras's `synchronized=True` all-reduces each BatchNormalization layer's
    sums and counts across replicas (three scalar-per-channel all-reduces per
    layer and step), so the statistics are those of the whole batch, as on
    one device, whatever the split.
    """
    layers = [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if isinstance(layer, BatchNormalization)
    ]
    with replaced({(layer, "synchronized"): True for layer in layers}):
        yield


@contextlib.contextmanager
def patched(model):
    """Keras's loss scaling and log reduction made exact, for this model.

    Entered around every entry point (see `TensorFlowExecutor.scope`); steps
    traced inside it keep the exact versions. Each wraps what was there on
    entry (Keras's, or an outer model's exact version).
    """
    trainer, iterator = keras_tf_trainer, keras_tf_trainer.TFEpochIterator
    with replaced(
        {
            (keras_loss, "scale_loss_for_distribution"): exact_scale_loss(
                keras_loss.scale_loss_for_distribution
            ),
            (keras_loss, "unscale_loss_for_distribution"): exact_unscale_loss(
                keras_loss.unscale_loss_for_distribution
            ),
            (trainer, "reduce_per_replica"): global_logs(
                model, trainer.reduce_per_replica
            ),
            (TensorFlowTrainer, "_maybe_symbolic_build"): uneven_first_batch(
                TensorFlowTrainer._maybe_symbolic_build
            ),
            (iterator, "_get_iterator"): late_distribution(model),
        }
    ):
        with synchronized_batchnorm(model):
            yield
