"""Variables placed as they are made, inside `distribution.scope()` on torch.

Keras 3.15's torch variables do not ask the distribution for their layout, so
each would be made whole on every process. In scope, a floating variable laid
out along a mesh axis is placed as soon as its value exists. Why DTensors, not
FSDP2: docs/sharding.md.
"""

import contextlib

import torch
import torch.distributed as dist

from keras_parallel.backends.torch import dtensor_layouts
from keras_parallel.backends.torch import group as torch_group
from keras_parallel.backends.torch.keras_compat import TorchVariable
from keras_parallel.keras_seam.replacements import replaced


def split_axes(distribution, variable):
    """The axes `distribution` lays `variable` out along, or `None`.

    `None` where the layout names no axis: `MeshRunner.apply` places such a
    variable at `compile`, as every variable made outside the scope.
    """
    layout = distribution.get_variable_layout(variable)
    axes = tuple(getattr(layout, "axes", None) or ())
    if not any(axis is not None for axis in axes):
        return None
    return axes


@contextlib.contextmanager
def placed_creation(distribution):
    """While in scope, a floating variable made whole is placed at once.

    Placing is a collective: every process must make the same variables in the
    same order.
    """
    torch_group.ensure_process_group()
    keras_mesh = distribution.device_mesh
    mesh = dtensor_layouts.torch_mesh(keras_mesh, torch_group.device_type())
    initialize = TorchVariable._initialize

    def initialize_placed(variable, value):
        initialize(variable, value)
        if not torch.is_floating_point(variable._value):
            return  # Seed-generator states stay plain, per process.
        if variable._shape is None:
            # Made from a value: Keras sets the shape only after
            # `_initialize`, and the layout needs it now.
            variable._shape = tuple(variable._value.shape)
        axes = split_axes(distribution, variable)
        if axes is None:
            return
        with dtensor_layouts.promotion():
            dtensor_layouts.place(variable, axes, keras_mesh, mesh)

    replacements = {
        (TorchVariable, "_initialize"): failures_named(initialize_placed),
        # keras-nightly places a variable made from an initializer there
        # (a collective too).
        (TorchVariable, "_initialize_with_initializer"): failures_named(
            TorchVariable._initialize_with_initializer
        ),
    }
    with replaced(replacements):
        yield


def failures_named(initialize):
    """`initialize`, raising a broken collective as a `PeerFailedError`.

    A placement that broke most likely means another rank stopped; it is named,
    rather than reported as gloo's "Connection closed by peer".
    """

    def initialize_named(variable, value):
        try:
            return initialize(variable, value)
        except torch_group.PeerFailedError:
            raise
        except Exception as error:
            if torch_group.is_collective_failure(error):
                raise torch_group.peer_failed_error(
                    error,
                    dist.get_rank(),
                    f"the making of variable {variable.path!r} in distribution.scope()",
                ) from error
            raise

    return initialize_named
