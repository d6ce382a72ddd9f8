"""The losses a model of DTensor variables adds, made whole and plain.

Under `ModelParallel` and `shard=` Keras adds `add_loss` losses and weight
regularizers to the plain loss of this rank's rows; computed on DTensors, they
must first be whole and plain, each counted once.
"""

from torch.distributed.tensor import DTensor

from keras_parallel.backends.torch.keras_compat import StatelessScope


def whole(value):
    """A DTensor made whole and plain (a collective); anything else as is.

    A replicated scalar's gradient is still counted once, not once per rank.
    """
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value


def whole_added_losses(model):
    """Makes the losses the forward pass added whole and plain (in place).

    They are the global batch's already, but adding a DTensor to the plain
    loss fails (an `AssertionError` in DTensor's dispatch).
    """
    for layer in model._flatten_layers(include_self=True, recursive=True):
        losses = layer._losses
        if any(isinstance(loss, DTensor) for loss in losses):
            losses[:] = [whole(loss) for loss in losses]


def whole_regularization_losses(model):
    """`model._get_regularization_losses`, its losses plain.

    On DTensors a regularizer may fail (`L1L2` adds DTensor terms in place to
    a plain zero) or return a DTensor, so each reads its variable's whole
    value through `StatelessScope`: one device's penalty. The gather's backward
    hands each shard its part of the gradient once, not summed over ranks.
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

    return whole_losses
