"""The first batch of an entry point, as Keras's trainer draws it to build.

`Auto` chooses a distribution for the global batch `fit` trains on. Keras's
JAX and torch trainers, in `fit` and `evaluate`, draw one batch from their
epoch iterator to build the model, its metrics and loss (`_symbolic_build`),
and reset the iterator before the first step. `DistributedModel` learns the
batch there: the batch is drawn as Keras draws it (also when everything is
built and Keras would draw none), Keras builds from it, and `seen(batch)` is
called before Keras makes its callback list or any step.
"""

from keras_parallel.keras_seam.overrides import Overrides, override


class FirstBatchSeen(Overrides):
    """Hands the batch Keras's `_symbolic_build` builds from to `seen`, once.

    Args:
        seen: a function of the batch (`(x, y, sample_weight)` as Keras has
            it).
    """

    names = ("_symbolic_build",)

    def __init__(self, seen):
        self.seen = seen
        self.done = False

    def _symbolic_build(self, iterator=None, data_batch=None):
        if self.done:
            return self.overridden._symbolic_build(
                iterator=iterator, data_batch=data_batch
            )
        if data_batch is None and iterator is not None:
            data_batch = first_batch_of(iterator)
        result = self.overridden._symbolic_build(data_batch=data_batch)
        self.done = True
        self.seen(data_batch)
        return result


def first_batch_of(iterator):
    """The first batch of Keras's epoch iterator, drawn as Keras's own
    `_symbolic_build` draws it (Keras resets the iterator afterwards)."""
    for _, _, data in iterator:
        if isinstance(data, (list, tuple)):
            return data[0]
        return next(data)
    return None


def watch(model, seen):
    """Calls `seen(batch)` with the batch Keras builds `model` from.

    Args:
        model: the `keras.Model`.
        seen: a function of the batch.

    Returns:
        A function that stops watching.
    """
    return override(model, FirstBatchSeen(seen))
