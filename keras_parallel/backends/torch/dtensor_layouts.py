"""Keras variables held as torch DTensors: mesh, placements, placing, gathering.

Under `ModelParallel` every floating model variable, and every optimizer slot
that follows one, holds a `torch.distributed.tensor.DTensor` (inside the
`torch.nn.Parameter` Keras keeps in `variable._value`) on a torch
`DeviceMesh` made from the Keras `DeviceMesh`: the same shape, the same axis
names in the same order, and rank `i` where the Keras mesh names device
`cpu:i` (or `cuda:i`). Each mesh axis becomes one placement: `Shard(d)` when
the variable's layout puts that axis on its dimension `d`, else
`Replicate()`. So a process holds only its shard of a split variable.

Where Keras's own torch backend knows DTensors (keras-nightly:
`keras.src.backend.torch.distribution_lib`), its pieces are used: the mesh
is the Keras mesh's own `backend_mesh`, the placements its
`TensorLayout.backend_layout`, the values are placed by its
`distribute_tensor`, and `variable._layout` is set so that its
`Variable._direct_assign` redistributes what is assigned. With Keras 3.15,
which has none of these, the same objects are made here with torch's API.

Integer variables (seed-generator states) and the optimizer's own scalars
(iterations, learning rate) stay plain tensors: they never meet a sharded
tensor in an op that needs a placement, and `promotion()` treats them as
replicated where they do.
"""

import contextlib
import functools

import numpy as np
import torch
from keras.distribution import TensorLayout
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

from keras_parallel.backends.torch.keras_compat import keras_dtensor


def torch_mesh(device_mesh, device_type):
    """The torch `DeviceMesh` of a Keras `DeviceMesh`.

    Making one is a collective (it makes a process group per axis): every
    rank must make it, in the same order.

    Args:
        device_mesh: the `keras.distribution.DeviceMesh`, whose devices are
            named `"<type>:<rank>"`.
        device_type: `"cpu"` or `"cuda"`, what each rank computes on.

    Returns:
        A `torch.distributed.device_mesh.DeviceMesh` with the Keras mesh's
        shape and axis names.

    Example:

    >>> mesh = keras.distribution.DeviceMesh(
    ...     (2, 2), ["data", "model"], ["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    >>> torch_mesh(mesh, "cpu").mesh_dim_names
    ('data', 'model')
    """
    if keras_dtensor is not None:
        return device_mesh.backend_mesh  # Keras's own, cached on the mesh.
    ranks = [
        int(str(d).rsplit(":", 1)[-1]) for d in np.asarray(device_mesh.devices).flat
    ]
    return DeviceMesh(
        device_type,
        torch.tensor(ranks, dtype=torch.int64).reshape(tuple(device_mesh.shape)),
        mesh_dim_names=tuple(device_mesh.axis_names),
    )


def placements(axes, axis_names):
    """One placement per mesh axis for a tensor laid out along `axes`.

    Args:
        axes: one mesh axis name (or `None`) per tensor dimension.
        axis_names: the mesh's axis names, in mesh order.

    Returns:
        A tuple of `Shard(dim)` / `Replicate()`, one per mesh axis.

    Example:

    >>> placements((None, "model"), ("data", "model"))
    (Replicate(), Shard(dim=1))
    """
    dims = {axis: dim for dim, axis in enumerate(axes) if axis is not None}
    return tuple(
        Shard(dims[name]) if name in dims else Replicate() for name in axis_names
    )


def is_dtensor(value):
    """Whether a variable's value (or any tensor) is a DTensor."""
    return isinstance(value, DTensor)


def is_placed(entry, variable):
    """Whether the plan's `entry` makes `variable` a DTensor (module docstring)."""
    if not torch.is_floating_point(variable._value):
        return False
    return entry.kind == "model" or entry.key.startswith("(follows")


