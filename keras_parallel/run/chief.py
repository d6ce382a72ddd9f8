"""Rank 0 alone prints and writes files; every rank decides the same.

Every rank runs Keras's callbacks on the same global logs, so `EarlyStopping`
decides alike everywhere; the progress bar and file writers are taken out on
the other ranks, and `model.save` after `fit` writes one file. What rank 0
writes in a call is in place when the call returns on any rank
(`chief_writes`).
"""

from keras import callbacks

from keras_parallel.keras_seam import callback_lists
from keras_parallel.keras_seam.overrides import Overrides, override


def _rank_zero_callbacks(collective_saving):
    """The callback classes that run on rank 0 only."""
    writers = (callbacks.ProgbarLogger, callbacks.CSVLogger, callbacks.TensorBoard)
    if collective_saving:
        # Every rank saves (its part of the collective); rank 0 alone writes.
        return writers
    return writers + (callbacks.ModelCheckpoint,)


class ChiefOnlyCallbacks:
    """Takes printing and file-writing callbacks out of non-chief ranks' runs.

    Args:
        collective_saving: saving is a collective every rank joins (JAX across
            processes): `ModelCheckpoint` then runs on every rank.
        model: the model whose run may be under way at `install` (a plan
            applied inside `fit`): that run's list is edited too.
    """

    def __init__(self, collective_saving=False, model=None):
        self.kinds = _rank_zero_callbacks(collective_saving)
        self.model = model
        self._remove = None

    def install(self):
        self._remove = callback_lists.add_handler(
            lambda callback_list: callback_lists.remove_callbacks(
                callback_list, self.kinds
            ),
            model=self.model,
        )

    def uninstall(self):
        if self._remove is not None:
            self._remove()
            self._remove = None


class ChiefOnlySaving(Overrides):
    """On a process other than 0, `save` and `save_weights` write nothing,
    and return once process 0's file is written.

    Args:
        saving: where saving is a collective (JAX across processes), the
            executor's `checkpoint_io.saving`, which the process joins;
            else None.
        writes: a `ChiefWrites`, which waits for process 0's record of the
            same call, or None for one process.
    """

    names = ("save", "save_weights")

    def __init__(self, saving, writes):
        self.saving = saving
        self.writes = writes

    def save(self, *args, **kwargs):
        return self._join_without_writing(_path(args, kwargs))

    def save_weights(self, *args, **kwargs):
        return self._join_without_writing(_path(args, kwargs))

    def _join_without_writing(self, path):
        with _writing(self.writes, path):
            if self.saving is not None:
                with self.saving(self.model):
                    pass  # This rank's part of the collective; rank 0 writes.
        return None


class ChiefSaving(Overrides):
    """On process 0 of several, `save` and `save_weights` tell the other
    processes once the file is written, or that writing it failed.

    Args:
        writes: the run's `ChiefWrites`, or None.
    """

    names = ("save", "save_weights")

    def __init__(self, writes):
        self.writes = writes

    def save(self, *args, **kwargs):
        with _writing(self.writes, _path(args, kwargs)):
            return self.overridden.save(*args, **kwargs)

    def save_weights(self, *args, **kwargs):
        with _writing(self.writes, _path(args, kwargs)):
            return self.overridden.save_weights(*args, **kwargs)


def _path(args, kwargs):
    return args[0] if args else kwargs.get("filepath")


def _writing(writes, path):
    import contextlib

    if writes is None:
        return contextlib.nullcontext()
    return writes.writing("save", path)


def chief_saving(model, writes):
    """Makes process 0's `model.save` and `save_weights` tell the others
    when the file is written (`ChiefSaving`).

    Args:
        model: the model of process 0.
        writes: the run's `ChiefWrites`.

    Returns:
        A function that undoes it.
    """
    return override(model, ChiefSaving(writes))


class FitWrites(callbacks.Callback):
    """Last in each run's callbacks: at the end of `fit`, process 0 says
    that what its callbacks wrote (a `ModelCheckpoint`'s files) is in
    place; every other process waits for that before `fit` returns."""

    async_safe = True  # No batch hook.

    def __init__(self, writes):
        super().__init__()
        self.writes = writes

    def on_train_end(self, logs=None):
        with self.writes.writing("fit"):
            pass  # The chief's callbacks wrote before this, the last one.


class ChiefWritesInFit:
    """Puts a `FitWrites` last in each run's callbacks (every process of
    several), installed while an entry point runs, as `ChiefOnlyCallbacks`;
    meanwhile a save (a callback's) is left to the end of `fit`.

    Args:
        writes: the run's `ChiefWrites`.
        model: the model whose run may be under way at `install`.
    """

    def __init__(self, writes, model=None):
        self.writes = writes
        self.model = model
        self._remove = None

    def install(self):
        self._entry_point = self.writes.entry_point()
        self._entry_point.__enter__()
        self._remove = callback_lists.add_handler(
            lambda callback_list: callback_lists.append_callback(
                callback_list, FitWrites(self.writes)
            ),
            model=self.model,
        )

    def uninstall(self):
        if self._remove is not None:
            self._remove()
            self._remove = None
            self._entry_point.__exit__(None, None, None)


def chief_only_saving(model, saving=None, writes=None):
    """Makes `model.save` and `save_weights` write nothing on this (non-chief) rank.

    Args:
        saving: the executor's `checkpoint_io.saving(model)`, entered instead of writing
            where saving is a collective (JAX across processes).
        writes: the run's `ChiefWrites`: each call returns once process 0
            wrote its file (None: at once).

    Returns:
        A function that undoes it.
    """
    return override(model, ChiefOnlySaving(saving, writes))


def process_saving(model, executor, saving=None):
    """The saving override of one process of several (`Executor.saving_override`).

    Process 0 writes and tells the others (`ChiefSaving`); the others write
    nothing and wait for its record (`ChiefOnlySaving`), joining `saving`
    where saving is a collective.

    Args:
        model: this process's model.
        executor: the run's executor (`is_chief`, `chief_writes`).
        saving: the executor's `checkpoint_io.saving`, where saving is a
            collective (JAX across processes); else None.

    Returns:
        A function that puts the override in force and returns its undo.
    """
    writes = executor.chief_writes()
    if executor.is_chief:
        return lambda: chief_saving(model, writes)
    return lambda: chief_only_saving(model, saving, writes)
