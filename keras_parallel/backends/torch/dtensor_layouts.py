"""Keras variables held as torch DTensors: mesh, placements, placing, gathering.

Under `ModelParallel` floating model variables and the optimizer slots that
follow them hold DTensors; integer variables and the optimizer's own scalars
stay plain (`promotion()` treats them as replicated). Keras's own DTensor
pieces are used where it has them (3.16+).
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
    """The torch `DeviceMesh` of a Keras `DeviceMesh` (same shape and names).

    A collective (a process group per axis): every rank makes it, in order.

    Args:
        device_mesh: the Keras mesh, its devices named `"<type>:<rank>"`.
        device_type: `"cpu"` or `"cuda"`.
    """
    if keras_dtensor is not None:
        return device_mesh.backend_mesh  # Keras's own, cached on the mesh.
    # Cached, as Keras 3.16 caches `backend_mesh`: variables placed in
    # `distribution.scope()` and by `MeshRunner.apply` must share one torch
    # mesh, or DTensor refuses to compute with both.
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


def place(variable, axes, keras_mesh, mesh, gradient_axes=None):
    """Makes `variable` hold a DTensor laid out along `axes` (a collective).

    Rank 0's value wins, as under DDP. A variable already placed so keeps its
    value; only its gradient's placements may change.

    Args:
        axes: one mesh axis name (or `None`) per dimension.
        mesh: the torch mesh of `keras_mesh` (`torch_mesh`).
        gradient_axes: the gradient's layout; defaults to `axes`.
            `shard="optimizer"` gives a whole variable's gradient its slots'
            layout, so it is reduce-scattered, not all-reduced (ZeRO-2).
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
        # A shard along dimension 0 views the whole value: copied to free it.
        placed = DTensor.from_local(
            local.clone(), mesh, placed.placements, run_check=False
        )
    if keras_dtensor is not None:
        # Keras's `_direct_assign` redistributes assigned values by it.
        variable._layout = TensorLayout(axes, keras_mesh)
    parameter = torch.nn.Parameter(placed, requires_grad=variable.trainable)
    if variable.trainable:
        # Placed as soon as computed: a process keeps only its shard, not the
        # whole gradient torch may compute for a split variable.
        hook = GradientPlacement(mesh, gradient)
        parameter.register_hook(hook)
        setattr(parameter, _GRADIENT_HOOK, hook)
    variable._value = parameter


#: The attribute of a placed parameter holding its `GradientPlacement` hook.
_GRADIENT_HOOK = "_kp_gradient_placement"


class GradientPlacement:
    """The gradient hook `place` registers: `placed_gradient` to `placements`.

    An object, not a closure, so that a later `place` (once the optimizer's
    slots exist) can re-aim it without registering a second hook.
    """

    def __init__(self, mesh, placements):
        self.mesh = mesh
        self.placements = placements

    def __call__(self, grad):
        return placed_gradient(grad, self.mesh, self.placements)


def gradient_placements(variable):
    """The placements a placed trainable `variable`'s gradient takes, or `None`."""
    hook = getattr(getattr(variable, "_value", None), _GRADIENT_HOOK, None)
    return None if hook is None else hook.placements


def placed_gradient(grad, mesh, placements):
    """A variable's gradient, redistributed to the given placements."""
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

    Keras registers `variable.value` in a layer's `_torch_params` when built,
    and `model.parameters()` (`zero_grad()`) reads it.
    """
    for layer in model._flatten_layers(include_self=True, recursive=True):
        # A torch submodule: in `_modules`, not `__dict__`.
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

    For Keras's saving, which reads `variable.numpy()` on the writing process
    only: every process gathers each variable (a collective), in one order.
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

    Keras ops mix DTensors with plain tensors that are the same on every rank
    (constants, dropout masks, the learning rate). Re-entrant: torch's
    `implicit_replication()` turns its global flag off on exit even when
    nested (a `BackupAndRestore` restore then failed with "got mixed
    torch.Tensor and DTensor"), so only the outermost scope enters it.
    """
    global _promotion_depth
    outermost = _promotion_depth == 0
    _promotion_depth += 1
    try:
        with implicit_replication() if outermost else contextlib.nullcontext():
            yield
    finally:
        _promotion_depth -= 1
