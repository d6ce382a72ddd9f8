"""`DataParallel()` over every local device, and `shard=` for both kinds.

`DataParallel` and `ModelParallel` are Keras's classes with one more
argument, `shard` (`keras_parallel.plan.sharding`): what besides the batch is
split over the batch axis. Their `get_variable_layout` applies it, so a
model built inside `distribution.scope()` is created sharded.
"""

import contextlib

import keras

from keras_parallel.backends import executor_class
from keras_parallel.errors import ShardingError
from keras_parallel.keras_seam import keras_compat
from keras_parallel.plan import layout_rules, logical_axes, sharding


class _ShardedLayouts:
    """`get_variable_layout` with `shard="full"`'s batch axis added.

    Keras asks it for the layout of each variable made inside
    `distribution.scope()` (JAX: `Variable._initialize_layout`), so such a
    variable is placed in its shards as it is made. Optimizer slots take
    their variable's layout from Keras (`add_variable_from_reference`); the
    plan splits them as `shard` says once the model is planned.
    """

    def _init_shard(self, shard, shard_min_size):
        sharding.check_shard(shard, shard_min_size)
        self.shard = shard
        self.shard_min_size = shard_min_size

    @contextlib.contextmanager
    def scope(self):
        """Keras's scope, and the backend's placing of new variables.

        Variables made inside it are made in their planned layout
        (`Executor.creation_scope`): with `shard="full"`, no device holds
        more than its shards and the one variable being made.
        """
        with super().scope(), executor_class().creation_scope(self):
            yield

    def _layout_of_new(self, variable, layout):
        """The layout rules give a variable being made; `layout` without rules."""
        return layout

    def get_variable_layout(self, variable):
        layout = self._layout_of_new(variable, super().get_variable_layout(variable))
        if (
            self.shard != "full"
            or getattr(variable, "_layout", None) is not None
            or not sharding.is_floating(variable.dtype)
        ):
            return layout
        mesh = self.device_mesh
        axes, added = sharding.with_batch_axis(
            variable.path,
            variable.shape,
            tuple(layout.axes),
            self.batch_dim_name,
            int(mesh.shape[list(mesh.axis_names).index(self.batch_dim_name)]),
            self.shard_min_size,
        )
        return keras.distribution.TensorLayout(axes, mesh) if added else layout


class DataParallel(_ShardedLayouts, keras.distribution.DataParallel):
    """`keras.distribution.DataParallel` that finds the devices on any backend.

    With no argument it spans every device the backend offers for data
    parallelism: the JAX devices, the processes of a torch process group (one
    device each), the TensorFlow GPUs or logical CPUs (Keras's own class
    lists `keras.distribution.list_devices()`, which on torch needs Keras
    3.16 or keras_parallel imported). Given `device_mesh` or `devices`, it
    is exactly Keras's class.

    Args:
        device_mesh: optional 1D `keras.distribution.DeviceMesh`.
        devices: optional list of devices.
        auto_shard_dataset: shard a `tf.data.Dataset` among processes.
        sync_batchnorm: torch: BatchNormalization uses the statistics of the
            whole global batch, as on JAX and TensorFlow (where it always
            does). Costs one all-reduce per BatchNorm layer and step.
        find_unused_parameters: torch: passed to `DistributedDataParallel`,
            for models whose forward pass skips some weights.
        shard: what else is split over the devices (JAX and torch):
            `None` (default): every device holds whole variables and
            optimizer state. `"full"`: variables, gradients and optimizer
            state are split, each variable gathered where it is used (FSDP,
            ZeRO-3). `"optimizer"`: the optimizer state and the update are
            split, the new values gathered (ZeRO-1/2).
        shard_min_size: variables of fewer elements stay whole (biases,
            norm scales). Default 4096 (16 KiB of float32).

    Example:

    >>> model.compile(optimizer="sgd", loss="mse",
    ...               distribution=keras_parallel.DataParallel())

    A model whose variables and Adam state do not fit one device, built in
    its shards:

    >>> distribution = keras_parallel.DataParallel(shard="full")
    >>> with distribution.scope():
    ...     model = make_model()
    >>> model.compile(optimizer="adam", loss="mse", distribution=distribution)
    """

    def __init__(
        self,
        device_mesh=None,
        devices=None,
        auto_shard_dataset=True,
        sync_batchnorm=False,
        find_unused_parameters=False,
        shard=None,
        shard_min_size=sharding.DEFAULT_SHARD_MIN_SIZE,
    ):
        self._init_shard(shard, shard_min_size)
        if device_mesh is None and not devices:
            devices = executor_class().list_devices()
        super().__init__(
            device_mesh=device_mesh,
            devices=devices,
            auto_shard_dataset=auto_shard_dataset,
        )
        self.sync_batchnorm = sync_batchnorm
        self.find_unused_parameters = find_unused_parameters


