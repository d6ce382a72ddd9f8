"""`ModelParallel` on torch: the executor's hooks for a mesh of DTensors.

A distribution that splits variables or asks for `shard=` runs through a
`MeshRunner` (`runs_on_mesh`); one that splits only the batch keeps DDP,
which is faster. `apply` places the variables as DTensors and, for the
model's distributed life, gathers them to be read or saved, and makes the
`MeshSteps` the executor installs; `release` makes every variable plain again.
"""

from keras import ops

from keras_parallel.backends.torch import dtensor_layouts
from keras_parallel.backends.torch import group as torch_group
from keras_parallel.backends.torch.mesh_steps import MeshSteps
from keras_parallel.keras_seam.overrides import Overrides, override
from keras_parallel.keras_seam.replacements import Replacements
from keras_parallel.plan.layout_keys import reference_of
from keras_parallel.plan.sharding_plan import iter_planned_variables
from keras_parallel.run.chief import chief_only_saving, chief_saving


def runs_on_mesh(distribution):
    """Whether a distribution runs on DTensor variables (`MeshRunner`).

    Args:
        distribution: a `keras.distribution.Distribution`.

    Returns:
        True if its mesh splits a variable (`splits_model`) or it asks to
        shard variables or optimizer state over a batch axis of more than
        one device (`shard=`, `keras_parallel.plan.sharding`), even on a 1-D
        mesh: DDP keeps whole copies of both on every rank. One device
        splits nothing: plain Keras, as without `shard`.
    """
    if getattr(distribution, "shard", None) is not None:
        mesh = distribution.device_mesh
        sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
        if int(sizes.get(distribution.batch_dim_name, 1)) > 1:
            return True
    return getattr(distribution, "_layout_map", None) is not None and splits_model(
        distribution
    )


def splits_model(distribution):
    """Whether a distribution's mesh splits anything but the batch.

    Args:
        distribution: a `keras.distribution.Distribution`.

    Returns:
        True if an axis other than `batch_dim_name` has more than one
        device: `ModelParallel` needs DTensors. A mesh `(4, 1)` does not:
        it is data parallelism, and runs as such (DDP).
    """
    mesh = distribution.device_mesh
    return any(
        int(size) > 1
        for name, size in zip(mesh.axis_names, mesh.shape, strict=True)
        if name != distribution.batch_dim_name
    )


