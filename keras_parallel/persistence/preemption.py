"""Preemption: a signal ends `fit` at a step every process agrees on, backed up.

In one process for now (across processes a signal keeps its own
meaning; see `install`). A cluster warns a job before it kills it: SLURM sends SIGTERM (and, with
`--signal=USR1@90`, SIGUSR1 ahead of time), Kubernetes sends SIGTERM. While
a keras_parallel entry point runs, `PreemptionWatch` turns those signals
into a flag (the handler does nothing else: it may run in the middle of a
collective). After every training batch the processes agree whether any of
them got one (a sum over processes of the flags: every process stops at
the same step, whichever got the signal). Then, at that step:

- the `keras.callbacks.BackupAndRestore` in `fit`'s callbacks writes its
  backup there (keras_parallel's exact one: `persistence/backup.py`, mid-
  epoch included), so that the same command resumes where it stopped;
- `fit` raises `Preempted`, a `SystemExit` with code `PREEMPTED_EXIT_CODE`
  (75, `EX_TEMPFAIL`: "try again later"): no epoch-end callback runs (the
  epoch is not over) and the backup is not deleted (`BackupAndRestore`
  deletes it at the end of training). A script that does nothing exits
  with that code; one that catches it can clean up first.

Without a `BackupAndRestore` in `fit` the run still stops and exits with
that code, and says that nothing was saved. A process that reaches no
batch end within `KERAS_PARALLEL_PREEMPTION_GRACE` seconds (default 20)
of the signal ends as the signal would have ended it.
"""

import os
import signal
import sys
import threading
import time

from keras import callbacks
from keras.callbacks import CallbackList

from keras_parallel.replacements import Replacements

#: The exit code of a preempted run (sysexits.h's EX_TEMPFAIL): the job
#: was stopped on request and resumes when started again.
PREEMPTED_EXIT_CODE = 75

#: The environment variable naming the signals that preempt (comma-separated
#: names); SIGTERM and SIGUSR1 unless set. `none` turns the watch off.
SIGNALS_VARIABLE = "KERAS_PARALLEL_PREEMPTION_SIGNALS"
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
#: The environment variable giving the seconds a process may take, after
#: the signal, to reach the end of a batch (default `DEFAULT_GRACE_S`).
GRACE_VARIABLE = "KERAS_PARALLEL_PREEMPTION_GRACE"
#: Under the 30 s SLURM (`KillWait`) and Kubernetes
#: (`terminationGracePeriodSeconds`) leave between SIGTERM and SIGKILL.
DEFAULT_GRACE_S = 20.0


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


