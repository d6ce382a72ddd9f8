"""Exact data parallelism under `tf.distribute.MirroredStrategy`.

Keras divides each replica's mean loss by the replica count, which weighs
an uneven last batch wrong (docs/tensorflow.md). `patched(model)`, entered
while an entry point runs, weights it by the replica's share `n / N`, makes
each step's logs global, and installs the fixes of `element_spec_build`,
`summed_gradients` and `collective_keys`; steps traced inside keep them.
"""

import contextlib
import threading

import tensorflow as tf

from keras_parallel.backends.tensorflow.collective_keys import (
    static_keys_in_control_flow,
)
from keras_parallel.backends.tensorflow.element_spec_build import (
    built_from_element_spec,
    late_distribution,
)
from keras_parallel.backends.tensorflow.keras_compat import (
    BatchNormalization,
    CollectiveAllReduceExtended,
    CollectiveReplicaLauncher,
    CompileLoss,
    MirroredExtended,
    TensorFlowTrainer,
    TFOptimizer,
    tree,
)
from keras_parallel.backends.tensorflow.keras_compat import loss as keras_loss
from keras_parallel.backends.tensorflow.keras_compat import trainer as keras_tf_trainer
from keras_parallel.backends.tensorflow.strategies import ExactRun, replica_share
from keras_parallel.backends.tensorflow.summed_gradients import (
    gradients_summed_first,
    no_merge_call_on_summed,
    summed_once,
)
from keras_parallel.replacements import replaced


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
        if _COUNTED_PER_STEP.on:
            # Weighted 1 per replica and step (`per_output_losses`): the
            # value whose mean over the replicas is the global loss.
            return value
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        weight = tf.cast(share, value.dtype) * replicas
        return tf.math.divide_no_nan(value, weight)

    return unscale_loss


class _CountedPerStep(threading.local):
    """Whether the loss being unscaled is tracked with weight 1 per update."""

    on = False


_COUNTED_PER_STEP = _CountedPerStep()


def per_output_losses(keras_call):
    """Keras's `CompileLoss.call`, its per-output loss logs made exact.

    With several outputs, Keras logs each output's loss (`main_loss`, ...)
    in a mean weighted by the batch's static size, unknown (`None`, weight
    1) when the batches differ in size: one device averages the steps'
    losses. A replica's update of weight 1 must then carry the value whose
    mean over the replicas is the step's global loss, not the replica's own
    mean (on a 6/5 split that weighs the 5 rows like the 6).

    Args:
        keras_call: the method it replaces.

    Returns:
        The exact `CompileLoss.call`.
    """

    def call(self, y_true, y_pred, sample_weight=None):
        flat = tree.flatten(y_pred)
        unknown = bool(flat) and flat[0].shape[0] is None
        was = _COUNTED_PER_STEP.on
        _COUNTED_PER_STEP.on = unknown
        try:
            return keras_call(self, y_true, y_pred, sample_weight)
        finally:
            _COUNTED_PER_STEP.on = was

    return call


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
            (CompileLoss, "call"): per_output_losses(CompileLoss.call),
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
