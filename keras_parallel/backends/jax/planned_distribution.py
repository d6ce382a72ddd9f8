"""The distribution Keras's JAX trainer asks while a planned entry point runs."""

import jax
from keras.distribution import TensorLayout

from keras_parallel.backends.jax import processes
from keras_parallel.keras_seam.keras_compat import Distribution


def distribute_committed(tensor, layout, previous):
    """Keras's `distribute_tensor`, committing an uncommitted array.

    Keras skips the placement of an array whose sharding is equivalent to
    the layout's, and on one device an uncommitted array's is: a metric's
    reset zeros would reach the step uncommitted while the rest of its
    state, the step's own outputs, is committed, and the step would
    compile once more per `fit` (3 times in all, plain Keras once).

    Args:
        tensor: the value (a `jax.Array`, NumPy array or tracer).
        layout: a `TensorLayout` or a JAX sharding.
        previous: Keras's `distribute_tensor`.
    """
    traced = isinstance(tensor, jax.core.Tracer)  # Has no `committed`.
    if isinstance(tensor, jax.Array) and not traced and not tensor.committed:
        sharding = getattr(layout, "backend_layout", layout)
        if isinstance(sharding, jax.sharding.Sharding):
            return jax.device_put(tensor, sharding)
    return previous(tensor, layout)


class PlannedDistribution(Distribution):
    """A `keras.distribution.Distribution` that answers from a `ShardingPlan`.

    Unlike the user's `distribution`, it places whole a batch the data axis
    does not divide (`batches`), and resolves output keys by path suffix.
    """

    def __init__(self, distribution, plan):
        # Across processes each process feeds its own rows
        # (`batches.distribute_batch`): Keras must not shard the data too
        # (it would refuse NumPy arrays).
        super().__init__(
            distribution.device_mesh,
            plan.batch_axis,
            getattr(distribution, "auto_shard_dataset", True)
            and not processes.is_multi_process(),
        )
        self.plan = plan
        self._output_layouts = {}

    @property
    def num_model_replicas(self):
        return self.plan.data_parallel_size

    def get_data_layout(self, data_shape):
        axes = [None] * len(data_shape)
        if data_shape and data_shape[0] % self.plan.data_parallel_size == 0:
            axes[0] = self.plan.batch_axis
        return TensorLayout(axes, self.device_mesh)

    def batch_sharding(self):
        """The `NamedSharding` splitting a batch's rows over the data axis, or
        `None` where that axis has one device."""
        if self.plan.data_parallel_size == 1:
            return None
        return jax.sharding.NamedSharding(
            self.device_mesh.backend_mesh,
            jax.sharding.PartitionSpec(self.plan.batch_axis),
        )

    def get_variable_layout(self, variable):
        if getattr(variable, "_layout", None) is not None:
            return variable._layout
        # Made while running (a lazily built optimizer): replicated until
        # the next plan.
        return TensorLayout([None] * len(variable.shape), self.device_mesh)

    def get_tensor_layout(self, path):
        if path not in self._output_layouts:
            axes = self.plan.output_axes(path)
            self._output_layouts[path] = (
                None if axes is None else TensorLayout(axes, self.device_mesh)
            )
        return self._output_layouts[path]