class MeshRunner:
    """Runs a `ShardingPlan` with DTensor variables on a torch mesh.

    Args:
        executor: the `TorchExecutor` (distribution, rank, collectives).
    """

    def __init__(self, executor):
        self.executor = executor
        self.mesh = None
        self.steps = None
        self.model = None
        #: Each placed variable's `numpy` and `assign` (`_make_usable`).
        self._methods = Replacements()

    def apply(self, model, plan):
        """Places the planned variables as DTensors (a collective)."""
        if model is not self.model:
            self.release_steps()
        self.model = model
        keras_mesh = self.executor.distribution.device_mesh
        if self.mesh is None:
            device_type = torch_group.device_type()
            self.mesh = dtensor_layouts.torch_mesh(keras_mesh, device_type)
        mesh = self.mesh
        gradients = gradient_axes(model, plan)
        with dtensor_layouts.promotion():
            for variable, entry in iter_planned_variables(model, plan):
                if dtensor_layouts.is_placed(entry, variable):
                    dtensor_layouts.place(
                        variable,
                        entry.axes,
                        keras_mesh,
                        mesh,
                        gradient_axes=gradients.get(id(variable)),
                    )
                    self._make_usable(variable)
                else:
                    # One the plan keeps plain (a metric's state) that was
                    # made split inside `distribution.scope()` (`creation`).
                    dtensor_layouts.unplace(variable)
        dtensor_layouts.retrack(model)
        if self.steps is None:
            self.steps = MeshSteps(model, mesh, plan, self.executor.process_index)
        else:
            # Planned again (fit built the optimizer) while an entry point
            # may run: the installed steps take the new plan.
            self.steps.plan = plan
        torch_group.on_teardown(self)

    def saving_override(self, model):
        """`Executor.saving_override`: process 0 gathers the split variables
        and writes; the others write nothing (both take part in the gather).

        For the model's whole distributed life, not only while an entry
        point runs: after `fit` with a `ShardingCallback` (whose own saving
        ends with the run), the variables are still split, and a save is
        still a collective.
        """
        saving = self.executor.checkpoint_io.saving
        writes = self.executor.chief_writes()
        if not self.executor.is_chief:
            return lambda: chief_only_saving(model, saving, writes)
        if writes is None:
            return lambda: override(model, GatheredSaving(saving))

        def gathered_and_told():
            # Told after the write: `ChiefSaving` goes first in the class.
            ends = [
                override(model, GatheredSaving(saving)),
                chief_saving(model, writes),
            ]
            return lambda: [end() for end in reversed(ends)]

        return gathered_and_told

    def _make_usable(self, variable):
        # Outside an entry point too (after `fit` through either door), a
        # placed variable reads and takes whole values as a plain one does:
        # Keras's `Variable.numpy()` (which `Layer.get_weights()` calls)
        # fails on a DTensor (".numpy() is not supported for tensor
        # subclasses"), and its `assign` (`set_weights`, `load_weights`)
        # copies a plain value into a DTensor, which torch refuses ("got
        # mixed torch.Tensor and DTensor"). Only these methods of this
        # object: `np.asarray(variable)` still raises, so that a callback
        # reading weights on rank 0 alone (a `TensorBoard` histogram) fails
        # at once rather than starting a gather the other ranks never join.
        if "numpy" in vars(variable):
            return  # Placed by an earlier `apply`.
        assign = variable.assign

        def numpy():
            # A collective: every rank must read the same variables in the
            # same order, as `get_weights()` on every rank does.
            return ops.convert_to_numpy(dtensor_layouts.whole_value(variable.value))

        def assign_replicated(value):
            # A whole value, the same on every process: each keeps its own
            # part of it (`dtensor_layouts.promotion`), with no collective.
            with dtensor_layouts.promotion():
                return assign(value)

        self._methods.replace(variable, "numpy", numpy)
        self._methods.replace(variable, "assign", assign_replicated)

    def release_steps(self):
        if self.steps is not None:
            self.steps.uninstall()
        self.steps = None

    def release(self, model):
        """Every variable whole and plain again (a collective)."""
        self.release_steps()
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            variables += list(optimizer.variables)
        for variable in variables:
            dtensor_layouts.unplace(variable)
        dtensor_layouts.retrack(model)
        self._methods.restore()
        self.model = None

    def close(self):
        """Drops the steps before the process group goes (at exit)."""
        self.release_steps()


def gradient_axes(model, plan):
    """The layout of each model variable's gradient where it is not its own.

    Under `shard="optimizer"` a variable stays whole but its optimizer slots
    are split over the batch axis. Its gradient then takes the slots'
    layout: the sums over the batch are reduce-scattered, not all-reduced,
    and each rank updates its shard of the slots from its shard of the
    gradient; the update of the whole variable gathers the shards (DTensor
    all-gathers the update of a replicated variable from a sharded one).
    That is ZeRO-2: a whole gradient is never reduced, and each rank keeps
    only its shard of it. Under any other plan a gradient takes its
    variable's layout.

    Args:
        model: the model the plan was made for.
        plan: its `ShardingPlan`.

    Returns:
        `{id(variable): axes}` for the variables whose gradient is laid out
        otherwise than the variable.
    """
    if plan.shard != "optimizer":
        return {}
    planned = list(iter_planned_variables(model, plan))
    axes_of = {id(v): e.axes for v, e in planned}
    references = {v.path.replace("/", "_"): v for v, e in planned if e.kind == "model"}
    gradients = {}
    for variable, entry in planned:
        if entry.kind != "optimizer":
            continue
        reference = reference_of(variable, references)
        if reference is None or not reference.trainable:
            continue
        if entry.axes != axes_of[id(reference)]:
            gradients.setdefault(id(reference), entry.axes)
    return gradients


class GatheredSaving(Overrides):
    """`save` and `save_weights` with the split variables gathered first.

    On rank 0; the other ranks join the same gathers without writing
    (`chief.chief_only_saving`): Keras then reads plain values.

    Args:
        saving: the executor's `checkpoint_io.saving`.
    """

    names = ("save", "save_weights")

    def __init__(self, saving):
        self.saving = saving

    def save(self, *args, **kwargs):
        with self.saving(self.model):
            return self.overridden.save(*args, **kwargs)

    def save_weights(self, *args, **kwargs):
        with self.saving(self.model):
            return self.overridden.save_weights(*args, **kwargs)
