"""One value per step, weighted by the rows behind it, on torch ranks.

A custom step's `loss_tracker.update_state(loss)` gives weight 1, which summed
over ranks weighs an uneven batch's rows by rank. Each counting rank's update
weighs `W * n_r / N` instead: every step weighs `W`, as on one device.
"""

import contextlib

from keras import metrics as keras_metrics

from keras_parallel.keras_seam.replacements import Replacements


@contextlib.contextmanager
def weighted_per_step_updates(metrics, weight):
    """While in scope, a 0-d value given to a `Mean` without `sample_weight`
    weighs `weight`; other updates already count rows."""
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
