"""How the rank steps make the metrics' results, and a custom step's logs,
global (`metric_states.MetricStates`, `step_logs.ReturnedLogs`).

A component of `steps.RankSteps`: the steps hand it each step's `StepRows`
(which rows this rank computed) and call it where Keras asks for results.
"""

import contextlib
import dataclasses

import torch.distributed as dist

from keras_parallel.backends.torch.flat_buffers import on_group_device


@dataclasses.dataclass(frozen=True)
class StepRows:
    """One step's rows, as this rank computes them.

    Attributes:
        rows: the global batch's rows.
        start: this rank's first row of it.
        stop: one past this rank's last row.
        whole: every rank computes the whole batch (one the processes do
            not divide, under ModelParallel; a batch seen by one rank's
            `*_on_batch` alone).
    """

    rows: int
    start: int
    stop: int
    whole: bool


#: Before any step: no rows, split (a rank's own updates count).
NO_ROWS = StepRows(0, 0, 0, False)


class StepMetrics:
    """Makes a rank's metric results and a custom step's logs global.

    Args:
        states: the model's `MetricStates` (its metrics' state variables).
        world_size: how many ranks compute a batch.
        counts: `counts(step_rows)`: whether this rank's metric updates of
            a step count globally (a batch computed whole by every rank is
            counted by one).
        keras_result: the model's own `get_metrics_result`, local.

    Example:

    ```python
    metrics = StepMetrics(states, 2, counts, model.get_metrics_result)
    with metrics.step(StepRows(64, 0, 32, False)):
        logs = keras_train_step(batch)  # calls metrics.result()
    ```
    """

    def __init__(self, states, world_size, counts, keras_result):
        self.states = states
        self.world_size = world_size
        self._counts = counts
        self._keras_result = keras_result
        #: Whether each step's logs are made global (`step_logs`), else at the
        #: epoch's end when Keras reads them; True until a run's callbacks say
        #: otherwise (`train_on_batch` has none).
        self.global_step_logs = True
        #: The rows of the step running, or None between steps.
        self.current = None
        #: The rows of the latest step (what the epoch's reductions count).
        self.latest = NO_ROWS
        #: A custom step's last logs, made global when Keras reads them.
        self._returned = None

    @contextlib.contextmanager
    def step(self, step_rows):
        """A context manager: the step of `step_rows` runs inside it."""
        self.current = self.latest = step_rows
        try:
            yield
        finally:
            self.current = None

    def set_global_step_logs(self, on):
        """Whether each step's logs are made global (`step_logs`)."""
        if self.states.pending and self.current is None:
            self.reduce()  # What the last run left local.
        self.global_step_logs = bool(on)

    def result(self):
        """The model's `get_metrics_result`, made global where due."""
        in_step = self.current is not None
        # Inside a step whose logs nobody reads, the local results do.
        if self.states.pending and (self.global_step_logs or not in_step):
            self.reduce()
        elif not in_step:
            self.states.verify()  # What the steps' reductions left.
        return self._keras_result()

    def keep_returned(self, returned):
        """Keeps a custom step's `ReturnedLogs`, made global when Keras
        reads the epoch's logs (`epoch_logs`)."""
        self._returned = returned

    def global_logs(self, returned):
        """A custom step's logs made global, in the metrics' all-reduce if due.

        A step that made the states global itself costs one more all-reduce.
        """
        if self.states.pending:
            reduced = self.reduce(returned.packed())
        else:
            reduced = on_group_device(returned.packed())
            dist.all_reduce(reduced)
        return returned.rebuilt(reduced, self.world_size)

    def epoch_logs(self, keras_method):
        """Keras's `_get_metrics_result_or_logs`, given a custom step's last
        logs made global (Keras keeps them for the epoch)."""

        def get_metrics_result_or_logs(logs):
            returned, self._returned = self._returned, None
            if returned is not None and logs is returned.logs:
                logs = self.global_logs(returned)
            return keras_method(logs)

        return get_metrics_result_or_logs

    def reduce(self, extra=None):
        """Makes the metric states global (per step, a whole batch counts once)."""
        counted = not self.global_step_logs or self._counts(self.latest)
        # No host read per step: the batches' comparison waits.
        return self.states.reduce(counted, extra, verify=self.current is None)
