"""`DataParallel()` over every local device, and `shard=` for both kinds.

`DataParallel` and `ModelParallel` are Keras's classes with one more
argument, `shard` (`keras_parallel.sharding`): what besides the batch is
split over the batch axis. Their `get_variable_layout` applies it, so a
model built inside `distribution.scope()` is created sharded.
"""

import contextlib

import keras

from keras_parallel import sharding
from keras_parallel.backends import executor_class


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

    def get_variable_layout(self, variable):
        layout = super().get_variable_layout(variable)
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
    """`keras.distribution.ModelParallel` whose other variables can be sharded.

    The `LayoutMap` splits what it names over its axes (say `model`), as in
    Keras. `shard="full"` also splits every large variable over the batch
    axis, on a dimension the map leaves free: a variable the map splits over
    `model` is then split over both axes (2-D sharding, as MaxText's `fsdp`
    and `tensor` axes or torch's FSDP with tensor parallelism), and one it
    does not name is split over the batch axis alone. `shard="optimizer"`
    splits only the optimizer state over the batch axis. JAX and torch.

    Args:
        layout_map: a `keras.distribution.LayoutMap`.
        batch_dim_name: the mesh axis the batch is split along (default:
            the mesh's first axis).
        auto_shard_dataset: shard a `tf.data.Dataset` among processes.
        shard: `None`, `"full"` or `"optimizer"`, as for `DataParallel`.
        shard_min_size: variables of fewer elements stay whole. Default 4096.

    Example:

    >>> mesh = keras.distribution.DeviceMesh(
    ...     (4, 2), ["batch", "model"], keras.distribution.list_devices())
    >>> layout_map = keras.distribution.LayoutMap(mesh)
    >>> layout_map["dense_1/kernel"] = (None, "model")
    >>> distribution = keras_parallel.ModelParallel(
    ...     layout_map=layout_map, batch_dim_name="batch", shard="full")
    """

    def __init__(
        self,
        *,
        layout_map=None,
        batch_dim_name=None,
        auto_shard_dataset=True,
        shard=None,
        shard_min_size=sharding.DEFAULT_SHARD_MIN_SIZE,
        **kwargs,
    ):
        self._init_shard(shard, shard_min_size)
        super().__init__(
            layout_map=layout_map,
            batch_dim_name=batch_dim_name,
            auto_shard_dataset=auto_shard_dataset,
            **kwargs,
        )