def place(variable, axes, keras_mesh, mesh):
    """Makes `variable` hold a DTensor laid out along `axes` (a collective).

    Rank 0's value is scattered (or broadcast) to the other ranks, as DDP
    broadcasts rank 0's weights: every rank may have built its own.

    Args:
        variable: a floating `keras.Variable`.
        axes: its layout, one mesh axis name (or `None`) per dimension.
        keras_mesh: the Keras `DeviceMesh`.
        mesh: its torch `DeviceMesh` (`torch_mesh`).
    """
    wanted = placements(axes, mesh.mesh_dim_names)
    value = variable._value.detach()
    if is_dtensor(value):
        if tuple(value.placements) == wanted:
            return
        placed = value.redistribute(mesh, wanted)
    elif keras_dtensor is not None:
        layout = TensorLayout(axes, keras_mesh)
        placed = keras_dtensor.distribute_tensor(value, layout.backend_layout)
    else:
        placed = distribute_tensor(value, mesh, wanted, src_data_rank=0)
    local = placed.to_local()
    if local.untyped_storage().nbytes() > local.numel() * local.element_size():
        # A shard along dimension 0 is a view of the whole value: copied,
        # so that the whole value can be freed.
        placed = DTensor.from_local(
            local.clone(), mesh, placed.placements, run_check=False
        )
    if keras_dtensor is not None:
        # Keras's `_direct_assign` redistributes assigned values by it.
        variable._layout = TensorLayout(axes, keras_mesh)
    parameter = torch.nn.Parameter(placed, requires_grad=variable.trainable)
    if variable.trainable:
        # Each gradient takes its variable's placements as soon as it is
        # computed (its sums over the batch axis all-reduced): a process
        # then keeps only its shard of it, not a whole gradient that torch
        # may compute for a split variable.
        parameter.register_hook(
            functools.partial(placed_gradient, mesh=mesh, placements=wanted)
        )
    variable._value = parameter


def placed_gradient(grad, mesh, placements):
    """A variable's gradient, redistributed to the variable's placements.

    Registered on every trainable DTensor variable by `place`: it runs as
    soon as the backward pass has computed the gradient.
    """
    if not is_dtensor(grad) or tuple(grad.placements) == placements:
        return grad
    return grad.redistribute(mesh, placements)


def unplace(variable):
    """Gives `variable` its whole value back as a plain tensor (a collective)."""
    value = variable._value
    if not is_dtensor(value):
        return
    whole = value.detach().full_tensor()
    variable._layout = None
    variable._value = torch.nn.Parameter(whole, requires_grad=variable.trainable)


def retrack(model):
    """Makes every layer's torch parameters the variables' current values.

    Keras's torch layers register `variable.value` in a `ParameterDict`
    (`_torch_params`) when built; `model.parameters()` (which
    `model.zero_grad()` clears) reads it, so it must follow a new `_value`.
    """
    for layer in model._flatten_layers(include_self=True, recursive=True):
        # A torch submodule: kept in `_modules`, not in `__dict__`.
        if "_torch_params" in layer._modules:
            layer._track_variables()


def whole_value(value):
    """A value as a plain tensor: a DTensor gathered (a collective)."""
    if is_dtensor(value):
        return value.detach().full_tensor()
    return value


def local_bytes(variable):
    """The bytes of `variable` this process holds (its shard, if split)."""
    value = variable._value
    if is_dtensor(value):
        value = value.to_local()
    return value.numel() * value.element_size()


@contextlib.contextmanager
def gathered(variables):
    """While in scope, every DTensor variable holds its whole value.

    For Keras's saving, which reads `variable.numpy()` on the one process
    that writes: each process first gathers every split variable, in the
    same order (a collective per variable), then Keras reads plain tensors.

    Args:
        variables: every variable the save may read, in the same order on
            every process.
    """
    swapped = []
    try:
        for variable in variables:
            value = variable._value
            if is_dtensor(value):
                whole = value.detach().full_tensor()
                swapped.append((variable, value, variable._layout))
                variable._layout = None
                variable._value = torch.nn.Parameter(whole, requires_grad=False)
        yield
    finally:
        for variable, value, layout in reversed(swapped):
            variable._value = value
            variable._layout = layout


_promotion_depth = 0


@contextlib.contextmanager
def promotion():
    """Plain tensors meeting DTensors in one op are treated as replicated.

    A Keras op may mix a DTensor with a plain tensor it made itself (a
    constant, a dropout mask drawn in the layer's global shape, the
    optimizer's learning rate, a weight `load_weights` assigns); torch
    refuses such a mix unless told the plain tensor is the same on every
    rank, which here it is.

    Re-entrant: torch's `implicit_replication()` switches a global flag off
    when it exits, even inside another one; only the outermost of ours
    enters it. (Seen: `BackupAndRestore` built the optimizer inside `fit`,
    which placed its slots under a nested scope; the restore that followed
    failed with "got mixed torch.Tensor and DTensor".)
    """
    global _promotion_depth
    if _promotion_depth:
        _promotion_depth += 1
        try:
            yield
        finally:
            _promotion_depth -= 1
        return
    with implicit_replication():
        _promotion_depth = 1
        try:
            yield
        finally:
            _promotion_depth = 0
