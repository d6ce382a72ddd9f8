"""Convolution kernels split over the batch axis, gathered where they are read.

Under `shard="full"` on torch a large variable is a DTensor split over the
batch axis, and DTensor's own rules decide how each op reads it. Those of a
matmul, an einsum or an embedding read a split weight (each chooses between
gathering it and splitting its output, whichever moves less); its
convolution rule does not (see `gathered_for_use`).
"""

import contextlib

from torch.distributed.tensor import DTensor, Replicate, Shard

#: The Keras layers whose op reads a kernel through DTensor's convolution
#: rule (`gathered_for_use`).
CONVOLUTIONS = (
    "Conv1D",
    "Conv2D",
    "Conv3D",
    "Conv1DTranspose",
    "Conv2DTranspose",
    "Conv3DTranspose",
    "DepthwiseConv1D",
    "DepthwiseConv2D",
    "SeparableConv1D",
    "SeparableConv2D",
)


def convolution_variables(model):
    """The trainable variables of the model's convolution layers."""
    import keras

    kinds = tuple(getattr(keras.layers, name) for name in CONVOLUTIONS)
    found = {}
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, kinds):
            for variable in layer.trainable_variables:
                found[id(variable)] = variable
    return list(found.values())


@contextlib.contextmanager
def gathered_for_use(variables, batch_dim):
    """While in scope, these variables, if split over the batch axis, are read
    gathered along it.

    DTensor's rules for a matmul, an einsum or an embedding read a split
    weight (each chooses between gathering it and splitting its output,
    whichever moves less), but its convolution rule assumes a replicated
    weight and computes each rank's output from its shard of the kernel
    (seen under `shard="full"`: the guide's convnet failed with "shape
    '[16, 12, 12, 24]' is invalid for input of size 13824"). So, for the
    forward pass, each convolution's split variable holds its gathered
    DTensor (a redistribution of its parameter, still split along any other
    axis), which the convolution reads as a replicated weight; its gradient
    flows back through the redistribution and is reduce-scattered to the
    parameter's shard. The parameter is back in place before the backward
    pass reads `variable.value.grad`. (Gathering every split variable so
    instead made the 100 M-parameter MLP of
    `benchmarks/bench_torch_sharding.py` 4.4 times slower and 38 % larger
    than DTensor's own choice.)

    Args:
        variables: the variables read by convolutions
            (`convolution_variables`).
        batch_dim: the index of the batch axis in the mesh.
    """
    swapped = []
    try:
        for variable in variables:
            value = variable._value
            if not isinstance(value, DTensor):
                continue
            placements = tuple(value.placements)
            if not isinstance(placements[batch_dim], Shard):
                continue
            gathered = (
                placements[:batch_dim] + (Replicate(),) + placements[batch_dim + 1 :]
            )
            swapped.append((variable, value))
            variable._value = value.redistribute(value.device_mesh, gathered)
        yield
    finally:
        for variable, value in reversed(swapped):
            variable._value = value
