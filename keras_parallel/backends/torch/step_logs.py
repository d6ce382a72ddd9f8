"""When per-step logs must be global numbers, on torch.

The metrics' all-reduce runs after every step only when a callback reads
per-step logs, else once when Keras reads the results (docs/benchmarks.md:
4 to 7 % of a step). The choice must be the same on every rank, or the ranks
wait on different collectives: it reads only the callbacks the user passed
and `verbose`, never which a rank took out, and only the model's own runs.
"""

import numpy as np
import torch
from keras import callbacks as keras_callbacks

from keras_parallel import callback_lists
from keras_parallel.backends.torch.keras_compat import is_default

_STEP_HOOKS = ("on_batch_end", "on_train_batch_end", "on_test_batch_end")

# Taken out of the runs of ranks other than 0 (`keras_parallel.chief`), or
# with hooks that differ between ranks: judged by class, conservatively,
# never by their hooks.
_RANK_ZERO_WRITERS = (
    keras_callbacks.ModelCheckpoint,
    keras_callbacks.CSVLogger,
    keras_callbacks.TensorBoard,
    keras_callbacks.BackupAndRestore,
)


def reads_step_logs(callback_list):
    """Whether any callback of a run reads the logs of each step.

    Args:
        callback_list: the run's `keras.callbacks.CallbackList`.

    Returns:
        True if the per-step logs must be global numbers.

    Example:

    >>> reads_step_logs(keras.callbacks.CallbackList([keras.callbacks.History()]))
    False
    """
    for callback in callback_lists.every_callback(callback_list):
        if isinstance(callback, keras_callbacks.ProgbarLogger):
            # verbose=2 prints epoch logs only; 0 adds no progress bar.
            if getattr(callback, "verbose", 1) == 1:
                return True
        elif isinstance(callback, _RANK_ZERO_WRITERS):
            return True
        elif any(not is_default(getattr(callback, h)) for h in _STEP_HOOKS):
            return True
    return False


class StepLogPolicy:
    """Tells `RankSteps` at the start of each run whether step logs are read.

    The choice is made from each run's callback list (`callback_lists.py`)
    and put in force by a callback placed first in it, when a `fit` or an
    `evaluate` begins (not a `predict`, which logs no metric).

    Args:
        steps: the `RankSteps` to configure.
    """

    def __init__(self, steps):
        self.steps = steps
        self._remove = None

    def install(self):
        self._remove = callback_lists.add_handler(self._choose, model=self.steps.model)

    def uninstall(self):
        if self._remove is not None:
            self._remove()
            self._remove = None

    def _choose(self, callback_list):
        # Only this model's own runs: a plain model a callback evaluates on
        # rank 0 alone must start no collective, and a distributed model run
        # inside this one's `fit` must not change its choice.
        if callback_list.model is self.steps.model:
            reads = reads_step_logs(callback_list)

            def choose(phase):
                if phase != "predict":  # A predict logs no metric.
                    self.steps.set_global_step_logs(reads)

            choice = callback_lists.PhaseCallback(on_begin=choose)
            callback_list.callbacks.insert(0, choice)


