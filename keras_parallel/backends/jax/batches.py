"""Where a batch's rows go on JAX: placed on the mesh, split inside the step.

`distribute_batch` places each batch (whole on every device where the data
axis does not divide it), `jit_splitting_batches` splits it inside the
compiled step, and `laid_out_inputs` lays out `predict_on_batch`'s NumPy
inputs as `predict`'s are.
"""

import jax
import keras
import numpy as np
from jax.experimental.sparse import JAXSparse
from keras.distribution import TensorLayout

from keras_parallel.backends.jax import processes
from keras_parallel.backends.jax.keras_compat import (
    distribution_lib as keras_jax_distribution_lib,
)
from keras_parallel.errors import ShardingError


def laid_out_inputs(function):
    """Keras's predict step, its host (NumPy) inputs laid out as batches.

    Keras's JAX `predict_on_batch` hands its NumPy batch to the compiled
    step as it is, never laid out by the distribution: every device would
    compute the whole batch. `predict`'s batches arrive laid out already
    (`jax.Array`s) and pass unchanged.
    """

    def lay_out(value):
        if not isinstance(value, np.ndarray):
            return value  # Laid out already (`predict`), or not an array.
        distribution = keras.distribution.distribution()
        if distribution is None:
            return value
        layout = distribution.get_data_layout(value.shape)
        return keras_jax_distribution_lib.distribute_data_input(
            value, layout, distribution.batch_dim_name
        )

    def step(state, iterator):
        batches = (keras.tree.map_structure(lay_out, batch) for batch in iterator)
        return function(state, batches)

    return step


def distribute_batch(per_process_batch, layout, batch_dim_name, previous, divided=None):
    """Keras's `distribute_data_input`, for batches of any size.

    Keras's JAX epoch iterator computes the data layout from the first batch
    and reuses it, so the last batch of an epoch (43 samples over 8 devices)
    would be refused as indivisible. A `NamedSharding` cannot split such a
    batch (its shards must be equal), so it is placed whole on every device
    and the compiled step splits it (`jit_splitting_batches`): no sample is
    padded, dropped or repeated. It costs one extra compilation, which a
    batch of a new shape costs on one device too, and a transfer of the
    whole batch to every device rather than of its rows to each.

    `previous` is the function this one replaced (Keras's). Across
    processes, `divided` (a `divided_input.DividedInput`) places the
    batches a process loaded only its rows of.
    """
    part = divided.part(per_process_batch) if divided is not None else None
    if part is not None:
        return divided.place(per_process_batch, *part)
    sharding = layout.backend_layout if isinstance(layout, TensorLayout) else layout
    spec = getattr(sharding, "spec", ())
    if spec and spec[0] is not None and isinstance(per_process_batch, JAXSparse):
        raise ShardingError(
            "A sparse batch cannot be split over the devices on JAX: a "
            "sparse array has no rows to lay out on the data axis. Received: "
            f"a {type(per_process_batch).__name__} batch of shape "
            f"{tuple(per_process_batch.shape)} (sparse input: a SciPy sparse "
            "matrix, a tf.SparseTensor, or keras.Input(sparse=True)); densify "
            "it (x.toarray(), tf.sparse.to_dense) and build the model with "
            "keras.Input(sparse=False), train it on one device, or use the "
            "TensorFlow backend, which splits sparse batches. Nothing was "
            "trained."
        )
    if spec and spec[0] is not None and per_process_batch.ndim:
        names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
        ways = 1
        for name in names:
            ways *= sharding.mesh.shape[name]
        if per_process_batch.shape[0] % ways:
            sharding = jax.sharding.NamedSharding(
                sharding.mesh, jax.sharding.PartitionSpec()
            )
    if processes.is_multi_process():
        # This process holds the whole global batch (arrays, a PyDataset or
        # a generator: `divided_input`); it transfers only its devices' rows.
        return processes.place(per_process_batch, sharding)
    return previous(per_process_batch, sharding, batch_dim_name)


def jit_splitting_batches(function, *args, previous, batch_sharding, donate, **kwargs):
    """Keras's step `jit`, the step's batch split over the data axis inside it.

    A batch the data axis does not divide cannot be placed split (a
    `NamedSharding` needs equal shards), so `distribute_batch` places it
    whole on every device; inside the compiled step it is then constrained
    to the data axis like any other batch (on a mesh whose only axis of
    several devices is the data axis). XLA splits it as evenly as it
    can (100 rows over 8 devices: 13 rows on each of 7, 9 on the last,
    padded to 13) and leaves the padding out of every result: a sharding
    never changes what a program computes. A batch placed split already is
    left as it is.

    Args:
        function: the function Keras compiles: a step `(state, data)`, or
            (`steps_per_execution > 1` in `predict`) its one-argument
            concatenation, compiled unchanged.
        *args: `jit`'s other positional arguments.
        previous: the `jit` this one replaced (Keras's).
        batch_sharding: the sharding a batch's rows are split by
            (`PlannedDistribution.batch_sharding`); `None` splits nothing.
        donate: whether to keep Keras's buffer donation. Keras donates the
            state to its step so that an accelerator holds one copy of the
            variables, not two; accelerators keep it. On XLA:CPU, over
            several devices, the donated step of the guide's convnet was
            4.5 to 5.4 % slower at batch 512 here (at batch 64 the whole
            `fit` was faster donated, as it frees no state per step;
            docs/benchmarks.md), and the copy it saves lives in host
            memory; the guide's own loop does not donate.
        **kwargs: `jit`'s keyword arguments.

    Returns:
        The compiled function.
    """
    if not donate:
        kwargs.pop("donate_argnums", None)
    if batch_sharding is None or _has_other_axes(batch_sharding.mesh):
        # On a mesh with a second axis, XLA's padded split of an uneven
        # batch gives a gather (Embedding) a wrong gradient (seen on (4, 2),
        # (2, 4), (2, 2) in plain JAX): that batch stays whole there.
        return previous(function, *args, **kwargs)

    def step(*step_args):
        if len(step_args) == 2:
            state, data = step_args
            step_args = (state, _split_rows(data, batch_sharding))
        return function(*step_args)

    return previous(step, *args, **kwargs)


def _has_other_axes(mesh):
    """Whether more than one axis of `mesh` spans several devices."""
    return sum(size > 1 for size in mesh.shape.values()) > 1


def _split_rows(data, sharding):
    """Every array of `data` with the batch's rows, constrained to `sharding`.

    The batch's rows are the first dimension of its first array; an array
    of another length (none in Keras's own data) is left as it is.
    """
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(data) if np.ndim(leaf)]
    if not leaves:
        return data
    rows = leaves[0].shape[0]

    def split(leaf):
        if np.ndim(leaf) and leaf.shape[0] == rows:
            return jax.lax.with_sharding_constraint(leaf, sharding)
        return leaf

    return jax.tree_util.tree_map(split, data)
