"""Preemption: a signal ends `fit` at a step every process agrees on, backed up.

While an entry point runs, `PreemptionWatch` turns SIGTERM or SIGUSR1 into a
flag (the handler does nothing else: it may run in the middle of a collective).
The processes agree on a stop step (`stop_agreement`), the `BackupAndRestore`
in `fit`'s callbacks writes its backup there, and `fit` raises `Preempted`, a
`SystemExit` with code 75, so the same command resumes (docs/checkpoints.md).
"""

import os
import signal
import sys
import threading
import time

from keras.callbacks import BackupAndRestore, CallbackList

from keras_parallel.keras_seam.replacements import Replacements
from keras_parallel.persistence import signal_actions
from keras_parallel.persistence.backup import progress_of as backup_progress
from keras_parallel.persistence.preemption_settings import (
    PREEMPTED_EXIT_CODE,
    grace_seconds,
    preemption_signals,
)
from keras_parallel.persistence.stop_agreement import StopAgreement


class Preempted(SystemExit):
    """`fit` stopped on a preemption signal, after writing its backup.

    A `SystemExit` with code `PREEMPTED_EXIT_CODE`: uncaught, the script
    exits with it.

    Attributes:
        epoch: the epoch it stopped in.
        batch: the last batch of that epoch it trained.
        backup_dir: the folder of the backup written, or None.
    """

    def __init__(self, message, epoch, batch, backup_dir):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message
        self.epoch = epoch
        self.batch = batch
        self.backup_dir = backup_dir

    def __str__(self):
        return self.message


class PreemptionWatch:
    """Installs the signal handlers and the stop agreement while an entry
    point runs.

    Args:
        executor: the binding's executor (its processes and their store).
        heartbeat: the run's `Heartbeat`, whose ticks look for a notice
            (None: the agreement's own).
    """

    #: Entry points watched so far in this process: every process counts
    #: the same ones, so the count names one entry point's keys in the
    #: processes' store.
    _entries = 0

    def __init__(self, executor, heartbeat=None):
        self.executor = executor
        self.heartbeat = heartbeat
        self.received = None
        self.agreement = None
        self._step = -1
        self._stopped = False
        self._timer = None
        self._at_epoch_end = None
        self._installed = {}
        self._replacements = Replacements()

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            return  # Python sets signal handlers in the main thread only.
        PreemptionWatch._entries += 1
        numbers = preemption_signals()
        if not numbers:
            return
        self.agreement = StopAgreement(
            self.executor.key_value_store(),
            self.executor.process_index,
            self.executor.num_processes,
            prefix=str(PreemptionWatch._entries),
            timeout=grace_seconds(),
        )
        for number in numbers:
            self._installed[number] = signal_actions.install(number, self._on_signal)
        self.agreement.start(self.heartbeat)
        keras_batch_end = CallbackList.on_train_batch_end
        keras_epoch_end = CallbackList.on_epoch_end
        watch = self

        def on_train_batch_end(callback_list, batch, logs=None):
            keras_batch_end(callback_list, batch, logs)
            if watch.agreed_to_stop():
                if batch + 1 >= (callback_list.params.get("steps") or batch + 2):
                    # The epoch's last batch: its end (validation, epoch-end
                    # callbacks, backup) runs first; it resumes at the next epoch.
                    watch._at_epoch_end = batch
                else:
                    watch.stop(callback_list, batch)

        def on_epoch_end(callback_list, epoch, logs=None):
            keras_epoch_end(callback_list, epoch, logs)
            if watch._at_epoch_end is not None:
                watch.stop(callback_list, watch._at_epoch_end, epoch_ended=True)

        self._replacements.replace(
            CallbackList, "on_train_batch_end", on_train_batch_end
        )
        self._replacements.replace(CallbackList, "on_epoch_end", on_epoch_end)

    def uninstall(self):
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        if self.agreement is not None:
            self.agreement.close()
        self._replacements.restore()
        for number, installed in self._installed.items():
            signal_actions.restore(number, installed)
        self._installed = {}

    def __enter__(self):
        self.install()
        return self

    def __exit__(self, error_type, error, traceback):
        pending = self.received if not self._stopped else None
        self.uninstall()
        if pending is not None and not isinstance(error, Preempted):
            # The signal came and the run did not stop for it: the entry
            # point failed after it (torchrun sends SIGTERM to the group when
            # another process fails) or ended before the agreed step. The
            # signal keeps its own meaning, as without this watch: a launcher
            # names the process that failed first, a scheduler's stop ends it.
            os.kill(os.getpid(), pending)
        return False

    def _on_signal(self, number, frame):
        if self.received is not None:
            # A second signal (or the grace ran out): its own meaning, now.
            installed = self._installed.pop(number, None)
            if installed is not None:
                signal_actions.restore(number, installed)
            else:
                signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
            return
        self.received = signal.Signals(number)
        self._timer = threading.Timer(
            grace_seconds(), self._grace_ran_out, args=(number,)
        )
        self._timer.daemon = True
        self._timer.start()

    def _grace_ran_out(self, number):
        """No agreed stop within the grace (a process that does not answer, a
        batch that does not end): the signal is sent again, for the handler to
        give it its own meaning; 5 s later, the watch still in force (the main
        thread stuck in a native call, a native handler that only records
        signals), the process exits with the signal's status."""
        if self._timer is None:
            return  # The watch ended in time (cancelled as it fired).
        os.kill(os.getpid(), number)
        time.sleep(5.0)
        if self._timer is not None:
            os._exit(128 + number)

    def agreed_to_stop(self):
        """Whether every process stops after this batch (every process
        calls it after every batch; no collective)."""
        self._step += 1
        signalled = self.received.name if self.received is not None else None
        return self.agreement.should_stop(self._step, signalled)

    def stop(self, callback_list, batch, epoch_ended=False):
        """Writes the backup at this step and raises `Preempted`.

        Args:
            callback_list: `fit`'s callbacks.
            batch: the last batch trained.
            epoch_ended: the epoch's end ran (its last batch was the one):
                the backup resumes at the next epoch.
        """
        self._stopped = True
        found = (c for c in callback_list.callbacks if isinstance(c, BackupAndRestore))
        backup = next(found, None)
        epoch = None if backup is None else backup_progress(backup).epoch
        directory = None if backup is None else backup.backup_dir
        if backup is not None:
            if not epoch_ended:
                backup._last_batch_seen = batch
            backup._save_model()
            said = (
                f"backup written to {directory!r}; run the same command "
                "to resume from this step"
            )
        else:
            said = (
                "nothing was saved: add keras.callbacks.BackupAndRestore(dir) "
                "to fit's callbacks to resume from here"
            )
        if self.executor.num_processes > 1:
            # No process exits before the backup is whole: a launcher ends
            # the others when one exits.
            self.executor.barrier()
        message = (
            f"keras_parallel: preempted ({self._cause()}): stopped after batch "
            f"{batch}"
            + (f" of epoch {epoch}" if epoch is not None else "")
            + f"; {said}. Exiting with code {PREEMPTED_EXIT_CODE}."
        )
        if self.executor.is_chief or self.received is not None:
            print(message, file=sys.stderr, flush=True)
        callback_list.model.stop_training = True
        raise Preempted(message, epoch, batch, directory)

    def _cause(self):
        """Which process got which signal, for the message."""
        if self.received is not None:
            return f"{self.received.name} reached process {self.executor.process_index}"
        rank, name = self.agreement.noticed or (None, None)
        if rank is not None and name:
            return f"{name} reached process {rank}"
        return "another process got a preemption signal"
