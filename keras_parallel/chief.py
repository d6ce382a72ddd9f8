"""Rank 0 alone prints and writes files; every rank decides the same.

Every rank runs Keras's loop and its callbacks, with the same (global) logs,
so `EarlyStopping` and `ReduceLROnPlateau` decide the same everywhere. What
must happen once is silenced on the other ranks while an entry point runs:
the progress bar and the callbacks that write files. Their hooks are
replaced on the *class*, in non-chief processes only, because a
`ShardingCallback` enters after Keras made the `CallbackList` (and its
progress bar): a class attribute is still looked up at every call.

`model.save` / `save_weights` are made to write on rank 0 only, for the
model's whole distributed life, so the usual `model.save(path)` after `fit`
writes one file.
"""

from keras import callbacks

from keras_parallel.instance_methods import replace_methods
from keras_parallel.keras_compat import CALLBACK_HOOKS
from keras_parallel.replacements import Replacements


def _silenced(collective_saving):
    """`{callback class: hooks silenced on non-chief ranks}`."""
    writers = [callbacks.ProgbarLogger, callbacks.CSVLogger, callbacks.TensorBoard]
    if not collective_saving:
        writers.append(callbacks.ModelCheckpoint)
    silenced = {cls: CALLBACK_HOOKS for cls in writers}
    # BackupAndRestore reads its backup on every rank (on_train_begin) and
    # deletes it on rank 0 only; where saving is collective, every rank saves
    # (rank 0 alone writes), else rank 0 alone saves.
    silenced[callbacks.BackupAndRestore] = (
        ("on_train_end",)
        if collective_saving
        else ("on_epoch_end", "on_train_batch_end", "on_train_end")
    )
    return silenced


def _noop(self, *args, **kwargs):
    return None


class ChiefOnlyCallbacks:
    """Silences printing and file-writing callbacks on non-chief ranks.

    Args:
        collective_saving: saving is a collective every rank must join (JAX
            across processes gathers split variables): `ModelCheckpoint`
            and `BackupAndRestore` then run on every rank, and
            `chief_only_saving` makes the model's saves write on rank 0 only.
    """

    def __init__(self, collective_saving=False):
        self.collective_saving = collective_saving
        self._replacements = Replacements()

    def install(self):
        for cls, hooks in _silenced(self.collective_saving).items():
            for hook in hooks:
                self._replacements.replace(cls, hook, _noop)

    def uninstall(self):
        self._replacements.restore()


def chief_only_saving(model, saving=None):
    """Makes `model.save` and `save_weights` write nothing on this (non-chief) rank.

    Args:
        model: the Keras model of a non-chief rank.
        saving: the executor's `saving(model)`, entered instead of writing
            where saving is a collective (JAX across processes).

    Returns:
        A function that undoes it.
    """

    def skip(*args, **kwargs):
        if saving is not None:
            with saving(model):
                pass  # This rank's part of the collective; rank 0 writes.
        return None

    return replace_methods(model, {"save": skip, "save_weights": skip})
