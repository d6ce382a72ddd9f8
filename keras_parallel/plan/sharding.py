"""`shard=`: variables and optimizer state split over the data axis.

`"full"` splits large variables, their gradients and optimizer state over the
batch axis (ZeRO-3, FSDP); `"optimizer"` only the optimizer state and update
(ZeRO-1/2). Where the batch axis goes is one rule for every backend, kept here.
"""

import math
import warnings

from keras_parallel.errors import ShardingError, ShardingWarning

#: The values `shard=` takes.
SHARD_MODES = (None, "full", "optimizer")

#: Variables with fewer elements stay whole (16 KiB of float32).
DEFAULT_SHARD_MIN_SIZE = 4096


def check_shard(shard, shard_min_size):
    """Refuses a `shard` or `shard_min_size` that means nothing (`ShardingError`)."""
    if shard not in SHARD_MODES:
        raise ShardingError(
            "`shard` must be None (every device holds whole variables and "
            "optimizer state), 'full' (variables, gradients and optimizer "
            "state split over the data axis: FSDP, ZeRO-3) or 'optimizer' "
            "(the optimizer state and update split: ZeRO-1/2). Received: "
            f"shard={shard!r}; pass one of {list(SHARD_MODES)}."
        )
    if (
        isinstance(shard_min_size, bool)
        or not isinstance(shard_min_size, int)
        or shard_min_size < 1
    ):
        raise ShardingError(
            "`shard_min_size` is the number of elements below which a "
            "variable stays whole, a positive integer. Received: "
            f"shard_min_size={shard_min_size!r}; pass e.g. "
            f"{DEFAULT_SHARD_MIN_SIZE} (the default) or 1 to shard every "
            "variable that can be."
        )


def shard_of(distribution):
    """`(shard, shard_min_size)` of a distribution; `(None, ...)` for Keras's."""
    return (
        getattr(distribution, "shard", None),
        getattr(distribution, "shard_min_size", DEFAULT_SHARD_MIN_SIZE),
    )


def is_floating(dtype):
    """Whether a dtype name is a floating type (integers are never sharded)."""
    return str(dtype).startswith(("float", "bfloat"))


def with_batch_axis(path, shape, axes, batch_axis, axis_size, min_size):
    """`axes` with the batch axis added where the rule puts it.

    Args:
        path: the variable's path, for the warning.
        axes: its layout so far (`None` or a mesh axis per dimension).
        axis_size: the batch axis's number of devices.
        min_size: variables with fewer elements stay whole.

    Returns:
        `(axes, sharded)`: the new axes, and whether the batch axis was added.

    Warns:
        ShardingWarning: the variable is large but the axis size divides
            none of its free dimensions; it stays as `axes` say.

    Example:

    >>> with_batch_axis("d/kernel", (256, 512), (None, None), "batch", 8, 4096)
    ((None, 'batch'), True)
    """
    shape = tuple(int(s) for s in shape)
    axes = tuple(axes)
    if axis_size <= 1 or batch_axis in axes or math.prod(shape) < min_size:
        return axes, False
    free = [
        (dim, index)
        for index, (dim, axis) in enumerate(zip(shape, axes, strict=True))
        if axis is None and dim % axis_size == 0
    ]
    if not free:
        warnings.warn(
            f"Variable {path!r} (shape {shape}) stays whole on every device: "
            f"the {axis_size} devices of mesh axis {batch_axis!r} divide none "
            f"of its free dimensions. Received: axes={axes}; to shard it, use "
            f"a mesh whose {batch_axis!r} axis size divides one of its "
            "dimensions.",
            ShardingWarning,
            stacklevel=3,
        )
        return axes, False
    # The largest dimension; `-index` breaks ties towards the first.
    _, index = max(free, key=lambda pair: (pair[0], -pair[1]))
    return axes[:index] + (batch_axis,) + axes[index + 1 :], True


def sharded_layout(path, shape, dtype, axes, key, batch_axis, axis_size, min_size):
    """A planned variable's layout and its `From` note, with `shard=`'s axis.

    `key` is where `axes` came from (`describe()`'s `From` column, e.g.
    `"(replicated)"`); the other arguments are as for `with_batch_axis`.

    Returns:
        `(axes, key)`: `key` says `sharded` where the batch axis was added;
        integer variables are returned as they are.
    """
    if not is_floating(dtype):
        return tuple(axes), key
    axes, added = with_batch_axis(path, shape, axes, batch_axis, axis_size, min_size)
    if not added:
        return axes, key
    if key == "(replicated)":
        return axes, "(sharded)"
    if key.startswith("(") and key.endswith(")"):
        return axes, key[:-1] + ", sharded)"
    return axes, f"{key} (+ sharded)"


def describe_shard(shard):
    """One line for `describe()`: what `shard` splits, or `None`."""
    if shard == "full":
        return (
            "Sharded over the batch axis: variables, gradients and optimizer "
            "state (shard='full': FSDP, ZeRO-3)"
        )
    if shard == "optimizer":
        return (
            "Sharded over the batch axis: optimizer state and update; "
            "variables whole (shard='optimizer': ZeRO-1/2)"
        )
    return None
