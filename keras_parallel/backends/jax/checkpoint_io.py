"""Persistence on JAX: gathered across processes, Orbax checkpoints restored."""

import contextlib

import keras

from keras_parallel.backends.checkpoint_io import CheckpointIO
from keras_parallel.backends.jax import processes


class JaxCheckpointIO(CheckpointIO):
    """`CheckpointIO` for `jax.Array` values, placed across processes."""

    restores_checkpoints = True

    def host_value(self, value):
        return processes.fetch(value)

    @staticmethod
    def kept_value(value):
        # A jax.Array is never changed in place: holding it is enough, and a
        # copy of a model larger than one device would not fit.
        return value

    @classmethod
    def restore_checkpoint(cls, model, path):
        from keras_parallel.backends.jax import orbax

        orbax.restore(model, path)

    @contextlib.contextmanager
    def saving(self, model):
        # Keras's saving makes throwaway variables (a reference `Optimizer`
        # to skip its attributes); made under the distribution, they would be
        # placed across processes by a collective.
        previous = keras.distribution.distribution()
        keras.distribution.set_distribution(None)
        try:
            if processes.is_multi_process():
                # Every process saves (process 0 alone writes): the values
                # split across processes are gathered by all of them.
                variables = model.variables + optimizer_and_metric_variables(model)
                with processes.gathered_for_saving(variables):
                    yield
            else:
                yield
        finally:
            keras.distribution.set_distribution(previous)


def optimizer_and_metric_variables(model):
    """The variables of `model`'s optimizer and metrics (not `model.variables`)."""
    optimizer = getattr(model, "optimizer", None)
    variables = list(optimizer.variables) if optimizer is not None else []
    return variables + list(getattr(model, "metrics_variables", []))