class ReturnedLogs:
    """The logs a custom step returned, and how each entry is made global.

    Keras's own steps return the metrics' results read through
    `get_metrics_result`, which `RankSteps` makes global. A custom step (as
    the Keras guide "Customizing what happens in fit() with PyTorch" writes
    it) returns `{m.name: m.result() for m in self.metrics}`, read from this
    rank's metric state inside the step, and Keras keeps those logs for the
    callbacks, the History and `evaluate` (the keys differ from
    `get_metrics_result`'s: `compile_metrics` holds a dict). Each entry is
    made global here:

    - a metric's result (its key names a metric of the model, or an entry of
      a metric's dict result, and its value is what that `result()` gives on
      this rank after the step): read again once the metric states are
      global, the same on every rank;
    - any other number (a 0-d tensor, a Python number): the mean over ranks
      weighted by the rows each rank computed, the one-process number for a
      mean over the batch (a loss), not for a sum or a maximum;
    - anything else (a tensor of another shape): this rank's own.

    An entry is a metric's result only where every rank finds it one. What
    the ranks add (`packed`) has a size set by the keys alone, so it rides
    the metrics' all-reduce with no collective of its own.

    Args:
        logs: the dict the step returned.
        metrics: the model's `metrics`, as they are right after the step.
        rows: the rows of the global batch this rank counted in the step (0
            where another rank counts them: a batch computed whole).
    """

    def __init__(self, logs, metrics, rows):
        self.logs = logs
        self._rows = float(rows)
        local = _metric_results(metrics)
        #: key -> (metric, entry of its dict result or None).
        self._metric_keys = {}
        self._flags = []
        self._sums = []
        for key, value in logs.items():
            found = local.get(key)
            is_result = found is not None and _same(value, found[2])
            if is_result:
                self._metric_keys[key] = found[:2]
            self._flags.append(1.0 if is_result else 0.0)
            number = _number(value)
            self._sums.append(0.0 if number is None else number * self._rows)

    def packed(self):
        """This rank's part of the all-reduce: flags, weighted numbers, rows.

        Returns:
            A float64 tensor of `2 * len(logs) + 1` values.
        """
        values = self._flags + self._sums + [self._rows]
        return torch.tensor(values, dtype=torch.float64)

    def rebuilt(self, reduced, world_size):
        """The logs, every entry global (read after the metric states are).

        Args:
            reduced: `packed()` summed over the ranks.
            world_size: the number of ranks.

        Returns:
            A new dict with the step's keys.
        """
        n = len(self.logs)
        reduced = reduced.tolist()
        flags, sums, rows = reduced[:n], reduced[n : 2 * n], reduced[2 * n]
        results = {}
        out = {}
        for i, (key, value) in enumerate(self.logs.items()):
            if key in self._metric_keys and flags[i] == world_size:
                metric, entry = self._metric_keys[key]
                if id(metric) not in results:
                    results[id(metric)] = metric.result()
                result = results[id(metric)]
                out[key] = result if entry is None else result[entry]
            elif _number(value) is not None and rows > 0:
                out[key] = _number_like(value, sums[i] / rows)
            else:
                out[key] = value
        return out


def _metric_results(metrics):
    """`{key: (metric, entry, result)}`: each metric's result under its name,
    and each entry of a dict result (`compile_metrics`) under its key; a
    metric's own name wins."""
    found, entries = {}, {}
    for metric in metrics:
        try:
            result = metric.result()
        except ValueError:
            continue  # Never built (`CompileMetrics`): no step returned it.
        found.setdefault(metric.name, (metric, None, result))
        if isinstance(result, dict):
            for key, value in result.items():
                entries.setdefault(key, (metric, key, value))
    for key, item in entries.items():
        found.setdefault(key, item)
    return found


def _same(a, b):
    """Whether two log values are equal (tensors, numbers, dicts of them)."""
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict)
            and isinstance(b, dict)
            and a.keys() == b.keys()
            and all(_same(a[k], b[k]) for k in a)
        )
    if a is b:
        return True
    if torch.is_tensor(a) and torch.is_tensor(b):
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and torch.equal(a, b)
        )
    try:
        return float(a) == float(b)
    except (TypeError, ValueError, RuntimeError):
        return False


def _number(value):
    """A 0-d tensor's or a Python number's value as a float, else `None`."""
    if torch.is_tensor(value):
        if value.ndim or value.is_complex() or value.dtype == torch.bool:
            return None
        return float(value.detach())
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        return float(value)
    return None


def _number_like(value, number):
    """`number` as a tensor like `value` (floating), or a Python float."""
    if torch.is_tensor(value):
        dtype = value.dtype if value.is_floating_point() else torch.float64
        return torch.tensor(number, dtype=dtype, device=value.device)
    return float(number)
