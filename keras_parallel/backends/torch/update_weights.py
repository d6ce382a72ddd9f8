"""One value per step, weighted by the rows behind it, on torch ranks.

A custom step that updates a `Mean` with one value per step (the Keras
guide's `loss_tracker.update_state(loss)`) gives it weight 1, and summed over
ranks that weighs an uneven batch's rows by their rank. So each counting
rank's update weighs `W * n_r / N`: every step weighs `W` in all, and the
epoch's mean is one device's.
"""

import contextlib

from keras import metrics as keras_metrics

from keras_parallel.replacements import Replacements


@contextlib.contextmanager
def weighted_per_step_updates(metrics, weight):
    """While in scope, one unweighted value given to a `Mean` weighs `weight`.

    Only a 0-d value without `sample_weight` (one update per step) is
    reweighted: a batch of values, or a value with its own weight, already
    counts rows.

    Args:
        metrics: the model's metrics (`model.metrics`).
        weight: this rank's weight for the step's updates.

    Example:

    >>> with weighted_per_step_updates(model.metrics, 2 * 21 / 43):
    ...     model.train_step(data)
    """
    if weight == 1.0:
        yield
        return
    replacements = Replacements()
    for metric in metrics:
        if isinstance(metric, keras_metrics.Mean):
            replacements.replace(
                metric, "update_state", _weighted(metric.update_state, weight)
            )
    try:
        yield
    finally:
        replacements.restore()


def _weighted(update_state, weight):
    def update(values, sample_weight=None):
        if sample_weight is None and len(getattr(values, "shape", ())) == 0:
            sample_weight = weight
        return update_state(values, sample_weight=sample_weight)

    return update
