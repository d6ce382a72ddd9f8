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
  by `n / N` instead of `1 / num_replicas` in the gradient, so the summed
  gradient is `sum(losses) / N`, the one-device mean, and gives it a value
  whose mean over the replicas is the global loss (what a custom
  `train_step` logs); `unscale_loss` undoes exactly that, so the loss
  metric sees each replica's true mean with weight `n`;
- `global_logs` makes each step's logs the metrics read across replicas
  (the global numbers) rather than the mean of per-replica results;
- `_maybe_symbolic_build` builds the model from the data set's element
  spec, drawing no batch (Keras's own draws one, which loses a generator's
  batches, and averages the replicas' batches, which must then have one
  shape);
- `gradients_summed_first` sums the gradients over the replicas before the
  optimizer clips or accumulates them (Keras's clips each replica's part),
  and the optimizer then updates each replica's copy without `merge_call`,
  which `gradient_accumulation_steps`' `tf.cond` cannot hold;
- `static_keys_in_control_flow` keys the collectives of a step that Keras
  calls inside a `tf.cond` (`steps_per_execution > 1`) when they are traced;
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
from tensorflow.python.distribute import values as values_lib

from keras_parallel.backends.tensorflow.keras_compat import (
    BatchNormalization,
    CollectiveAllReduceExtended,
    CollectiveReplicaLauncher,
    MirroredExtended,
    TensorFlowTrainer,
    TFOptimizer,
    tree,
)
from keras_parallel.backends.tensorflow.keras_compat import loss as keras_loss
from keras_parallel.backends.tensorflow.keras_compat import trainer as keras_tf_trainer
from keras_parallel.building import build_from_inputs, is_built
from keras_parallel.replacements import replaced

_replica = threading.local()
_key_bases = itertools.count(start=100_000, step=100_000)
# Set while a replica applies gradients already summed over the replicas.
_summed = threading.local()


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


def _key_fed_through_control_flow():
    """Whether a collective made now gets an instance key `tf.cond` drops.

    TensorFlow gives a collective traced in a `tf.function` an instance key
    fed when the function is called (`capture_call_time_value`), captured
    by the innermost function graph that is not a `tf.cond` or loop body.
    With `steps_per_execution > 1`, Keras's step function (a `tf.function`)
    is called inside a `tf.cond` of its `tf.while_loop`, which does not
    feed such an input: the step fails with "You must feed a value for
    placeholder tensor" (plain Keras under `MirroredStrategy` too).
    """
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):
        graph = graph.outer_graph
    graph = getattr(graph, "outer_graph", None)  # Where it is called from.
    while graph is not None:
        if getattr(graph, "is_control_flow_graph", False):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def static_keys_in_control_flow(keras_use_unique_instance_key):
    """`CollectiveReplicaLauncher._use_unique_instance_key`, off where unfed.

    A collective of a function called inside control flow (see
    `_key_fed_through_control_flow`: the replica step, and the logs read
    across workers in the same function) takes its instance key when it is
    traced, as TensorFlow's graph mode does, instead of a key fed at each
    call that `tf.cond` cannot feed. The keys come from the same counter,
    so they never collide with fed ones; every worker traces the same step
    at the same point of its run, so they agree across workers.

    Args:
        keras_use_unique_instance_key: the method it replaces.

    Returns:
        The replacing method.
    """

    def _use_unique_instance_key(self):
        if _key_fed_through_control_flow():
            return False
        return keras_use_unique_instance_key(self)

    return _use_unique_instance_key


def replica_share():
    """This replica's `n / N` inside `ExactMirroredStrategy.run`, else `None`."""
    return getattr(_replica, "share", None)


def exact_scale_loss(keras_scale):
    """Keras's `scale_loss_for_distribution`, weighted by the replica's samples.

    The gradient is that of the replica's mean loss times `n / N`: summed
    over replicas (as the optimizer sums gradients), `sum(losses) / N`, the
    one-device mean. The value is `R` (the replica count) times that, so
    that its mean over the replicas is the global mean loss: what a custom
    `train_step` that feeds `compute_loss`'s result to a metric (Keras's
    guide does) or returns it must log, as one device would. Keras's own
    scaling returns the gradient's value, so such a step logs `1 / R` of
    the loss. Outside an exact replica it is `keras_scale`, what was there
    before.

    Args:
        keras_scale: the function it replaces.

    Returns:
        The exact `scale_loss_for_distribution`.
    """

    def scale_loss(value):
        share = replica_share()
        if share is None:
            return keras_scale(value)
        scaled = value * tf.cast(share, value.dtype)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        return scaled + tf.stop_gradient(scaled * (replicas - 1))

    return scale_loss


