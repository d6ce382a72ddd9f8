"""Where a batch's rows go on JAX: placed on the mesh, split inside the step.

A batch the data axis does not divide is placed whole on every device and
split inside the compiled step, so batches of any size train exactly.
"""

import functools

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
    """Keras's predict step, its NumPy inputs laid out as batches.

    Keras's JAX `predict_on_batch` passes its NumPy batch unlaid-out, so
    every device would compute all of it; `predict`'s `jax.Array`s pass.
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

    Keras reuses the first batch's layout and would refuse an epoch's last
    batch (43 samples over 8 devices). A `NamedSharding` needs equal shards,
    so such a batch is placed whole and split in the step: one extra
    compilation, and the whole batch sent to every device.

    Args:
        previous: the function this one replaced (Keras's).
        divided: across processes, the `divided_input.DividedInput` that
            places the batches a process loaded only its rows of.
    """
    part = divided.part(per_process_batch) if divided is not None else None
    if part is not None:
        return divided.place(per_process_batch, *part)
    sharding = layout.backend_layout if isinstance(layout, TensorLayout) else layout
    ways = _split_ways(sharding)
    if ways and isinstance(per_process_batch, JAXSparse):
        raise sparse_batch_error(per_process_batch)
    if ways and per_process_batch.ndim and per_process_batch.shape[0] % ways:
        sharding = jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec()
        )
    if processes.is_multi_process():
        # Each process holds the whole batch; it transfers only its rows.
        return processes.place(per_process_batch, sharding)
    return previous(per_process_batch, sharding, batch_dim_name)


@functools.lru_cache(maxsize=64)
def _split_ways(sharding):
    """Over how many devices `sharding` splits a batch's rows; 0 where its
    spec leaves the rows whole.

    Asked for every leaf of every batch, of the few shardings a run uses:
    cached (a `NamedSharding` hashes by its mesh and spec).
    """
    spec = getattr(sharding, "spec", ())
    if not spec or spec[0] is None:
        return 0
    names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    ways = 1
    for name in names:
        ways *= sharding.mesh.shape[name]
    return ways


def sparse_batch_error(sparse):
    """The `ShardingError` refusing the sparse array `sparse` as a batch."""
    return ShardingError(
        "A sparse batch cannot be split over the devices on JAX: a "
        "sparse array has no rows to lay out on the data axis. Received: "
        f"a {type(sparse).__name__} batch of shape {tuple(sparse.shape)} "
        "(sparse input: a SciPy sparse matrix, a tf.SparseTensor or a "
        "BCOO, or keras.Input(sparse=True)); densify it (x.toarray(), "
        "tf.sparse.to_dense, x.todense()) and build the model with "
        "keras.Input(sparse=False), train it on one device, or use the "
        "TensorFlow backend, which splits sparse batches. Nothing was "
        "trained."
    )


def refusing_sparse(get_jax_iterator):
    """A data adapter's `get_jax_iterator`, refusing sparse batches.

    Keras's adapters turn SciPy and TensorFlow sparse input into BCOO arrays
    here; laid out leaf by leaf, a BCOO's index and value arrays would be
    split as if they were rows (JAX's `device_put` then refuses them, or
    splits them wrongly). Refused before the batch reaches a step, whatever
    the model declares, so the weights stay as they were.
    """

    def batches(adapter, *args, **kwargs):
        iterator = iter(get_jax_iterator(adapter, *args, **kwargs))
        # One adapter makes every batch alike, sparse or dense: its first is
        # looked at (a later sparse leaf is still refused where it is laid
        # out, `distribute_batch`), the rest pass untouched.
        for batch in iterator:
            for leaf in jax.tree_util.tree_leaves(batch, is_leaf=_is_sparse):
                if _is_sparse(leaf):
                    raise sparse_batch_error(leaf)
            yield batch
            break
        yield from iterator

    return batches


def _is_sparse(leaf):
    return isinstance(leaf, JAXSparse)


def jit_splitting_batches(function, *args, previous, batch_sharding, donate, **kwargs):
    """Keras's step `jit`, the step's batch split over the data axis inside it.

    XLA splits a batch placed whole as evenly as it can (100 rows over 8
    devices: 13 on each of 7, 9 on the last) and leaves the padding out.

    Args:
        function: a step `(state, data)`, or a one-argument function
            (`predict`'s concatenation), compiled unchanged.
        previous: the `jit` this one replaced (Keras's).
        batch_sharding: `PlannedDistribution.batch_sharding()`.
        donate: whether to keep Keras's buffer donation. On XLA:CPU the
            donated step was 4.5 to 5.4 % slower at batch 512
            (docs/benchmarks.md), and the copy it saves is in host memory.
    """
    if not donate:
        kwargs.pop("donate_argnums", None)
    if batch_sharding is None or _has_other_axes(batch_sharding.mesh):
        # With a second mesh axis, XLA's padded split gives a gather
        # (Embedding) a wrong gradient ((4, 2), (2, 4), (2, 2) in plain JAX).
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
    """`data`'s arrays as long as its first one, constrained to `sharding`."""
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(data) if np.ndim(leaf)]
    if not leaves:
        return data
    rows = leaves[0].shape[0]

    def split(leaf):
        if np.ndim(leaf) and leaf.shape[0] == rows:
            return jax.lax.with_sharding_constraint(leaf, sharding)
        return leaf

    return jax.tree_util.tree_map(split, data)
