"""What persistence asks of a backend: values to the host and back, and state.

Saving, backups and `restore_checkpoint` reach a backend only through its
executor's `checkpoint_io` (as Lightning's `CheckpointIO` beside its
`Strategy`), so the executor contract keeps to placement, collectives and
lifecycle. This is the one-process default; a backend overrides what differs.
"""

import contextlib


class CheckpointIO:
    """The persistence hooks of one executor.

    Args:
        executor: the `Executor` whose model is saved, backed up or restored.
    """

    #: Whether `restore_checkpoint` reads a `keras.callbacks.OrbaxCheckpoint`
    #: folder on this backend (and `load_weights(folder)` goes there).
    restores_checkpoints = False

    def __init__(self, executor):
        self.executor = executor

    def host_value(self, value):
        """A variable's whole value on this process's host, as NumPy.

        Args:
            value: a variable's backend value.

        Returns:
            A NumPy array (gathered from the devices or processes holding it).
        """
        from keras import ops

        return ops.convert_to_numpy(value)

    @staticmethod
    def kept_value(value):
        """A copy of a variable's value that later assignments leave as it is.

        Args:
            value: a variable's backend value.
        """
        from keras import ops

        return ops.copy(value)

    @classmethod
    def restore_checkpoint(cls, model, path):
        """Reads one step of an `OrbaxCheckpoint` into `model`'s layout.

        Args:
            model: a built model.
            path: the folder of one finished step.

        Raises:
            NotImplementedError: the default; see `restores_checkpoints`.
        """
        import keras

        backend = keras.backend.backend()
        raise NotImplementedError(
            "restore_checkpoint lays out shards with jax.sharding and runs on "
            f"the JAX backend only. Received: KERAS_BACKEND={backend!r}; on "
            "this backend use Keras's own `model.load_weights(directory)`."
        )

    def saving(self, model):
        """What must be in force, on every process, while `model` is saved.

        Returns:
            A context manager (nothing, by default).
        """
        return contextlib.nullcontext()

    def host_random_state(self):
        """The host random state a resumed run continues from.

        Keras's data adapters draw each epoch's shuffle from it.

        Returns:
            A nest of tuples, lists, dicts, NumPy arrays, bytes and numbers.
        """
        import random

        import numpy as np

        return {"numpy": np.random.get_state(), "python": random.getstate()}

    def set_host_random_state(self, state):
        """Puts back what `host_random_state` returned (tuples may be lists)."""
        import random

        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, cached))
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))

    def rank_seed_state(self, state):
        """This process's seed generator state for process 0's `state`: the
        same, unless each process draws its own dropout masks (torch)."""
        return state
