"""When per-step logs must be global numbers, on torch.

Making the loss and metrics of a step global costs one small all-reduce per
step (1.5 ms with gloo between two single-threaded processes here: 4 to 7 %
of a step of the guide's convnet). Keras's epoch logs, `evaluate`'s results
and the History need the global numbers only when the epoch (or the
evaluation) ends. So the all-reduce runs after every step only when some
callback reads per-step logs (a progress bar updated per step, a
`TerminateOnNaN`, a user's `on_train_batch_end`); otherwise the metric
states are summed over ranks once, when Keras reads them at the end.

The choice must be the same on every rank, or the ranks would wait on
different collectives: it depends only on the callbacks the user passed and
`verbose`, which are the same on every rank, never on which hooks a rank
silenced.
"""

from keras import callbacks as keras_callbacks

from keras_parallel.backends.torch.keras_compat import CallbackList, is_default
from keras_parallel.replacements import Replacements

_STEP_HOOKS = ("on_batch_end", "on_train_batch_end", "on_test_batch_end")

# Silenced on ranks other than 0 (`keras_parallel.chief`), so their hooks differ
# between ranks: judged by class, conservatively, never by their hooks.
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

    >>> reads_step_logs(CallbackList([keras.callbacks.History()]))
    False
    """
    for callback in callback_list.callbacks:
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

    While installed, `CallbackList.on_train_begin` and `on_test_begin` first
    pass the run's callbacks to `steps.set_global_step_logs`. The hook is a
    class attribute because a `ShardingCallback` enters after Keras made the
    `CallbackList`.

    Args:
        steps: the `RankSteps` to configure.
    """

    _HOOKS = ("on_train_begin", "on_test_begin")

    def __init__(self, steps):
        self.steps = steps
        self._replacements = Replacements()

    def install(self):
        for name in self._HOOKS:
            self._replacements.replace(
                CallbackList, name, self._hook(getattr(CallbackList, name))
            )

    def uninstall(self):
        self._replacements.restore()

    def _hook(self, begin):
        def hook(callback_list, logs=None):
            self.steps.set_global_step_logs(reads_step_logs(callback_list))
            return begin(callback_list, logs)

        return hook
