"""Exact data parallelism under `tf.distribute.MirroredStrategy`.

Keras's TensorFlow trainer already runs `fit` under a strategy: each replica
computes its loss, divides it by the number of replicas
(`keras.src.losses.loss.scale_loss_for_distribution`), and the optimizer sums
the replicas' gradients. That is the global mean only when every replica has
the same number of samples. The last batch of an epoch does not: 43 samples
over 2 replicas split 22/21, and `(mean_22 + mean_21) / 2` weighs each of the
21 samples more than each of the 22 (measured: 1.2e-2 off one-device training
after one epoch of 1003 samples at batch 64).

This module makes the weighting exact while Keras's trainer runs unchanged,
and `patched` installs what the neighbouring modules make exact:

- `ExactRun.run` (`strategies.py`) (the strategies' `run`) records, in each replica, its sample count
  `n` and the global count `N` (one scalar all-reduce per step);
- while an entry point runs, `scale_loss` multiplies a replica's mean loss
  by `n / N` instead of `1 / num_replicas` in the gradient, so the summed
  gradient is `sum(losses) / N`, the one-device mean, and gives it a value
  whose mean over the replicas is the global loss (what a custom
  `train_step` logs); `unscale_loss` undoes exactly that, so the loss
  metric sees each replica's true mean with weight `n`;
- `global_logs` makes each step's logs the metrics read across replicas
  (the global numbers) rather than the mean of per-replica results;
- `_maybe_symbolic_build` (`element_spec_build.py`) builds the model from the data set's element
  spec, drawing no batch (Keras's own draws one, which loses a generator's
  batches, and averages the replicas' batches, which must then have one
  shape);
- `gradients_summed_first` (`summed_gradients.py`) sums the gradients over the replicas before the
  optimizer clips or accumulates them (Keras's clips each replica's part),
  and the optimizer then updates each replica's copy without `merge_call`,
  which `gradient_accumulation_steps`' `tf.cond` cannot hold;
- `static_keys_in_control_flow` (`collective_keys.py`) keys the collectives of a step that Keras
  calls inside a `tf.cond` (`steps_per_execution > 1`) when they are traced;
- `late_distribution` (`element_spec_build.py`) distributes a data set that Keras did not, and
  builds the optimizer and metrics under the strategy (the first `fit`
  through `ShardingCallback`), and `ExactRun.run` splits
  a batch given whole (`train_on_batch`);
- `synchronized_batchnorm` computes BatchNormalization's batch statistics over
  the global batch (Keras's `synchronized=True`), as one device would.

Keras's own functions are swapped in only inside `patched(model)`, and are
used from there only by steps traced inside it.
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
