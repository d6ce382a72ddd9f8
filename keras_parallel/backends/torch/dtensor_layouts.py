"""Keras variables held as torch DTensors: mesh, placements, placing, gathering.

Under `ModelParallel` every floating model variable, and every optimizer
slot that follows one, holds a DTensor on the torch mesh of the Keras mesh
(docs/torch.md). Integer variables and the optimizer's own scalars stay
plain: no op needs their placement, and `promotion()` treats them as
replicated. Keras's own DTensor pieces are used where it has them (3.16+).
"""

import contextlib

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
    # Cached on the Keras mesh, as Keras 3.16 caches `backend_mesh`: the
    # variables a model made inside `distribution.scope()` placed
    # (`creation`) and those `MeshRunner.apply` places later must share one
    # torch mesh, or DTensor refuses to compute with both.
    cached = getattr(device_mesh, _CACHED_MESH, None)
    if cached is not None and cached.device_type == device_type:
        return cached
    ranks = [
        int(str(d).rsplit(":", 1)[-1]) for d in np.asarray(device_mesh.devices).flat
    ]
    mesh = DeviceMesh(
        device_type,
        torch.tensor(ranks, dtype=torch.int64).reshape(tuple(device_mesh.shape)),
        mesh_dim_names=tuple(device_mesh.axis_names),
    )
    setattr(device_mesh, _CACHED_MESH, mesh)
    return mesh


#: The attribute of a Keras `DeviceMesh` that holds its torch mesh (Keras 3.15).
_CACHED_MESH = "_kp_torch_mesh"


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
    """Whether the plan's `entry` makes `variable` a DTensor (not integers, not
    the optimizer's own scalars: see the module docstring)."""
    if not torch.is_floating_point(variable._value):
        return False
    return entry.kind == "model" or entry.key.startswith("(follows")


def place(variable, axes, keras_mesh, mesh, gradient_axes=None):
    """Makes `variable` hold a DTensor laid out along `axes` (a collective).

    Rank 0's value is scattered (or broadcast) to the other ranks, as DDP
    broadcasts rank 0's weights: every rank may have built its own. A
    variable already placed so (made inside `distribution.scope()`,
    `creation`) keeps its value; only its gradient's placements may change.

    Args:
        variable: a floating `keras.Variable`.
        axes: its layout, one mesh axis name (or `None`) per dimension.
        keras_mesh: the Keras `DeviceMesh`.
        mesh: its torch `DeviceMesh` (`torch_mesh`).
        gradient_axes: the layout its gradient takes as soon as the backward
            pass computed it; defaults to `axes`. `shard="optimizer"` gives
            a whole variable's gradient its optimizer slots' layout, so
            that it is reduce-scattered rather than all-reduced (ZeRO-2).
    """
    wanted = placements(axes, mesh.mesh_dim_names)
    gradient = placements(
        axes if gradient_axes is None else gradient_axes, mesh.mesh_dim_names
    )
    value = variable._value.detach()
    if is_dtensor(value):
        if tuple(value.placements) == wanted:
            hook = getattr(variable._value, _GRADIENT_HOOK, None)
            if hook is not None:
                hook.placements = gradient
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
        # Each gradient takes its placements as soon as it is computed (its
        # sums over the batch axis reduced): a process then keeps only its
        # shard of it, not a whole gradient that torch may compute for a
        # split variable.
        hook = GradientPlacement(mesh, gradient)
        parameter.register_hook(hook)
        setattr(parameter, _GRADIENT_HOOK, hook)
    variable._value = parameter


#: The attribute of a placed variable's parameter holding its
#: `GradientPlacement` hook (which a later `place` may re-aim).
_GRADIENT_HOOK = "_kp_gradient_placement"


class GradientPlacement:
    """The gradient hook `place` registers: `placed_gradient` to `placements`.

    An object rather than a closure so that a later `place` (the plan made
    again once the optimizer's slots exist) can change where the gradient
    goes without registering a second hook.

    Args:
        mesh: the torch `DeviceMesh`.
        placements: the gradient's placements, one per mesh axis.
    """

    def __init__(self, mesh, placements):
        self.mesh = mesh
        self.placements = placements

    def __call__(self, grad):
        return placed_gradient(grad, self.mesh, self.placements)


def gradient_placements(variable):
    """The placements `variable`'s gradient takes (`place`), or `None`.

    Args:
        variable: a `keras.Variable`.

    Returns:
        A tuple of placements for a placed trainable variable, else `None`.
    """
    hook = getattr(getattr(variable, "_value", None), _GRADIENT_HOOK, None)
    return None if hook is None else hook.placements


def placed_gradient(grad, mesh, placements):
    """A variable's gradient, redistributed to the given placements.

    Called by every trainable DTensor variable's `GradientPlacement` hook
    (`place`): it runs as soon as the backward pass has computed the
    gradient.
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
