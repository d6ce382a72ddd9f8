"""When per-step logs must be global numbers, on torch.

The metrics' all-reduce runs after every step only when a callback reads step
logs (docs/benchmarks.md: 4 to 7 % of a step). Every rank must choose alike,
so the choice reads only the user's callbacks and `verbose`, in the model's
own runs.
"""

import numpy as np
import torch
from keras import callbacks as keras_callbacks

from keras_parallel.backends.torch.keras_compat import is_default
from keras_parallel.keras_seam import callback_lists

_STEP_HOOKS = ("on_batch_end", "on_train_batch_end", "on_test_batch_end")

# Removed on ranks other than 0 (`keras_parallel.run.chief`): judged by class,
# never by their hooks.
_RANK_ZERO_WRITERS = (
    keras_callbacks.ModelCheckpoint,
    keras_callbacks.CSVLogger,
    keras_callbacks.TensorBoard,
    keras_callbacks.BackupAndRestore,
)


def reads_step_logs(callback_list):
    """Whether any callback of a run's `CallbackList` reads each step's logs."""
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

    A callback placed first in the run's list sets it when a `fit` or an
    `evaluate` begins.
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
        # Only this model's runs: a model a callback runs (on rank 0 alone, or
        # distributed) must not change this one's choice.
        if callback_list.model is self.steps.model:
            reads = reads_step_logs(callback_list)

            def choose(phase):
                if phase != "predict":  # A predict logs no metric.
                    self.steps.set_global_step_logs(reads)

            choice = callback_lists.PhaseCallback(on_begin=choose)
            callback_list.callbacks.insert(0, choice)


class ReturnedLogs:
    """The logs a custom step returned, and how each entry is made global.

    An entry that is a metric's result on every rank is read again once the
    states are global; any other number is averaged over the ranks weighted
    by their rows; anything else stays this rank's. `packed`'s size depends on
    the keys alone, so it rides the metrics' all-reduce.

    Args:
        metrics: the model's `metrics`, right after the step.
        rows: the rows this rank counted in the step (0 where another rank
            counts a batch computed whole).
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
        """This rank's part of the all-reduce: flags, weighted numbers, rows."""
        values = self._flags + self._sums + [self._rows]
        return torch.tensor(values, dtype=torch.float64)

    def rebuilt(self, reduced, world_size):
        """A new dict of the logs made global, from `packed()` summed over ranks.

        Read after the metric states are made global.
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
    """`{key: (metric, entry, result)}` for each metric's name and each entry of
    a dict result; a metric's own name wins."""
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
