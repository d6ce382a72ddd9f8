"""`shard=`: variables and optimizer state split over the data axis.

`"full"` splits every large variable, its gradient and its optimizer state over
the mesh's batch axis (ZeRO-3, FSDP's `FULL_SHARD`); `"optimizer"` only the
optimizer state and the update (ZeRO-1/2). Which variables get the batch axis,
and on which dimension, is one rule for every backend, kept here
(docs/sharding.md). Nothing here touches a device or imports a backend.
"""

import math
import warnings

from keras_parallel.errors import ShardingError, ShardingWarning

#: The values `shard=` takes.
SHARD_MODES = (None, "full", "optimizer")

#: Variables with fewer elements stay whole (16 KiB of float32).
DEFAULT_SHARD_MIN_SIZE = 4096


def check_shard(shard, shard_min_size):
    """Refuses a `shard` or `shard_min_size` that means nothing.

    Args:
        shard: `None`, `"full"` or `"optimizer"`.
        shard_min_size: the element count below which variables stay whole.

    Raises:
        ShardingError: naming the argument, what it received and the
            values it takes.
    """
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
        shape: the variable's shape.
        axes: its layout so far (`None` or a mesh axis per dimension).
        batch_axis: the mesh axis the batch is split along.
        axis_size: that axis's number of devices.
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

    Args:
        path, shape, dtype: the variable's.
        axes: its layout so far.
        key: where that layout came from (`describe()`'s `From` column:
            a `LayoutMap` key, `"(replicated)"`, `"(follows d1/kernel)"`).
        batch_axis, axis_size, min_size: as for `with_batch_axis`.

    Returns:
        `(axes, key)`: `key` says `sharded` where the batch axis was added.
        Integer variables are returned as they are.
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
