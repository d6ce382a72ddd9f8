"""The first batch Keras builds a model from, seen as Keras draws it.

`Auto` chooses a distribution for the global batch `fit` trains on; both doors
see it the same way: Keras's trainer builds the model, its metrics and loss
from one batch (`_symbolic_build`) before it makes the run's callback list,
and this mixin records that batch's shapes and dtypes as Keras draws it,
drawing nothing more.
"""

from keras_parallel.keras_seam.overrides import Overrides, override


class FirstBatchSeen(Overrides):
    """Records the batch Keras's `_symbolic_build` is given or draws.

    Args:
        seen: a function of the batch.
    """

    names = ("_symbolic_build",)

    def __init__(self, seen):
        self.seen = seen

    def _symbolic_build(self, iterator=None, data_batch=None):
        if data_batch is not None:
            self.seen(data_batch)
        elif iterator is not None:
            iterator = _RecordingIterator(iterator, self.seen)
        return self.overridden._symbolic_build(iterator=iterator, data_batch=data_batch)


def watch(model, seen):
    """Calls `seen(batch)` with the batch Keras builds `model` from.

    Args:
        model: the `keras.Model`.
        seen: a function of the batch (`(x, y, sample_weight)` as Keras has
            it: arrays, or `(x,)`).

    Returns:
        A function that stops watching.
    """
    return override(model, FirstBatchSeen(seen))


class _RecordingIterator:
    """Keras's epoch iterator, its first batch handed to `seen` as drawn.

    Keras takes the first element of each `(begin, end, data)` it iterates:
    a list of batches, or an iterator of them.
    """

    def __init__(self, iterator, seen):
        self._iterator = iterator
        self._seen = seen

    def __iter__(self):
        for begin, end, data in self._iterator:
            if isinstance(data, (list, tuple)):
                if data:
                    self._seen(data[0])
                yield begin, end, data
            else:
                yield begin, end, _first_seen(data, self._seen)

    def __getattr__(self, name):
        return getattr(self._iterator, name)


def _first_seen(batches, seen):
    first = True
    for batch in batches:
        if first:
            seen(batch)
            first = False
        yield batch
