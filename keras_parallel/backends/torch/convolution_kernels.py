"""Convolutions on DTensors, where DTensor's own rules fail.

DTensor's convolution rule assumes a whole kernel, so under `shard="full"` a
split kernel is gathered for the convolution (`gathered_for_use`); on a mesh of
several dimensions, whose convolution backward torch 2.14 refuses, each process
convolves its own rows (`LocalConvolutions`).
"""

import contextlib

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.overrides import TorchFunctionMode

#: Keras layers whose op reads its kernel through DTensor's convolution rule.
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
    """While in scope, `variables` split over the batch axis are read gathered.

    DTensor's convolution rule computes each rank's output from its shard of
    the kernel (the guide's convnet under `shard="full"`: "shape
    '[16, 12, 12, 24]' is invalid for input of size 13824"). The gradient is
    reduce-scattered back to the parameter, which is back in place before the
    backward pass reads `variable.value.grad`. Gathering every split variable
    instead made the 100 M-parameter MLP of `benchmarks/bench_torch_sharding.py`
    4.4 times slower and 38 % larger than DTensor's own choice.

    Args:
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


#: The convolutions Keras's torch backend calls: `(input, weight, bias, ...)`.
_CONVOLUTION_OPS = frozenset(
    (
        torch.nn.functional.conv1d,
        torch.nn.functional.conv2d,
        torch.nn.functional.conv3d,
        torch.nn.functional.conv_transpose1d,
        torch.nn.functional.conv_transpose2d,
        torch.nn.functional.conv_transpose3d,
    )
)


class LocalConvolutions(TorchFunctionMode):
    """While active, a convolution of DTensors is computed on local tensors.

    On a mesh of two or more dimensions torch 2.14's strategy for
    `aten.convolution_backward` refuses the outputs a step does not ask for
    ("strategy position 2 mixes None with placements across mesh dims"), so
    no convolution could train. With kernel and bias gathered and the input
    split along the batch at most, each process convolves its own rows: one
    device's values on torch 2.13 and 2.14, as fast as DTensor's rule on 2.13.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CONVOLUTION_OPS and len(args) >= 2 and isinstance(args[1], DTensor):
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            rest = args[3:]
            options = {k: v for k, v in kwargs.items() if k != "bias"}

            def compute(x, weight, bias):
                return func(x, weight, bias, *rest, **options)

            return _LocalConvolution.apply(compute, args[0], args[1], bias)
        return func(*args, **kwargs)


class _LocalConvolution(torch.autograd.Function):
    """A convolution of DTensors as each process's local one.

    The output is laid out as the input; each gradient goes back to its
    input's placements (the kernel's and bias's from partial sums).
    """

    @staticmethod
    def forward(ctx, compute, x, weight, bias):
        mesh = weight.device_mesh
        whole = (Replicate(),) * mesh.ndim
        placements = _batch_only(x.placements) if isinstance(x, DTensor) else whole
        locals_ = []
        for value, wanted in ((x, placements), (weight, whole), (bias, whole)):
            if isinstance(value, DTensor):
                value = value.redistribute(mesh, wanted).to_local()
            if isinstance(value, torch.Tensor):
                value = value.detach().requires_grad_(
                    ctx.needs_input_grad[len(locals_) + 1]
                )
            locals_.append(value)
        with torch.enable_grad():
            output = compute(*locals_)
        # The local graph, whose gradients `backward` takes.
        ctx.output, ctx.locals = output, locals_
        ctx.layout = (mesh, placements)
        ctx.originals = [
            (v.device_mesh, tuple(v.placements)) if isinstance(v, DTensor) else None
            for v in (x, weight, bias)
        ]
        return DTensor.from_local(output.detach(), mesh, placements, run_check=False)

    @staticmethod
    def backward(ctx, grad):
        mesh, placements = ctx.layout
        output, locals_ = ctx.output, ctx.locals
        ctx.output = ctx.locals = None
        if isinstance(grad, DTensor):
            grad = grad.redistribute(mesh, placements).to_local()
        wanted = [t for t in locals_ if t is not None and t.requires_grad]
        found = torch.autograd.grad(output, wanted, grad, allow_unused=True)
        found = dict(zip(map(id, wanted), found, strict=True))
        # The kernel's and bias's gradients: partial sums over the batch's dims.
        summed = tuple(Partial() if p.is_shard(0) else Replicate() for p in placements)
        grads = []
        for index, local in enumerate(locals_):
            value = found.get(id(local)) if local is not None else None
            original = ctx.originals[index]
            if value is not None and original is not None:
                layout = placements if index == 0 else summed
                value = DTensor.from_local(value, mesh, layout, run_check=False)
                # A partial sum's gradient is its sum's, on every process.
                target = tuple(
                    Replicate() if p.is_partial() else p for p in original[1]
                )
                value = value.redistribute(original[0], target)
            grads.append(value)
        return (None, *grads)


def _batch_only(placements):
    """`placements` split along dimension 0 at most, all else made whole."""
    return tuple(p if p.is_shard(0) else Replicate() for p in placements)
