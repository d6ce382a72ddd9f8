"""One value per step, weighted by the rows behind it, on torch ranks.

Keras's own steps update their loss tracker with the batch's rows as its
weight (`sample_weight=batch_size`), so summing every rank's update counts
each row once. A custom step as the Keras guide "Customizing what happens
in fit() with PyTorch" writes it updates it with one value per step,
`loss_tracker.update_state(loss)`: weight 1. On one device an epoch's loss
is then the mean of the steps' losses; summed over `W` ranks it is the
mean of `W` per-rank means, which weighs the rows of an uneven batch
(22/21) by their rank, not by their number. Weighting each counting rank's
update by `W` times its share of the batch's rows (`W * n_r / N`) makes
every step weigh `W` in all, and the mean of its updates the step's global
mean: the one-device epoch loss, up to the same factor `W` on every step.
That holds whichever ranks count a step: every rank, the leader of each
data group under ModelParallel (each `W / D`), or one rank for a batch
computed whole (`W`).
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
