"""Exact data parallelism under `tf.distribute.MirroredStrategy`.

Keras divides each replica's mean loss by the replica count, which weighs
an uneven batch wrong (docs/tensorflow.md); `patched(model)` weights it by
the replica's share `n / N` and makes each step's logs global.
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
from keras_parallel.keras_seam.replacements import replaced


def exact_scale_loss(keras_scale):
    """Keras's `scale_loss_for_distribution`, weighted by the replica's samples.

    The gradient is that of the replica's mean loss times `n / N`, which
    summed over replicas is the one-device mean. The value is `R` times
    that, so that a custom `train_step` logging `compute_loss`'s result logs
    the global loss (with Keras's scaling, `1 / R` of it). Outside an exact
    replica it is `keras_scale`.
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

    Keras feeds this, with weight `n`, to the loss metric, summed over
    replicas: the global mean. A replica with no sample gives 0, weight 0.
    """

    def unscale_loss(value):
        share = replica_share()
        if share is None:
            return keras_unscale(value)
        if _COUNTED_PER_STEP.on:
            # Weighted 1 per replica and step (`per_output_losses`).
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

    With several outputs Keras logs each output's loss weighted by the
    batch's static size, `None` (weight 1) when batch sizes differ. Each
    replica's update must then carry a value whose mean over the replicas is
    the global loss, not its own mean (a 6/5 split would weigh 5 rows as 6).
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

    Keras averages the replicas' metric results, on a 22/21 split not the
    global accuracy. When a step returns the model's metrics (the default
    steps, or a guide-style `{m.name: m.result() for m in self.metrics}`),
    they are read in cross-replica context, where on-read state sums.
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

    Keras's `synchronized=True` all-reduces each layer's sums and counts
    (three all-reduces per layer and step), as one device sees the batch.
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

    Entered around every entry point (`TensorFlowExecutor.scope`); steps
    traced inside keep the exact versions. Each wraps what was there.
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
