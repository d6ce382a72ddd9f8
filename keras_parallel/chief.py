"""Rank 0 alone prints and writes files; every rank decides the same.

Every rank runs Keras's callbacks on the same global logs, so `EarlyStopping`
decides alike everywhere; the progress bar and file writers are taken out on
the other ranks, and `model.save` after `fit` writes one file.
"""

from keras import callbacks

from keras_parallel import callback_lists
from keras_parallel.trainer_class import TrainerMixin, swap_class


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


class ChiefOnlySaving(TrainerMixin):
    """On a process other than 0, `save` and `save_weights` write nothing.

    Where saving is a collective (JAX across processes), the process joins it
    (`model._kp_collective_saving`, the executor's `checkpoint_io.saving`).
    """

    def save(self, *args, **kwargs):
        return _join_without_writing(self)

    def save_weights(self, *args, **kwargs):
        return _join_without_writing(self)


def _join_without_writing(model):
    saving = model._kp_collective_saving
    if saving is not None:
        with saving(model):
            pass  # This rank's part of the collective; rank 0 writes.
    return None


def chief_only_saving(model, saving=None):
    """Makes `model.save` and `save_weights` write nothing on this (non-chief) rank.

    Args:
        saving: the executor's `checkpoint_io.saving(model)`, entered instead of writing
            where saving is a collective (JAX across processes).

    Returns:
        A function that undoes it.
    """
    return swap_class(model, ChiefOnlySaving, _kp_collective_saving=saving)