class ModelParallel(_ShardedLayouts, keras.distribution.ModelParallel):
    """`keras.distribution.ModelParallel`, with or without a written `LayoutMap`.

    `rules="auto"` derives every variable's layout from its layer (its
    logical axes, `keras_parallel.plan.logical_axes`, placed on mesh axes by
    rules, `keras_parallel.plan.layout_rules`): MLP pairs split as Megatron splits
    them, attention by heads, embeddings by vocabulary. A `LayoutMap` key
    still wins over a rule. `shard="full"` also splits every large variable
    over the batch axis, on a dimension left free: a variable split over
    `model` is then split over both axes (2-D sharding, as MaxText's `fsdp`
    and `tensor` axes or torch's FSDP with tensor parallelism), and one left
    whole is split over the batch axis alone. `shard="optimizer"` splits only
    the optimizer state over the batch axis. JAX and torch.

    Args:
        device_mesh: the `keras.distribution.DeviceMesh`; needed when no
            `layout_map` is given (a `LayoutMap` carries its mesh).
        layout_map: a `keras.distribution.LayoutMap`; its keys win over the
            rules.
        rules: `"auto"` (the default rules of a mesh of a batch axis and one
            model axis, `layout_rules.auto_rules`) or a list of `(logical
            axis, mesh axis or None)` pairs, tried in order for each
            dimension; `None` (default): the `LayoutMap` alone.
        batch_dim_name: the mesh axis the batch is split along (default:
            the mesh's first axis).
        auto_shard_dataset: shard a `tf.data.Dataset` among processes.
        shard: `None`, `"full"` or `"optimizer"`, as for `DataParallel`.
        shard_min_size: variables of fewer elements stay whole. Default 4096.

    Raises:
        ShardingError: neither a `layout_map` nor `rules` with a
            `device_mesh`, or rules that are not pairs of names.

    Example:

    >>> mesh = keras.distribution.DeviceMesh(
    ...     (2, 4), ["data", "model"], keras.distribution.list_devices())
    >>> distribution = keras_parallel.ModelParallel(
    ...     device_mesh=mesh, rules="auto", batch_dim_name="data")
    >>> print(keras_parallel.describe(model, distribution))

    With a written map (a key wins over the rules):

    >>> layout_map = keras.distribution.LayoutMap(mesh)
    >>> layout_map["dense_1/kernel"] = (None, "model")
    >>> distribution = keras_parallel.ModelParallel(
    ...     layout_map=layout_map, batch_dim_name="data", shard="full")
    """

    def __init__(
        self,
        *,
        device_mesh=None,
        layout_map=None,
        rules=None,
        batch_dim_name=None,
        auto_shard_dataset=True,
        shard=None,
        shard_min_size=sharding.DEFAULT_SHARD_MIN_SIZE,
        **kwargs,
    ):
        self._init_shard(shard, shard_min_size)
        self.rules = None if rules is None else layout_rules.check_rules(rules)
        if layout_map is None:
            if device_mesh is None or rules is None:
                raise ShardingError(
                    "ModelParallel needs a layout_map, or rules with a "
                    f"device_mesh. Received: layout_map=None, device_mesh="
                    f"{device_mesh!r}, rules={rules!r}; pass "
                    'ModelParallel(device_mesh=mesh, rules="auto", '
                    "batch_dim_name=...) or a keras.distribution.LayoutMap."
                )
            layout_map = keras.distribution.LayoutMap(device_mesh)
        elif device_mesh is not None and device_mesh is not layout_map.device_mesh:
            raise ShardingError(
                "ModelParallel got a device_mesh and a layout_map of another "
                "mesh. Received: device_mesh="
                f"{device_mesh!r}, layout_map.device_mesh="
                f"{layout_map.device_mesh!r}; pass one, or the map's own mesh."
            )
        super().__init__(
            layout_map=layout_map,
            batch_dim_name=batch_dim_name,
            auto_shard_dataset=auto_shard_dataset,
            **kwargs,
        )
        #: The pairs of the dense-like layers made in this scope, in order.
        self._new_pairs = logical_axes.Pairs()
        # A rule naming an axis the mesh lacks fails here, not at a fit.
        layout_rules.rules_of(
            self, tuple(layout_map.device_mesh.axis_names), self.batch_dim_name
        )

    @contextlib.contextmanager
    def scope(self):
        self._new_pairs = logical_axes.Pairs()  # No pair open from a model before.
        with super().scope():
            yield

    def _layout_of_new(self, variable, layout):
        # A variable made inside `scope()` by a layer, no LayoutMap key
        # naming it: the rules place it as it is made, from its layer alone
        # (the plan, which sees the whole model, moves it if it differs).
        if (
            self.rules is None
            or getattr(variable, "_layout", None) is not None
            or self._layout_map[variable.path] is not None
        ):
            return layout
        layer = keras_compat.layer_making_variable()
        if layer is None or variable.path != f"{layer.path}/{variable.name}":
            # Not made by `add_weight` in its layer's scope (a model built by
            # its first call initializes its variables later, in the outer
            # model's scope): the plan places it.
            return layout
        logical = logical_axes.of_new_variable(layer, variable, self._new_pairs)
        mesh = self.device_mesh
        names = tuple(mesh.axis_names)
        rules = layout_rules.rules_of(self, names, self.batch_dim_name)
        sizes = dict(zip(names, (int(n) for n in mesh.shape), strict=True))
        axes, _, _ = layout_rules.place(logical, tuple(variable.shape), rules, sizes)
        return keras.distribution.TensorLayout(axes, mesh)
