"""The losses a model of DTensor variables adds, made whole and plain.

Under `ModelParallel` and `shard=` on torch (`mesh_steps`) Keras adds the
losses of `add_loss` (an activity regularizer too) and of weight
regularizers to the plain loss of this rank's rows; computed on DTensors,
they must first be whole and plain, each counted once.
"""

import contextlib

from torch.distributed.tensor import DTensor

from keras_parallel.backends.torch.keras_compat import StatelessScope
from keras_parallel.replacements import replaced


def whole(value):
    """A DTensor made whole and plain (a collective); anything else as is.

    Its gradient keeps DTensor's meaning: a replicated scalar's gradient is
    counted once, not once per rank.
    """
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value


def whole_added_losses(model):
    """Makes the losses the forward pass added whole and plain (in place).

    `add_loss` inside `call` (an activity regularizer too) computes on the
    DTensor of the global batch: its value is already the global batch's.
    Keras adds it to the plain loss of this rank's rows, which torch refuses
    for a DTensor (an `AssertionError` in DTensor's dispatch). Every rank
    runs the same layers, so the collectives come in the same order.

    Args:
        model: the Keras model whose forward pass just ran.
    """
    for layer in model._flatten_layers(include_self=True, recursive=True):
        losses = layer._losses
        if any(isinstance(loss, DTensor) for loss in losses):
            losses[:] = [whole(loss) for loss in losses]


@contextlib.contextmanager
def whole_regularization_losses(model):
    """While in scope, `model`'s weight-regularization losses are plain.

    Keras computes them from the variables whenever it reads `model.losses`
    (the loss of every train and test step). On the DTensor variables
    themselves a regularizer may fail (`L1L2` adds its DTensor terms in
    place to a plain zero: an `AssertionError` in DTensor's dispatch), and
    what it returns is a DTensor that Keras cannot add to the plain loss.
    So each regularizer reads its variable's whole value (gathered, a
    collective; a replicated variable costs nothing), through Keras's own
    `StatelessScope`: the penalty is one device's, computed in the same
    order, and it is plain. Its gradient reaches each shard once: the
    backward pass of a gather (or of `to_local` of a replicated DTensor)
    hands each process its own part of one replicated gradient, which is
    not summed over the ranks, unlike the partial sums of the outputs'
    gradients.

    Args:
        model: the Keras model.
    """
    regularization_losses = model._get_regularization_losses

    def whole_losses():
        mapping = [
            (variable, whole(variable.value))
            for variable in model.trainable_weights
            if variable.regularizer is not None
        ]
        if not any(isinstance(v.value, DTensor) for v, _ in mapping):
            return regularization_losses()
        with StatelessScope(state_mapping=mapping):
            return [whole(loss) for loss in regularization_losses()]

    with replaced({(model, "_get_regularization_losses"): whole_losses}):
        yield