def preemption_signals(environ=None):
    """The signals that preempt, from `KERAS_PARALLEL_PREEMPTION_SIGNALS`.

    Args:
        environ: the environment to read; `os.environ` if None.

    Returns:
        A tuple of `signal.Signals` (empty when the variable says `none`).

    Raises:
        ValueError: the variable names a signal this system does not have.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(SIGNALS_VARIABLE, ",".join(DEFAULT_SIGNALS)).strip()
    if text.lower() in ("none", "off", ""):
        return ()
    found = []
    for name in (part.strip().upper() for part in text.split(",")):
        name = name if name.startswith("SIG") else f"SIG{name}"
        number = getattr(signal, name, None)
        if not isinstance(number, signal.Signals):
            raise ValueError(
                f"{SIGNALS_VARIABLE} names a signal this system does not have. "
                f"Received: {text!r}; name signals such as SIGTERM,SIGUSR1, "
                "or `none` to turn the preemption watch off."
            )
        found.append(number)
    return tuple(found)


class PreemptionWatch:
    """Installs the signal handlers and the per-batch agreement while an
    entry point runs.

    Args:
        executor: the binding's executor (its processes and their sum).
    """

    def __init__(self, executor):
        self.executor = executor
        self.received = None
        self._timer = None
        self._at_epoch_end = None
        self._previous = {}
        self._replacements = Replacements()

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            return  # Python sets signal handlers in the main thread only.
        if self.executor.num_processes > 1:
            # Not yet across processes: the agreement after every batch is a
            # collective, which changes which process a launcher names
            # first when one fails; until that is handled and tested, a
            # signal keeps its own meaning there.
            return
        for number in preemption_signals():
            self._previous[number] = signal.signal(number, self._on_signal)
        if not self._previous:
            return
        keras_batch_end = CallbackList.on_train_batch_end
        keras_epoch_end = CallbackList.on_epoch_end
        watch = self

        def on_train_batch_end(callback_list, batch, logs=None):
            keras_batch_end(callback_list, batch, logs)
            if watch.agreed_to_stop():
                if batch + 1 >= (callback_list.params.get("steps") or batch + 2):
                    # The epoch's last batch: its end (validation, epoch-end
                    # callbacks and backup) runs first, and the run resumes
                    # at the next epoch.
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
        self._cancel_grace()
        self._replacements.restore()
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}

    def __enter__(self):
        self.install()
        return self

    def __exit__(self, error_type, error, traceback):
        self.uninstall()
        if error is not None and not isinstance(error, Preempted) and self.received:
            # The entry point failed after a signal came: a launcher ending
            # the group because another process failed (torchrun sends
            # SIGTERM then). The signal keeps its own meaning, as it would
            # have without this watch, so the launcher names the process
            # that failed first.
            os.kill(os.getpid(), self.received)
        return False

    def _on_signal(self, number, frame):
        if self.received is not None:
            # A second signal (or the grace ran out): the signal's own
            # meaning, now.
            previous = self._previous.get(number)
            signal.signal(number, previous if callable(previous) else signal.SIG_DFL)
            os.kill(os.getpid(), number)
            return
        self.received = signal.Signals(number)
        grace = float(os.environ.get(GRACE_VARIABLE, DEFAULT_GRACE_S))
        self._timer = threading.Timer(grace, self._grace_ran_out, args=(number,))
        self._timer.daemon = True
        self._timer.start()

    def _cancel_grace(self):
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _grace_ran_out(self, number):
        """No batch ended within the grace (a process waiting on something
        else): the signal is sent again, which the handler turns into its
        own meaning; a main thread that runs no Python code for 5 s more
        (stuck in a native call) ends with the signal's exit status."""
        if self._timer is None:
            return  # The watch ended in time (cancelled as it fired).
        os.kill(os.getpid(), number)
        time.sleep(5.0)
        if self._timer is not None:
            os._exit(128 + number)

    def agreed_to_stop(self):
        """Whether any process got a preemption signal (a collective when
        several processes run: every one calls it after every batch)."""
        flag = 1.0 if self.received is not None else 0.0
        if self.executor.num_processes == 1:
            return bool(flag)
        return float(self.executor.reduce(flag, op="sum")) > 0

    def stop(self, callback_list, batch, epoch_ended=False):
        """Writes the backup at this step and raises `Preempted`.

        Args:
            callback_list: `fit`'s callbacks.
            batch: the last batch trained.
            epoch_ended: the epoch's end ran (its last batch was the one):
                the backup resumes at the next epoch.
        """
        model = callback_list.model
        backup = next(
            (
                c
                for c in callback_list.callbacks
                if isinstance(c, callbacks.BackupAndRestore)
            ),
            None,
        )
        epoch = getattr(backup, "_kp_epoch", None)
        here = self.received.name if self.received is not None else None
        cause = (
            f"{here} reached process {self.executor.process_index}"
            if here
            else "another process got a preemption signal"
        )
        if backup is not None:
            if not epoch_ended:
                backup._last_batch_seen = batch
            backup._save_model()
            said = (
                f"backup written to {backup.backup_dir!r}; run the same command "
                "to resume from this step"
            )
            directory = backup.backup_dir
        else:
            said = (
                "nothing was saved: add keras.callbacks.BackupAndRestore(dir) "
                "to fit's callbacks to resume from here"
            )
            directory = None
        message = (
            f"keras_parallel: preempted ({cause}): stopped after batch {batch}"
            + (f" of epoch {epoch}" if epoch is not None else "")
            + f"; {said}. Exiting with code {PREEMPTED_EXIT_CODE}."
        )
        if self.executor.is_chief or here:
            print(message, file=sys.stderr, flush=True)
        model.stop_training = True
        raise Preempted(message, epoch, batch, directory)
