"""How the rank steps make the metrics' results, and a custom step's
logs, global (`metric_states.MetricStates`, `step_logs.ReturnedLogs`)."""

import torch.distributed as dist

from keras_parallel.backends.torch.flat_buffers import on_group_device


class StepMetrics:
    """The metric side of `steps.RankSteps`, mixed into it."""

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
        """A custom step's logs made global, in the metrics' all-reduce if due.

        A step that made the states global itself costs one more all-reduce.
        """
        if self._metric_states.pending:
            reduced = self._reduce_metrics(returned.packed())
        else:
            reduced = on_group_device(returned.packed())
            dist.all_reduce(reduced)
        return returned.rebuilt(reduced, self.world_size)

    def _epoch_logs(self, keras_method):
        """Keras's `_get_metrics_result_or_logs`, given a custom step's last
        logs made global (Keras keeps them for the epoch)."""

        def get_metrics_result_or_logs(logs):
            returned, self._returned = self._returned, None
            if returned is not None and logs is returned.logs:
                logs = self._global_logs(returned)
            return keras_method(logs)

        return get_metrics_result_or_logs

    def _reduce_metrics(self, extra=None):
        """Makes the metric states global (per step, a whole batch counts once)."""
        counted = not self._global_step_logs or self._counts(self._whole)
        # No host read per step: the batches' comparison waits.
        return self._metric_states.reduce(counted, extra, verify=not self._in_step)
