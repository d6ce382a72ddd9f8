"""The stall watch's place in a run: counts Keras's loop events and ticks
a `StallWatch` (`run/stall_watch.py`) while an entry point runs.
"""

import os

from keras.callbacks import CallbackList

from keras_parallel.keras_seam.replacements import Replacements
from keras_parallel.run import stall_watch
from keras_parallel.run.stall_settings import LAUNCHED_VARIABLE, stall_timeout

_EVENTS = (
    "on_epoch_begin",
    "on_epoch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
)


class StallWatchPart:
    """Counts Keras's loop events and ticks a `StallWatch` while an entry
    point runs (several processes only; `Run` installs it).

    Args:
        executor: the run's executor (its processes and store).
        heartbeat: the run's `Heartbeat`.
    """

    #: Entry points watched so far in this process: every process counts
    #: the same ones, so the count names one entry point's keys.
    _entries = 0

    def __init__(self, executor, heartbeat):
        self.executor = executor
        self.heartbeat = heartbeat
        self.watch = None
        self._replacements = Replacements()

    def __enter__(self):
        self.install()
        return self

    def __exit__(self, error_type, error, traceback):
        self.uninstall()
        return False

    def install(self):
        StallWatchPart._entries += 1
        executor = self.executor
        timeout = stall_timeout()
        if executor.num_processes == 1 or timeout is None:
            return
        watch = stall_watch.StallWatch(
            executor.key_value_store(),
            executor.process_index,
            executor.num_processes,
            str(StallWatchPart._entries),
            timeout,
            launched=LAUNCHED_VARIABLE in os.environ,
        )
        self.watch = watch
        stall_watch._current[0] = watch
        for event in _EVENTS:
            self._replacements.replace(
                CallbackList,
                event,
                _counted(getattr(CallbackList, event), event, watch),
            )
        self.heartbeat.add(watch.tick)
        self.heartbeat.start()

    def uninstall(self):
        if self.watch is not None:
            self.watch._ended = True
            if stall_watch._current[0] is self.watch:
                stall_watch._current[0] = None
        self._replacements.restore()


def _counted(keras_event, event, watch):
    epoch_event = event.startswith("on_epoch")

    def counted(callback_list, step, logs=None):
        if epoch_event:
            watch.moved(event, epoch=step)
        else:
            watch.moved(event, epoch=watch.epoch, batch=step)
        return keras_event(callback_list, step, logs)

    return counted