def exact_unscale_loss(keras_unscale):
    """The inverse of `exact_scale_loss`: a replica's own mean loss.

    Keras feeds this, with weight `n`, to the loss metric, whose state is
    summed over replicas: the metric reads the global mean. A replica with
    no sample (a batch smaller than the device count) gives 0 with weight 0.

    Args:
        keras_unscale: the function it replaces.

    Returns:
        The exact `unscale_loss_for_distribution`.
    """

    def unscale_loss(value):
        share = replica_share()
        if share is None:
            return keras_unscale(value)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        weight = tf.cast(share, value.dtype) * replicas
        return tf.math.divide_no_nan(value, weight)

    return unscale_loss


def global_logs(model, keras_reduce_per_replica):
    """Keras's `reduce_per_replica`, with each step's logs made global.

    Keras averages the replicas' metric results, which on a 22/21 split is
    not the global accuracy. When a step returns the model's metrics (the
    default `train_step` and `test_step`, the same test Keras uses at epoch
    end; or `{m.name: m.result() for m in self.metrics}`, as Keras's guide
    writes a custom step, the compiled metrics then nested in one dict),
    they are read instead in cross-replica context, where each metric's
    on-read state sums over replicas: the numbers one device would log, in
    the structure the step returned.
    """

    def reduce_per_replica(values, strategy, reduction):
        if (
            reduction in ("auto", "mean")
            and isinstance(strategy, ExactRun)
            and isinstance(values, dict)
        ):
            metric_logs = model.get_metrics_result()
            if _flat_keys(values) == sorted(metric_logs):
                return {
                    key: (
                        {name: metric_logs[name] for name in value}
                        if isinstance(value, dict)
                        else metric_logs[key]
                    )
                    for key, value in values.items()
                }
        return keras_reduce_per_replica(values, strategy, reduction)

    return reduce_per_replica


def _flat_keys(logs):
    """The names of a step's logs, one level of dicts flattened, sorted."""
    keys = []
    for key, value in logs.items():
        keys += list(value) if isinstance(value, dict) else [key]
    return sorted(keys)


def built_from_element_spec(keras_maybe_symbolic_build):
    """Keras's `_maybe_symbolic_build`, drawing no batch.

    Under a strategy, Keras builds the model (and its loss, metrics and
    optimizer) from a first batch it draws from a new iterator of the data
    set, then starts the epoch on another. A Python generator is not
    replayed: that first iterator's prefetch consumes it, and the epoch sees
    only the two batches Keras peeked (4 batches of 64 trained as 2). And
    Keras averages the replicas' first batches, which fails when they differ
    in size (43 samples over 4 replicas: 11/11/11/10). Only shapes and
    dtypes matter for the build, so it is built from the data set's element
    spec (what one device traces its step with): no batch is drawn.

    Args:
        keras_maybe_symbolic_build: the method it replaces.

    Returns:
        The replacing `_maybe_symbolic_build`.
    """

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is None or not isinstance(strategy, ExactRun):
            return keras_maybe_symbolic_build(self, iterator, data_batch)
        _build_from_element_spec(self, strategy, iterator._distributed_dataset)

    return _maybe_symbolic_build


def _in_exact_replica():
    return (
        tf.distribute.has_strategy()
        and not tf.distribute.in_cross_replica_context()
        and isinstance(tf.distribute.get_strategy(), ExactRun)
    )


def gradients_summed_first(keras_backend_apply_gradients):
    """The optimizer's `_backend_apply_gradients`, on the replicas' summed gradients.

    Keras's optimizer clips (`clipnorm`, `global_clipnorm`, `clipvalue`)
    and accumulates (`gradient_accumulation_steps`) in each replica, on that
    replica's part of the gradient, and sums the parts only when it updates
    the variables. One device clips and accumulates the whole gradient
    (measured: weights 1e-2 off after 8 clipped steps), and the
    accumulation's `tf.cond` cannot hold the update's `merge_call`
    ("merge_call called while defining a new graph"). In a replica of an
    exact strategy the gradients are summed here first, with the one
    all-reduce Keras makes at the update, and Keras's optimizer then runs
    on the sum in each replica, as it does on one device: its own
    all-reduce is then an identity (`summed_once`), and it updates each
    replica's copy of every variable in the replica, without `merge_call`
    (`no_merge_call_on_summed`), as Keras does under XLA on GPUs. Every
    replica applies the same sum to the same values, so the copies stay
    equal.

    Args:
        keras_backend_apply_gradients: the method it replaces.

    Returns:
        The replacing method.
    """

    def _backend_apply_gradients(self, grads, trainable_variables):
        if getattr(_summed, "on", False) or not _in_exact_replica():
            return keras_backend_apply_gradients(self, grads, trainable_variables)
        context = tf.distribute.get_replica_context()
        grads = context.all_reduce(tf.distribute.ReduceOp.SUM, list(grads))
        _summed.on = True
        try:
            return keras_backend_apply_gradients(self, grads, trainable_variables)
        finally:
            _summed.on = False

    return _backend_apply_gradients


