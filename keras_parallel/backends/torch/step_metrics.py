"""How the rank steps make the metrics' results, and a custom step's
logs, global (`metric_states.MetricStates`, `step_logs.ReturnedLogs`)."""

import torch.distributed as dist

from keras_parallel.backends.torch.flat_buffers import on_group_device


class StepMetrics:
    """The metric side of `steps.RankSteps`, mixed into it.

    Reads the steps' state: `_metric_states`, `_global_step_logs` (every
    step's logs made global, or only the epoch's), `_in_step`, `_returned`
    (a custom step's last logs, still local), `_whole`, `_counts` and
    `world_size`.
    """

    def _metrics_result(self):
        # Inside a step whose logs nobody reads, the local results do.
        if self._metric_states.pending and (
            self._global_step_logs or not self._in_step
        ):
            self._reduce_metrics()
        elif not self._in_step:
            self._metric_states.verify()  # What the steps' reductions left.
        return self._original_metrics_result()

    def _global_logs(self, returned):
        """A custom step's logs made global (`step_logs.ReturnedLogs`).

        In the metrics' all-reduce where one is due (once per step, or once
        at the end of the epoch); a step that made them global itself
        (asking for `get_metrics_result`) costs one more for its own numbers.
        """
        if self._metric_states.pending:
            reduced = self._reduce_metrics(returned.packed())
        else:
            reduced = on_group_device(returned.packed())
            dist.all_reduce(reduced)
        return returned.rebuilt(reduced, self.world_size)

    def _epoch_logs(self, keras_method):
        """Keras's `_get_metrics_result_or_logs`, given a custom step's
        last logs made global.

        Keras keeps the last step's logs for the epoch (or the evaluation)
        where their keys differ from `get_metrics_result`'s; without callbacks
        reading step logs they are still this rank's own (`_run`).
        """

        def get_metrics_result_or_logs(logs):
            returned, self._returned = self._returned, None
            if returned is not None and logs is returned.logs:
                logs = self._global_logs(returned)
            return keras_method(logs)

        return get_metrics_result_or_logs

    def _reduce_metrics(self, extra=None):
        """Makes the metric states global (`metric_states.MetricStates`).

        When every step is made global, a batch computed whole by every
        rank counts on one rank only (`_counts`).
        """
        counted = not self._global_step_logs or self._counts(self._whole)
        # Inside a step the batches' comparison waits (no host read per
        # step); outside it (the epoch's end) it is read.
        return self._metric_states.reduce(counted, extra, verify=not self._in_step)
