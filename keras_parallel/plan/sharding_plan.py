"""The sharding plan: where every variable and constrained output lives.

`resolve_plan` turns a distribution and a built model into a `ShardingPlan`,
plain data the same on every backend. All validation lives here, so every
executor refuses bad input alike, before anything moves; no device is touched.
"""

import dataclasses
import math

import numpy as np

from keras_parallel.errors import ShardingError
from keras_parallel.plan import layout_keys, layout_rules, sharding


@dataclasses.dataclass(frozen=True)
class VariableLayout:
    """One variable's place in the plan.

    Attributes:
        kind: `"model"`, `"optimizer"` or `"metric"`.
        axes: one mesh axis name (or `None`) per dimension.
        key: the `LayoutMap` key that chose `axes`, or a note saying why
            none did (`"(replicated)"`, `"(follows dense/kernel)"`).
        bytes_per_device: the size of the shard one device holds.
        logical: the logical axes rules placed it by, or `None`.
    """

    path: str
    kind: str
    shape: tuple
    dtype: str
    axes: tuple
    key: str
    bytes_total: int
    bytes_per_device: int
    logical: tuple = None


@dataclasses.dataclass(frozen=True)
class OutputLayout:
    """A layer output constrained to a layout (a `<layer path>/output` key).

    Attributes:
        key: the `LayoutMap` key as the user wrote it.
        path: the full output path it resolved to (`"net/block/d2/output"`).
    """

    key: str
    path: str
    axes: tuple


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Where everything lives, for one distribution and one model.

    Attributes:
        devices: the device names of the mesh, flattened in mesh order.
        variables: one `VariableLayout` per model, optimizer and metric
            variable, in that order.
        output_keys: the `LayoutMap` output keys with their axes, for an
            output path met only at call time.
        shard: `None`, `"full"` or `"optimizer"` (`keras_parallel.plan.sharding`).
    """

    mesh_shape: tuple
    axis_names: tuple
    devices: tuple
    batch_axis: str
    variables: tuple
    outputs: tuple
    output_keys: tuple = ()
    shard: str = None

    @property
    def num_devices(self):
        return int(math.prod(self.mesh_shape))

    @property
    def data_parallel_size(self):
        """How many ways each batch is split."""
        return self.axis_size(self.batch_axis)

    def axis_size(self, axis_name):
        return self.mesh_shape[self.axis_names.index(axis_name)]

    def bytes_per_device(self, kinds=("model", "optimizer")):
        """The bytes one device holds for the variables of these kinds."""
        return sum(v.bytes_per_device for v in self.variables if v.kind in kinds)

    def bytes_total(self, kinds=("model", "optimizer")):
        """The bytes of the variables of these kinds, unsharded."""
        return sum(v.bytes_total for v in self.variables if v.kind in kinds)

    def variable_axes(self):
        """`{path: axes}` for every variable of the plan."""
        return {v.path: v.axes for v in self.variables}

    def output_axes(self, path):
        """The axes a layer output at `path` is constrained to, or `None`.

        A path the plan did not list (a layer called under another name
        scope) is resolved against the keys, as the `LayoutMap` would.
        """
        for output in self.outputs:
            if output.path == path:
                return output.axes
        for key, axes in self.output_keys:
            if layout_keys.matches_path_or_suffix(key, path):
                return axes
        return None


def check_distribution(distribution, argument="distribution"):
    """Refuses anything but a `keras.distribution.Distribution` (`ShardingError`)."""
    from keras_parallel.keras_seam.keras_compat import Distribution

    if not isinstance(distribution, Distribution):
        raise ShardingError(
            f"`{argument}` must be a keras.distribution.Distribution such as "
            "keras_parallel.DataParallel() or keras.distribution.ModelParallel"
            f"(layout_map=...). Received: {argument}={distribution!r} (of type "
            f"{type(distribution).__name__}); pass a distribution, "
            'keras_parallel.Auto() (or "auto") to have one chosen, or None '
            "for one device."
        )


def resolve_plan(distribution, model, device_names=None, available_devices=None):
    """Resolves and validates the sharding plan of a model.

    Args:
        distribution: a `keras.distribution.Distribution`.
        model: a built `keras.Model`; its optimizer and metric variables too.
        device_names: the mesh's devices as strings (`"cpu:0"`), in mesh
            order. Defaults to `str()` of each mesh device.
        available_devices: the device names the backend can use. When given,
            a mesh naming more or other devices is refused.

    Returns:
        A `ShardingPlan`.

    Raises:
        ShardingError: the distribution cannot be applied to this model; the
            message names the variable, key or argument and what to do.

    Example:

    >>> plan = resolve_plan(keras.distribution.DataParallel(), model)
    >>> plan.data_parallel_size
    8
    """
    mesh = distribution.device_mesh
    mesh_shape = tuple(int(s) for s in mesh.shape)
    axis_names = tuple(mesh.axis_names)
    if device_names is None:
        device_names = [str(d) for d in np.asarray(mesh.devices).flat]
    device_names = tuple(device_names)
    _check_mesh(mesh_shape, axis_names, device_names, available_devices)
    batch_axis = distribution.batch_dim_name
    if batch_axis not in axis_names:
        raise ShardingError(
            "The distribution's `batch_dim_name` is not an axis of its device "
            f"mesh. Received: batch_dim_name={batch_axis!r}, mesh "
            f"axis_names={list(axis_names)}; pass one of these names as "
            "`batch_dim_name`."
        )
    sizes = dict(zip(axis_names, mesh_shape, strict=True))
    shard, shard_min_size = sharding.shard_of(distribution)

    def sharded(variable, axes, key):
        return sharding.sharded_layout(
            variable.path,
            variable.shape,
            _dtype_name(variable),
            axes,
            key,
            batch_axis,
            sizes[batch_axis],
            shard_min_size,
        )

    model_vars, optimizer_vars, metric_vars = _variables_by_kind(model)
    # `ModelParallel` keeps its LayoutMap private; read it where Keras keeps it.
    layout_map = getattr(distribution, "_layout_map", None)
    variable_keys, output_keys = [], []
    if layout_map is not None:
        for key in layout_map:
            axes = tuple(layout_map[key].axes)
            _check_axes_in_mesh(f"LayoutMap key {key!r}", axes, axis_names)
            if key.endswith(layout_keys.OUTPUT_SUFFIX):
                output_keys.append((key, axes))
            else:
                variable_keys.append((key, axes))

    by_rules = layout_rules.RulePlacement.of(distribution, model, batch_axis, sizes)
    entries = []
    used_keys = set()
    chosen = {}
    for variable in model_vars:
        axes, key = layout_keys.variable_axes(
            distribution, variable, variable_keys, layout_map
        )
        if key in dict(variable_keys):
            used_keys.add(key)
        names = None
        if by_rules is not None:
            if key == "(replicated)":  # No LayoutMap key named it.
                axes, key, names = by_rules.place(variable)
            by_rules.saw(axes)
        if shard == "full":
            axes, key = sharded(variable, axes, key)
        chosen[variable.path] = axes
        entries.append(_entry(variable, "model", axes, key, sizes, names))
    if by_rules is not None:
        by_rules.warn_unused()
    references = {v.path.replace("/", "_"): v for v in model_vars if v.trainable}
    for variable in optimizer_vars:
        reference = layout_keys.reference_of(variable, references)
        if reference is None:
            axes, key = (None,) * len(variable.shape), "(replicated)"
        else:
            axes, key = chosen[reference.path], f"(follows {reference.path})"
            if shard == "optimizer":
                axes, key = sharded(variable, axes, key)
        entries.append(_entry(variable, "optimizer", axes, key, sizes))
    for variable in metric_vars:
        axes = (None,) * len(variable.shape)
        entries.append(_entry(variable, "metric", axes, "(replicated)", sizes))

    outputs = [
        OutputLayout(key=key, path=path, axes=axes)
        for key, path, axes in layout_keys.resolve_outputs(model, output_keys)
    ]
    used_keys.update(o.key for o in outputs)
    if layout_map is not None:
        layout_keys.warn_unmatched(layout_map, used_keys, model_vars, model)
    return ShardingPlan(
        mesh_shape=mesh_shape,
        axis_names=axis_names,
        devices=device_names,
        batch_axis=batch_axis,
        variables=tuple(entries),
        outputs=tuple(outputs),
        output_keys=tuple(output_keys),
        shard=shard,
    )


def _check_mesh(mesh_shape, axis_names, device_names, available_devices):
    if len(set(device_names)) != len(device_names):
        raise ShardingError(
            "The device mesh names a device twice. Received: devices="
            f"{list(device_names)}; give each device once."
        )
    if available_devices is None:
        return
    available = list(available_devices)
    if len(device_names) > len(available):
        raise ShardingError(
            f"The device mesh asks for {len(device_names)} devices, but only "
            f"{len(available)} exist. Received: mesh shape={mesh_shape}, "
            f"axis_names={list(axis_names)}; available devices={available}. "
            "Use a mesh whose shape multiplies to at most the device count."
        )
    missing = [d for d in device_names if d not in available]
    if missing:
        raise ShardingError(
            f"The device mesh names devices that do not exist: {missing}. "
            f"Received: devices={list(device_names)}; available devices="
            f"{available}. Build the mesh from "
            "`keras.distribution.list_devices()`."
        )


def _check_axes_in_mesh(what, axes, axis_names):
    for axis in axes:
        if axis is not None and axis not in axis_names:
            raise ShardingError(
                f"{what} names a layout axis that is not a mesh axis. "
                f"Received: axes={axes}, mesh axis_names={list(axis_names)}; "
                "use mesh axis names or None."
            )


def _variables_by_kind(model):
    seen = set()

    def fresh(variables):
        out = []
        for v in variables:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
        return out

    model_vars = fresh(
        list(model.trainable_variables) + list(model.non_trainable_variables)
    )
    optimizer = getattr(model, "optimizer", None)
    optimizer_vars = fresh(optimizer.variables if optimizer is not None else [])
    metric_vars = fresh(getattr(model, "metrics_variables", []))
    return model_vars, optimizer_vars, metric_vars


def _dtype_name(variable):
    return str(getattr(variable.dtype, "name", variable.dtype))


def _entry(variable, kind, axes, key, sizes, logical=None):
    shape = tuple(int(s) for s in variable.shape)
    dtype = _dtype_name(variable)
    shards = 1
    for index, (dim, axis) in enumerate(zip(shape, axes, strict=True)):
        if axis is None:
            continue
        if dim % sizes[axis]:
            raise ShardingError(
                f"Variable {variable.path!r} cannot be split over mesh axis "
                f"{axis!r}: dimension {index} (size {dim}) is not divisible by "
                "the axis size. "
                f"Received: shape={shape}, axes={axes}, mesh axis {axis!r} of "
                f"size {sizes[axis]}; change the layout or the mesh shape."
            )
        shards *= sizes[axis]
    total = int(math.prod(shape)) * np.dtype(_numpy_dtype(dtype)).itemsize
    return VariableLayout(
        path=variable.path,
        kind=kind,
        shape=shape,
        dtype=dtype,
        axes=tuple(axes),
        key=key,
        bytes_total=total,
        bytes_per_device=total // shards,
        logical=logical,
    )


def _numpy_dtype(dtype):
    # bfloat16 and the float8 types are not numpy dtypes: size them by name.
    if dtype == "bfloat16":
        return "float16"
    if dtype.startswith("float8"):
        return "int8"
    return dtype


def iter_planned_variables(model, plan):
    """`(variable, VariableLayout)` for each variable of `model`, in plan order.

    Raises:
        ShardingError: the model's variables changed since the plan was made.
    """
    variables = [v for group in _variables_by_kind(model) for v in group]
    if [v.path for v in variables] != [e.path for e in plan.variables]:
        raise ShardingError(
            f"Model {model.name!r} has other variables than its sharding plan "
            "was made for. Resolve the plan again after building the model "
            "(keras_parallel does this at each fit/evaluate/predict)."
        )
    yield from zip(variables, plan.variables, strict=True)


def variables_signature(model):
    """A value that changes when the model gains or loses a variable."""
    return tuple(id(v) for group in _variables_by_kind(model) for v in group)
