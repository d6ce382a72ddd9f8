"""What one train step takes of a device under a plan, before it runs.

XLA compiles Keras's own train step for the plan's layouts and the global
batch, from shapes alone (no array is made or moved), and reports the memory
one device's part of the step needs (`memory_analysis`: arguments, outputs,
temporaries; on CPU too). The collectives in the compiled step say what it
moves. `keras_parallel.auto.auto` compares the candidates by these.
"""

import contextlib
import re

import jax
import keras
import numpy as np
from keras.distribution import TensorLayout

from keras_parallel.backends.base import StepMemory
from keras_parallel.backends.jax.planned_distribution import PlannedDistribution
from keras_parallel.plan.sharding_plan import iter_planned_variables

_COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
_COLLECTIVE_LINE = re.compile(
    r"=\s*(?P<type>.+?)\s+(?P<op>" + "|".join(_COLLECTIVES) + r")(-start)?\("
)
_ARRAY_TYPE = re.compile(r"\b(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]")
#: `replica_groups=[2,4]<=[8]`: 2 groups of 4; `={{0,1,2,3},...}`: listed.
_IOTA_GROUPS = re.compile(r"replica_groups=\[([0-9]+),([0-9]+)\]")
_LISTED_GROUPS = re.compile(r"replica_groups=\{\{([0-9, ]*)\}")
#: `replica_groups=mesh['data'=4,'model'=2] {'model'}`: over the named axes.
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'([^']+)'=([0-9]+)")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1}


def step_memory(model, distribution, plan, batch):
    """The memory and traffic of one train step of `model` under `plan`.

    Args:
        model: the built model, its optimizer and metrics built.
        distribution: the distribution `plan` was resolved from.
        plan: the `ShardingPlan`.
        batch: the global batch `(x, y, sample_weight)`: arrays or specs
            with `shape` and `dtype`.

    Returns:
        A `StepMemory`.
    """
    planned = PlannedDistribution(distribution, plan)
    mesh = distribution.device_mesh
    layouts = {
        id(variable): TensorLayout(entry.axes, mesh).backend_layout
        for variable, entry in iter_planned_variables(model, plan)
    }
    whole = jax.sharding.NamedSharding(mesh.backend_mesh, jax.sharding.PartitionSpec())

    def variable_spec(variable):
        value = variable.value
        sharding = layouts.get(id(variable), whole)
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)

    def batch_spec(leaf):
        if leaf is None:
            return None
        shape = tuple(int(d) for d in leaf.shape)
        layout = planned.get_data_layout(shape)
        dtype = keras.backend.standardize_dtype(leaf.dtype)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=layout.backend_layout)

    optimizer = model.optimizer
    state = (
        [variable_spec(v) for v in model.trainable_variables],
        [variable_spec(v) for v in model.non_trainable_variables],
        [variable_spec(v) for v in optimizer.variables] if optimizer else [],
        [variable_spec(v) for v in model.metrics_variables],
    )
    data = keras.tree.map_structure(batch_spec, tuple(batch))
    # As Keras jits its step under a distribution: the new state laid out
    # as the old (an updated variable the step computed in shards is
    # gathered back), and the old state donated where the executor keeps
    # donation (not on CPU: `batches.jit_splitting_batches`).
    state_shardings = keras.tree.map_structure(lambda spec: spec.sharding, state)
    on_cpu = all(
        device.platform == "cpu"
        for device in np.asarray(mesh.backend_mesh.devices).flat
    )
    step = jax.jit(
        model.train_step,
        out_shardings=(None, state_shardings),
        donate_argnums=() if on_cpu else 0,
    )
    with _in_force(planned):
        compiled = step.lower(state, data).compile()
    devices = int(np.asarray(mesh.devices).size)
    return StepMemory(
        _peak(compiled.memory_analysis()), moved_bytes(compiled.as_text(), devices)
    )


@contextlib.contextmanager
def _in_force(distribution):
    # The step is traced as it runs: layer outputs constrained by the plan.
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(distribution)
    try:
        yield
    finally:
        keras.distribution.set_distribution(previous)


def _peak(stats):
    peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    if peak:
        return peak
    return int(
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
    )


def moved_bytes(hlo_text, num_devices):
    """The bytes one device sends in a compiled step's collectives.

    As ring algorithms move them, for a collective over a group of `n`
    devices and a result of `s` bytes: an all-reduce `2 s (n-1)/n`, an
    all-gather `s (n-1)/n`, a reduce-scatter `s (n-1)` (its input is `n s`),
    an all-to-all `s (n-1)/n`, a permute `s`.

    Args:
        hlo_text: `compiled.as_text()` of an SPMD-partitioned step.
        num_devices: the group size where a collective names none.

    Returns:
        An int.
    """
    total = 0.0
    for line in hlo_text.splitlines():
        match = _COLLECTIVE_LINE.search(line)
        if match is None:
            continue
        size = 0
        for array in _ARRAY_TYPE.finditer(match.group("type")):
            dims = [int(d) for d in array.group("dims").split(",") if d]
            size += int(np.prod(dims, dtype=np.int64)) * _dtype_bytes(
                array.group("dtype")
            )
        n = _group_size(line, num_devices)
        share = (n - 1) / n if n > 1 else 0.0
        factor = {
            "all-reduce": 2 * share,
            "all-gather": share,
            "reduce-scatter": share * n,
            "all-to-all": share,
            "collective-permute": 1.0,
        }[match.group("op")]
        total += size * factor
    return int(total)


def _group_size(line, default):
    """The devices of one group of a collective's `replica_groups`."""
    iota = _IOTA_GROUPS.search(line)
    if iota:
        return int(iota.group(2))
    listed = _LISTED_GROUPS.search(line)
    if listed:
        return len([d for d in listed.group(1).split(",") if d.strip()])
    named = _MESH_GROUPS.search(line)
    if named:
        sizes = dict(_MESH_AXIS.findall(named.group(1)))
        axes = re.findall(r"'([^']+)'", named.group(2))
        if axes and all(a in sizes for a in axes):
            return int(np.prod([int(sizes[a]) for a in axes]))
    return default


def _dtype_bytes(name):
    if name in _DTYPE_BYTES:
        return _DTYPE_BYTES[name]
    bits = re.search(r"[0-9]+$", name)
    return max(1, int(bits.group()) // 8) if bits else 4