def summed_once(keras_all_reduce_sum_gradients):
    """The optimizer's `_all_reduce_sum_gradients`, an identity on summed ones.

    Args:
        keras_all_reduce_sum_gradients: the method it replaces.

    Returns:
        The replacing method (see `gradients_summed_first`).
    """

    def _all_reduce_sum_gradients(self, grads_and_vars):
        if getattr(_summed, "on", False):
            return list(grads_and_vars)
        return keras_all_reduce_sum_gradients(self, grads_and_vars)

    return _all_reduce_sum_gradients


def no_merge_call_on_summed(keras_use_merge_call):
    """A strategy's `_use_merge_call`, `False` while summed gradients are applied.

    `tf.__internal__.distribute.interim.maybe_merge_call` and
    `strategy.extended.update` then run in the replica, on its own copy of
    each variable (see `gradients_summed_first`); elsewhere nothing changes.

    Args:
        keras_use_merge_call: the method it replaces.

    Returns:
        The replacing method.
    """

    def _use_merge_call(self):
        if getattr(_summed, "on", False):
            return False
        return keras_use_merge_call(self)

    return _use_merge_call


def model_built_from_element_spec(model):
    """`model._maybe_symbolic_build` while a plan is applied: drawing no batch.

    Through `ShardingCallback`, a run after the first starts with the
    strategy still attached but outside `patched` (entered at `set_model`,
    after Keras built): Keras's own build would draw a batch (see
    `built_from_element_spec`). Set on the model itself, it holds for
    every run until the plan is released.

    Args:
        model: the Keras model.

    Returns:
        The function to set as the model's `_maybe_symbolic_build`.
    """

    def _maybe_symbolic_build(iterator=None, data_batch=None):
        keras_method = type(model)._maybe_symbolic_build
        return built_from_element_spec(keras_method)(model, iterator, data_batch)

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
            _build_from_element_spec(model, strategy, dataset)
        elif not is_built(model):
            # `predict` of an unbuilt model: Keras would build it inside the
            # traced replica step, where no variable can be made.
            _build_from_element_spec(model, strategy, dataset)
        return dataset

    return _get_iterator


def _symbolic_spec(spec):
    """One replica's spec of a batch element; `None` for an absent one.

    A distributed data set over several local replicas gives a
    `PerReplicaSpec`, whose replicas' specs differ only in device; Keras
    feeds an absent value (no sample weights) as an empty `Optional`.
    """
    if isinstance(spec, values_lib.PerReplicaSpec):
        spec = spec._component_specs[0]
    if isinstance(spec, tf.OptionalSpec):
        return None
    return spec


def _build_from_element_spec(model, strategy, dataset):
    """Builds the model, loss, metrics and optimizer from the data's shapes.

    Nothing is drawn from `dataset` (a generator's batches are not lost).

    Args:
        model: the Keras model.
        strategy: the exact strategy it runs under.
        dataset: a `tf.data.Dataset` or a distributed one (its
            `element_spec`: batch dimension `None`, as one device traces).
    """
    batch = tree.map_structure(_symbolic_spec, dataset.element_spec)
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
            (TensorFlowTrainer, "_maybe_symbolic_build"): built_from_element_spec(
                TensorFlowTrainer._maybe_symbolic_build
            ),
            (iterator, "_get_iterator"): late_distribution(model),
            (TFOptimizer, "_backend_apply_gradients"): gradients_summed_first(
                TFOptimizer._backend_apply_gradients
            ),
            (TFOptimizer, "_all_reduce_sum_gradients"): summed_once(
                TFOptimizer._all_reduce_sum_gradients
            ),
            **{
                (extended, "_use_merge_call"): no_merge_call_on_summed(
                    extended._use_merge_call
                )
                for extended in (MirroredExtended, CollectiveAllReduceExtended)
            },
            (
                CollectiveReplicaLauncher,
                "_use_unique_instance_key",
            ): static_keys_in_control_flow(
                CollectiveReplicaLauncher._use_unique_instance_key
            ),
        }
    ):
        with synchronized_batchnorm(model):
            yield
